"""One ``hfmca fit`` per checkpoint folder at a time: an exclusive ``flock`` on a lock file beside the folder.

The lock of ``runs/demo/checkpoints`` is ``runs/demo/.checkpoints.lock``. The operating system releases it when
the process that holds it ends, however it ends (SIGKILL included), so a lock is never left stuck: the file stays,
and only a live holder counts. It holds the holder's pid and host, for the message that refuses a second run.
A data-loader worker forked by the holder closes its copy of the lock's descriptor as it starts, so the lock is
the holder's alone: a holder killed by itself (the OOM killer's SIGKILL of the main process, whose
workers notice only seconds later) frees the folder at once, and the holder's lock stays held while it lives.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import weakref
from pathlib import Path

from hfmca_lightning.errors import ConfigurationError

__all__ = ["FolderInUse", "RunFolderLock", "lock_path", "release_inherited_locks"]

# Errors of file systems that do not support flock (Lustre mounted without -o flock, some FUSE file systems).
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class FolderInUse(ConfigurationError):
    """Another live process holds the lock of a checkpoint folder."""


def lock_path(folder: Path) -> Path:
    """The lock file of ``folder``: ``.<name>.lock`` beside it."""
    folder = Path(os.path.abspath(folder))
    return folder.with_name(f".{folder.name}.lock") if folder.name else folder / ".hfmca.lock"


class RunFolderLock:
    """Exclusive locks on checkpoint folders, held until :meth:`release` (or the process's end).

    :meth:`acquire` raises :class:`FolderInUse` (a :class:`ConfigurationError`: one line, exit status 2) when a live
    process holds a folder's lock, and a :class:`ConfigurationError` when the lock file cannot be created. On a file
    system without ``flock`` it returns ``False`` and holds nothing."""

    def __init__(self) -> None:
        self._held: dict[Path, int] = {}
        _locks.add(self)

    def acquire(self, folder: Path) -> bool:
        """Lock ``folder`` (not created; its parent is); ``True`` once held, ``False`` where locks are unsupported."""
        path = lock_path(folder)
        if path in self._held:
            return True
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigurationError(
                f"cannot create the lock file {path} of checkpoint folder {folder}: {error.strerror}; make "
                f"{path.parent} writable or give the run another checkpoint folder (ModelCheckpoint dirpath)"
            ) from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _read_holder(descriptor)
            os.close(descriptor)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderInUse(
                    f"checkpoint folder {folder} is in use by another `hfmca fit`{holder}: one run writes into a "
                    "folder at a time. Wait for that run to end (or stop it), then resume it with `--ckpt_path "
                    "last`; or give this run another checkpoint folder (ModelCheckpoint dirpath)"
                ) from None
            if error.errno in _UNSUPPORTED:
                return False
            raise
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._held[path] = descriptor
        return True

    def held(self) -> list[Path]:
        """The lock files held now."""
        return list(self._held)

    def release(self) -> None:
        """Release every lock held (the files stay)."""
        held, self._held = self._held, {}
        for descriptor in held.values():
            os.close(descriptor)


_locks: weakref.WeakSet[RunFolderLock] = weakref.WeakSet()


def release_inherited_locks() -> None:
    """In a data-loader worker as it starts (its ``worker_init_fn``,
    :func:`~hfmca_lightning.runtime.workers.leave_signals_to_the_main_process`): close its copies of the lock
    descriptors, forked with the main process, and forget them. A ``flock`` belongs to the open file, which the main
    process's descriptor keeps open, so its lock stays held; the worker neither holds it after the main process dies
    nor releases it. (DDP ranks forked by a launcher keep theirs: they write the run.)"""
    for lock in list(_locks):
        held, lock._held = lock._held, {}
        for descriptor in held.values():
            try:
                os.close(descriptor)
            except OSError:
                pass


def _read_holder(descriptor: int) -> str:
    """`` (pid N on host H)`` from the lock file, or nothing when it says nothing readable."""
    try:
        fields = os.pread(descriptor, 256, 0).decode(errors="replace").split()
    except OSError:
        return ""
    if len(fields) >= 2 and fields[0].isdigit():
        return f" (pid {fields[0]} on {fields[1]})"
    return ""
