"""``hfmca`` keeps freed memory in the process (glibc), so that repeated large allocations stop faulting pages in.

The setting is process-wide, so each case runs in a fresh interpreter; page faults are read from getrusage.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Allocates, touches and frees a 40 MiB tensor (above glibc's default 32 MiB mmap ceiling, like a ResNet
# activation at batch 8 x 9) a few times after a warm-up; prints whether the setting applied and the faults
# per allocation.
PROBE = """
import resource, sys, torch
from hfmca_lightning.cli import main
{setup}
def allocate():
    x = torch.empty(10 << 20); x.fill_(1.0); del x
for _ in range(3):
    allocate()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    allocate()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults_per_allocation(setup: str, **env: str) -> float:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup)], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return float(result.stdout.split()[-1])


# ``hfmca --help`` runs main() (which applies the setting first) and exits.
RUN_THE_COMMAND = "try:\n    main(['--help'])\nexcept SystemExit:\n    pass"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")


def test_the_hfmca_command_stops_large_allocations_from_faulting_pages_in():
    plain = _faults_per_allocation("")
    kept = _faults_per_allocation(RUN_THE_COMMAND)
    assert plain > 5000  # 40 MiB = 10,240 pages, mapped afresh on every allocation by default
    assert kept < 100, kept


def test_the_environment_variable_turns_it_off():
    assert _faults_per_allocation(RUN_THE_COMMAND, HFMCA_KEEP_FREED_MEMORY="0") > 5000


def test_it_reports_whether_it_applied(monkeypatch: pytest.MonkeyPatch):
    from hfmca_lightning.cpu_memory import keep_freed_memory

    monkeypatch.setenv("HFMCA_KEEP_FREED_MEMORY", "off")
    assert keep_freed_memory() is False
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.delenv("HFMCA_KEEP_FREED_MEMORY")
    assert keep_freed_memory() is False
