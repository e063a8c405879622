"""One ``hfmca fit`` per checkpoint folder: a folder locked by a live process is refused with its pid; the lock of a
process killed with SIGKILL is free at once, also while the data-loader workers it forked live on."""

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


def test_a_forked_worker_leaves_the_lock_to_its_parent(tmp_path):
    """A data-loader worker forked while the folder is locked holds no copy of the lock: the folder stays locked while
    the parent holds it, and is free as soon as the parent lets go (as when it is killed alone), while the worker
    still lives (torch's workers notice a dead parent only seconds later)."""
    from torch.utils.data import DataLoader

    from hfmca_lightning.runtime.workers import leave_signals_to_the_main_process

    folder = tmp_path / "checkpoints"
    lock = RunFolderLock()
    assert lock.acquire(folder)
    loader = DataLoader(
        range(4),
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="fork",
        worker_init_fn=leave_signals_to_the_main_process,  # what the data module's loaders start their workers with
    )
    batches = iter(loader)
    try:
        next(batches)  # the worker runs
        (worker,) = batches._workers  # type: ignore[attr-defined]
        with pytest.raises(FolderInUse):
            RunFolderLock().acquire(folder)
        lock.release()
        assert worker.is_alive()
        assert RunFolderLock().acquire(folder)
    finally:
        batches._shutdown_workers()  # type: ignore[attr-defined]
