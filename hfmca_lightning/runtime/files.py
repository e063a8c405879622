"""Files written whole or not at all: a reader sees the previous file or the new one, never a part.

Every file is written to ``.<name>.<host>.<pid>.partial`` beside its target, flushed to disk and renamed over the
target (``os.replace``: atomic on POSIX file systems, NFS and Lustre included), then the folder is flushed. A
partial file stays behind only when its writer was killed; the next write of the same target removes it once that
writer is gone (same host, process no longer alive), never while it may still be writing.

:class:`StagedFiles` writes several files that belong together (``backbone.pt`` and the ``backbone.json`` that
describes it): all of them are written in full first, then renamed in the order they were written, so that a full
disk or a crash while writing leaves every previous file in place.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "PARTIAL_SUFFIX",
    "StagedFiles",
    "is_partial",
    "partial_path",
    "remove_abandoned_partials",
    "write_atomically",
    "write_text_atomically",
]

PARTIAL_SUFFIX = ".partial"
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
# .<target name>.<host>.<pid>.partial (files of older versions: .<target name>.<pid>.partial)
_WRITER = r"(?:\.(?P<host>[A-Za-z0-9_-]+))?\.(?P<pid>\d+)" + re.escape(PARTIAL_SUFFIX)


def partial_path(target: Path) -> Path:
    """Where this process writes ``target`` before renaming it into place."""
    return target.with_name(f".{target.name}.{_HOST}.{os.getpid()}{PARTIAL_SUFFIX}")


def is_partial(path: Path) -> bool:
    """Whether ``path`` is a partial file of this module (an unfinished write, not an output)."""
    return re.fullmatch(r"\..+" + _WRITER, path.name) is not None


def _writer_is_gone(host: str | None, pid: int) -> bool:
    if host is not None and host != _HOST:
        return False  # another machine's process: it may still be writing (shared file systems)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_abandoned_partials(target: Path) -> None:
    """Remove the partial files of ``target`` whose writer is gone (killed while writing); leave those of live
    writers and of other hosts."""
    pattern = re.compile(re.escape(f".{target.name}") + _WRITER)
    for candidate in target.parent.glob(f".{glob.escape(target.name)}.*{PARTIAL_SUFFIX}"):
        match = pattern.fullmatch(candidate.name)
        if match is None:
            continue
        if _writer_is_gone(match["host"], int(match["pid"])):
            candidate.unlink(missing_ok=True)


class _RecordingFile:
    """A binary file that remembers the first OS error of a write: ``torch.save`` reports a failed write (a full
    disk) as a ``RuntimeError`` without the error number."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _write_partial(target: Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``target``'s partial file with ``write(handle)`` and flush it to disk; its path. On failure the partial
    file is removed and the error is an ``OSError`` naming ``target`` when the cause was one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_partials(target)
    partial = partial_path(target)
    recording: _RecordingFile | None = None
    try:
        with open(partial, "wb") as handle:
            recording = _RecordingFile(handle)
            write(recording)  # type: ignore[arg-type]  # a file in all but name
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException as error:
        partial.unlink(missing_ok=True)
        cause = error if isinstance(error, OSError) else recording.error if recording else None
        if cause is not None and cause.errno is not None:
            raise OSError(cause.errno, os.strerror(cause.errno), str(target)) from None
        raise
    return partial


def write_atomically(target: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``target`` with ``write(handle)`` (a binary file open for writing) so that it is replaced whole or not
    at all; returns ``target``. A failed write raises ``OSError`` with ``target`` as its file name and leaves the
    previous file as it was."""
    target = Path(target)
    partial = _write_partial(target, write)
    _replace(partial, target)
    fsync_directory(target.parent)
    return target


def write_text_atomically(target: str | Path, text: str) -> Path:
    """:func:`write_atomically` for text (UTF-8)."""
    return write_atomically(target, lambda handle: handle.write(text.encode()))


def _replace(partial: Path, target: Path) -> None:
    try:
        os.replace(partial, target)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise OSError(error.errno or errno.EIO, error.strerror, str(target)) from None


def fsync_directory(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the platform can."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open folders
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


class StagedFiles:
    """Files that belong together, each written in full (:meth:`write`) before any is renamed into place
    (:meth:`commit`, in the order written: write the file that describes the others last). Used as a context
    manager, it commits on success and removes its partial files on failure, leaving the previous files as they
    were."""

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []

    def write(self, target: str | Path, write: Callable[[BinaryIO], object]) -> Path:
        """Write ``target``'s content now (to its partial file); it replaces ``target`` at :meth:`commit`. Returns the
        partial file, to read back what will be committed."""
        target = Path(target)
        partial = _write_partial(target, write)
        self._staged.append((partial, target))
        return partial

    def write_text(self, target: str | Path, text: str) -> Path:
        """:meth:`write` for text (UTF-8)."""
        return self.write(target, lambda handle: handle.write(text.encode()))

    def commit(self) -> None:
        """Rename every staged file over its target, in the order written."""
        staged, self._staged = self._staged, []
        try:
            for partial, target in staged:
                _replace(partial, target)
        finally:
            for partial, _ in staged:
                partial.unlink(missing_ok=True)
        for folder in dict.fromkeys(target.parent for _, target in staged):
            fsync_directory(folder)

    def discard(self) -> None:
        """Remove the partial files of what was staged and not committed."""
        staged, self._staged = self._staged, []
        for partial, _ in staged:
            partial.unlink(missing_ok=True)

    def __enter__(self) -> StagedFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()
