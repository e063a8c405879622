"""One ``hfmca fit`` per checkpoint folder: a folder locked by a live process is refused with its pid; the lock of a
process killed with SIGKILL is free at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.runtime.run_lock import FolderInUse, RunFolderLock, lock_path

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from pathlib import Path
from hfmca_lightning.runtime.run_lock import RunFolderLock
RunFolderLock().acquire(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(120)
"""


def test_a_folder_locked_by_a_live_process_is_refused_until_it_is_killed(tmp_path):
    folder = tmp_path / "runs" / "demo" / "checkpoints"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert lock_path(folder) == tmp_path / "runs" / "demo" / ".checkpoints.lock"
        with pytest.raises(FolderInUse, match=f"checkpoint folder {folder} is in use by another `hfmca fit` "
                           rf"\(pid {holder.pid} on "):  # fmt: skip
            RunFolderLock().acquire(folder)
        assert not folder.exists()  # the lock is beside the folder
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        lock = RunFolderLock()
        deadline = time.monotonic() + 10
        while True:  # the kernel drops a killed process's locks as it reaps it
            try:
                assert lock.acquire(folder)
                break
            except FolderInUse:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert lock_path(folder).read_text().split()[0] == str(os.getpid())
        lock.release()
        assert RunFolderLock().acquire(folder)  # released: the next run takes it
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_file_that_cannot_be_created_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigurationError, match="cannot create the lock file .* of checkpoint folder"):
        RunFolderLock().acquire(tmp_path / "file" / "runs" / "checkpoints")
