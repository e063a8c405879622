"""``hfmca`` keeps freed memory in the process (glibc), so that repeated large allocations stop faulting pages in.

The setting is process-wide, so its effect is measured in fresh interpreters; page faults are read from getrusage.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Allocates, touches and frees a 40 MiB tensor (above glibc's default 32 MiB mmap ceiling) five times after
# a warm-up; prints the faults per allocation. The warm-up is long because torch's aligned allocations leave
# the first freed blocks a few bytes too small for the next request: the kept heap settles after ~7 rounds.
PROBE = """
import resource, torch
{setup}
def allocate():
    x = torch.empty(10 << 20); x.fill_(1.0); del x
for _ in range(20):
    allocate()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    allocate()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults_per_allocation(setup: str, **env: str) -> float:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return float(result.stdout.split()[-1])


KEEP = "from hfmca_lightning.runtime.cpu_memory import keep_freed_memory\nassert keep_freed_memory()"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")


@pytest.mark.integration  # a subprocess or a training run
def test_keeping_freed_memory_stops_large_allocations_from_faulting_pages_in():
    plain = _faults_per_allocation("")
    kept = _faults_per_allocation(KEEP)
    assert plain > 5000  # 40 MiB = 10,240 pages, mapped afresh on every allocation by default
    assert kept < 100, kept


def test_the_hfmca_command_keeps_freed_memory_first(monkeypatch: pytest.MonkeyPatch):
    from hfmca_lightning.cli import console

    calls = []
    monkeypatch.setattr(console, "keep_freed_memory_for_cpu_runs", lambda: calls.append("kept"))
    with pytest.raises(SystemExit):
        console.main(["fit", "--print_config=nonsense"])
    assert calls == ["kept"]


def test_it_applies_to_cpu_runs_unless_asked(monkeypatch: pytest.MonkeyPatch):
    """Measured to help CPU training steps; on a machine with a CUDA device only when ``HFMCA_KEEP_FREED_MEMORY=1``."""
    import torch

    from hfmca_lightning.runtime import cpu_memory

    applied = []
    monkeypatch.setattr(cpu_memory, "keep_freed_memory", lambda: applied.append(True) or True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("HFMCA_KEEP_FREED_MEMORY", raising=False)
    assert cpu_memory.keep_freed_memory_for_cpu_runs() is False and applied == []
    monkeypatch.setenv("HFMCA_KEEP_FREED_MEMORY", "1")
    assert cpu_memory.keep_freed_memory_for_cpu_runs() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("HFMCA_KEEP_FREED_MEMORY")
    assert cpu_memory.keep_freed_memory_for_cpu_runs() is True and applied == [True, True]


def test_it_reports_whether_it_applied(monkeypatch: pytest.MonkeyPatch):
    from hfmca_lightning.runtime.cpu_memory import keep_freed_memory

    monkeypatch.setenv("HFMCA_KEEP_FREED_MEMORY", "off")
    assert keep_freed_memory() is False  # the opt-out
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.delenv("HFMCA_KEEP_FREED_MEMORY")
    assert keep_freed_memory() is False
