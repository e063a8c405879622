"""Data-loader worker processes that end when their command does, in order, never racing torch's own handling.

A command that reads a loader only partly (``hfmca analyze`` stops once it has enough groups), or whose loaders keep
persistent workers, would otherwise leave the workers to the interpreter's exit: torch's SIGCHLD handler then raises
inside ``atexit`` when a worker is killed, the remaining workers (which ignore SIGTERM, for SLURM) are never killed,
and ``multiprocessing`` waits for them forever. Loaders made by :class:`~hfmca_lightning.data.MultiViewDataModule`
are tracked (:func:`track`); :func:`shutdown_workers` stops their workers, and the ``hfmca`` command calls it before
it returns, whatever the outcome. :func:`stop_workers_at_exit` is the last resort for anything left.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import weakref
from typing import Any

from torch.utils.data import DataLoader

from hfmca_lightning.runtime.run_lock import release_inherited_locks

__all__ = [
    "available_cores",
    "cores_per_process",
    "leave_signals_to_the_main_process",
    "shutdown_workers",
    "stop_workers_at_exit",
    "track",
]

_loaders: weakref.WeakSet[DataLoader] = weakref.WeakSet()


def track(loader: DataLoader) -> DataLoader:
    """Register ``loader`` so that :func:`shutdown_workers` stops its persistent workers; returns it."""
    _loaders.add(loader)
    return loader


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity where the platform says, else all of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cores_per_process(processes: int) -> int:
    """This process's share of the cores when ``processes`` processes of one machine train together: its affinity
    divided among them where it spans the whole machine (processes started by Lightning's launcher inherit it),
    as it is where each process was bound to its own cores (SLURM's ``--cpus-per-task``)."""
    cores = available_cores()
    if processes > 1 and cores >= (os.cpu_count() or cores):
        cores //= processes
    return max(1, cores)


def shutdown_workers() -> None:
    """Stop the workers of every tracked loader's kept iterator (persistent workers) and forget the iterators: each
    loader shuts its own workers down and joins them (torch's orderly path)."""
    for loader in list(_loaders):
        iterator: Any = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        loader._iterator = None


def leave_signals_to_the_main_process(worker_id: int) -> None:
    """A data-loader worker's start (``worker_init_fn``): it ignores SIGTERM and SIGINT, which a cluster or a
    terminal sends to every process of the job, and stays quiet about the connections the main process drops.

    SLURM signals every process of a job with SIGTERM, and a worker that died of it would crash the main process
    (torch raises from its SIGCHLD handler, anywhere in a step) before it could write its preemption checkpoint; Ctrl-C
    reaches every process of the terminal's process group. The main process stops its workers itself: through the
    loader's shutdown, :func:`shutdown_workers` or :func:`stop_workers_at_exit`. A tensor the main process stops
    receiving when it is interrupted resets the worker's connection, which ``multiprocessing`` would report with a
    traceback from the worker; the main process's one line says what happened."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.excepthook = _quiet_about_dropped_connections
    release_inherited_locks()  # the run folder's lock is the main process's alone


def _quiet_about_dropped_connections(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
    if not issubclass(kind, (ConnectionError, EOFError)):
        sys.__excepthook__(kind, error, traceback)


def stop_workers_at_exit() -> None:
    """Kill the data-loader workers still alive when the main process exits (after an error, persistent workers are
    never shut down). torch's SIGCHLD handler is taken away first (it would raise from inside this handler when a
    worker dies, and leave the others alive); ``multiprocessing`` would SIGTERM and then wait for them, forever, as
    they ignore SIGTERM. Registered with ``atexit``, so it runs before ``multiprocessing``'s own exit handler."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except (ValueError, OSError, AttributeError):  # not the main thread, or no SIGCHLD (Windows)
        pass
    for child in multiprocessing.active_children():
        if not child.daemon:  # DataLoader workers are daemonic
            continue
        try:
            child.kill()
            child.join(timeout=5)
        except Exception:  # noqa: BLE001 - one worker's failure must not keep the others alive
            continue


atexit.register(stop_workers_at_exit)
