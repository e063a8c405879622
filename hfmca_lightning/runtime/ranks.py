"""When one process of a multi-process run fails, every process stops within seconds, and one line says which.

Lightning's launcher (``strategy: ddp`` with ``devices: N`` on one machine) starts processes 1..N-1 as children of
process 0, and a thread of process 0 polls them every few seconds: when one has failed it kills the others and process
0 with SIGKILL (a process waiting in a collective cannot be stopped otherwise), so nothing says what happened and the
command's exit status is that of a killed process. Here the failing process says it in one line (the ``hfmca``
command's handler), and the thread kills the other children, then ends process 0 with the command's exit status for a
failed run, silently. Where process 0 fails, it kills its children before it says why. Checkpoints are written
atomically: those written before the failure are intact, and ``--ckpt_path last`` continues from the newest.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

__all__ = ["a_child_failed", "processes", "stop_other_ranks", "watch_ranks"]

_watched: list[_SubprocessScriptLauncher] = []
_exit_status = 1
_processes = 1


def watch_ranks(trainer: Trainer, failed_exit_status: int) -> None:
    """Make a failed child process end the run as described above, with ``failed_exit_status``."""
    global _exit_status, _processes
    _processes = trainer.world_size
    launcher = getattr(trainer.strategy, "launcher", None)
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return
    _exit_status = failed_exit_status
    _watched[:] = [launcher]
    if hasattr(_ChildProcessObserver, "_terminate_all"):  # Lightning's private hook; without it, Lightning's own end
        _ChildProcessObserver._terminate_all = _end_after_a_failed_child  # type: ignore[method-assign]  # on purpose


def processes() -> int:
    """The number of processes of the run watched here (1 before :func:`watch_ranks`)."""
    return _processes


def a_child_failed(wait: float = 3.0) -> bool:
    """Whether a child process of the launcher watched here has failed, waiting up to ``wait`` seconds for one to end
    (process 0's collective fails as soon as a failed child's connection closes, before the child has exited)."""
    children = [process for launcher in _watched for process in getattr(launcher, "procs", [])]
    deadline = time.monotonic() + wait
    while children:
        if any(process.poll() not in (None, 0) for process in children):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return False


def stop_other_ranks() -> None:
    """Kill the child processes of the launcher watched here (process 0 that failed itself), if any."""
    for launcher in _watched:
        for process in getattr(launcher, "procs", []):
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)


def _end_after_a_failed_child(self: Any) -> None:
    """The observer's end of the run: the other children killed, process 0 ended with the failed run's status (the
    failed child has said why)."""
    for process in self._child_processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
