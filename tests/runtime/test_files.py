"""Files written whole or not at all: renamed over their target, a failed write keeps the previous file and names
the target, partial files removed only once their writer is gone."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfmca_lightning.runtime.files import StagedFiles, partial_path, write_atomically, write_text_atomically

REPO = Path(__file__).resolve().parents[2]


def test_a_write_renames_a_new_file_over_the_target(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    os.link(target, tmp_path / "link")  # the old file's inode
    write_text_atomically(target, "new")
    assert target.read_text() == "new"
    assert (tmp_path / "link").read_text() == "old"  # not rewritten in place
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "report.json"]


def test_a_failed_write_keeps_the_previous_file_and_names_the_target(tmp_path):
    target = tmp_path / "backbone.pt"
    target.write_bytes(b"previous")

    def disk_full(handle):
        handle.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as raised:
        write_atomically(target, disk_full)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert target.read_bytes() == b"previous"
    assert [path.name for path in tmp_path.iterdir()] == ["backbone.pt"]


# torch.save into a file past RLIMIT_FSIZE: torch reports the failed write as a RuntimeError without its errno.
TORCH_SAVE_PAST_THE_LIMIT = """
import errno, resource, signal, sys, torch
from hfmca_lightning.runtime.files import write_atomically
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))
try:
    write_atomically(sys.argv[1], lambda handle: torch.save({"weight": torch.zeros(100_000)}, handle))
except OSError as error:
    print(errno.errorcode[error.errno], error.filename)
"""


def test_torch_save_past_a_file_size_limit_is_an_os_error_naming_the_target(tmp_path):
    target = tmp_path / "weights.pt"
    target.write_bytes(b"previous")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", TORCH_SAVE_PAST_THE_LIMIT, str(target)], env=env, capture_output=True, text=True
    )
    assert result.stdout.split() == ["EFBIG", str(target)], result.stdout + result.stderr[-2000:]
    assert target.read_bytes() == b"previous"
    assert [path.name for path in tmp_path.iterdir()] == ["weights.pt"]


def test_staged_files_are_renamed_only_when_all_are_written(tmp_path):
    (tmp_path / "backbone.pt").write_bytes(b"old weights")
    (tmp_path / "backbone.json").write_text("old description")
    with pytest.raises(OSError), StagedFiles() as files:
        files.write(tmp_path / "backbone.pt", lambda handle: handle.write(b"new weights"))
        files.write(tmp_path / "embeddings_test.npz", lambda handle: (_ for _ in ()).throw(OSError(errno.EFBIG, "x")))
        files.write_text(tmp_path / "backbone.json", "new description")
    assert (tmp_path / "backbone.pt").read_bytes() == b"old weights"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["backbone.json", "backbone.pt"]

    with StagedFiles() as files:
        files.write(tmp_path / "backbone.pt", lambda handle: handle.write(b"new weights"))
        files.write_text(tmp_path / "backbone.json", "new description")
    assert (tmp_path / "backbone.pt").read_bytes() == b"new weights"
    assert (tmp_path / "backbone.json").read_text() == "new description"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["backbone.json", "backbone.pt"]


def test_only_partial_files_of_writers_that_are_gone_are_removed(tmp_path):
    target = tmp_path / "last.ckpt"
    host = partial_path(target).name.split(".")[-3]  # .last.ckpt.<host>.<pid>.partial
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        live_partial = tmp_path / f".last.ckpt.{host}.{alive.pid}.partial"
        dead_partial = tmp_path / f".last.ckpt.{host}.{ended.stdout.strip()}.partial"
        other_host = tmp_path / f".last.ckpt.elsewhere.{ended.stdout.strip()}.partial"
        other_target = tmp_path / f".last.ckpt.tmp.{host}.{ended.stdout.strip()}.partial"
        for path in (live_partial, dead_partial, other_host, other_target):
            path.write_bytes(b"part of a checkpoint")
        write_text_atomically(target, "checkpoint")
        assert not dead_partial.exists()  # its writer is gone
        assert live_partial.exists() and other_host.exists() and other_target.exists()
        alive.kill()
        alive.wait()
        write_text_atomically(target, "checkpoint")
        assert not live_partial.exists()
    finally:
        alive.kill()
        alive.wait()
