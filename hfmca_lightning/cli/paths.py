"""The paths the commands are given, checked before any work: files to read, the ``--out`` folder to write; and an
operating-system error met mid-way (a full disk, a file size limit, a vanished file) as one line.

``--out`` must be a folder this process can create and write in; unless ``--overwrite`` is given it must hold none of
the files the command writes (``analyze`` / ``compare`` / ``export``: no file at all; ``linear`` / ``knn``, which share
``<run dir>/evaluation``: not their own). Problems found here are bad input: one line, exit status 2. The commands
then write every file atomically (:mod:`hfmca_lightning.runtime.files`), so a failure mid-way (exit status 1) leaves
what was there before.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.runtime.files import is_partial

__all__ = [
    "OVERWRITE_HELP",
    "check_config_files",
    "check_input_file",
    "check_out",
    "describe_os_error",
    "read_config_file",
]

OVERWRITE_HELP = "replace the files of an earlier run in --out (without it, a --out that holds files is refused)"

_FIXES = {
    errno.ENOSPC: "free space on that file system, or write somewhere else",
    errno.EDQUOT: "the disk quota is used up: free space, or write somewhere else",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f) or the file system allows: raise the "
    "limit, or write somewhere else",
    errno.EACCES: "make it writable for this user, or write somewhere else",
    errno.EPERM: "make it writable for this user, or write somewhere else",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.ENOENT: "check the path (was the file or its folder removed?)",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EISDIR: "the path is a folder: give a file",
    errno.EIO: "the storage failed: check the disk and its file system",
}


def describe_os_error(error: OSError) -> str:
    """One line for an operating-system error: the path, what went wrong and how to fix it."""
    code = error.errno
    if code is not None and code in errno.errorcode:
        reason = f"{error.strerror or os.strerror(code)} ({errno.errorcode[code]})"
    else:  # e.g. re-raised from a data-loader worker, with its traceback in the message
        text = str(error).strip()
        reason = text.splitlines()[-1] if text else type(error).__name__
    fix = _FIXES.get(code, "check the path and the storage") if code is not None else "check the storage"
    where = f"{os.fsdecode(error.filename)}: " if error.filename is not None else ""
    return f"{where}{reason}; {fix}"


def check_input_file(path: str | Path | None, option: str) -> None:
    """``path`` (given as ``option``) is a readable file, or a :class:`ConfigurationError` says what it is."""
    if path is None:
        return
    path = Path(path)
    if not path.exists():
        raise ConfigurationError(f"{option} {path}: no such file; check the path")
    if not path.is_file():
        raise ConfigurationError(f"{option} {path} is a folder; give a file")
    if not os.access(path, os.R_OK):
        raise ConfigurationError(f"{option} {path} is not readable by this user; change its permissions")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen and key != "<<":
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | Path, option: str = "--config") -> dict[str, Any]:
    """The settings of the YAML file ``path`` (given as ``option``), or one :class:`ConfigurationError` for a file that
    is not a YAML mapping: not text, a YAML error (with its line), a key given twice, empty, a list or a value."""
    check_input_file(path, option)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigurationError(f"{option} {path} is not a text file (UTF-8); give the run's YAML") from None
    try:
        config = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as error:
        try:  # JSON, which jsonargparse also reads, may hold tabs that YAML refuses
            config = json.loads(text)
        except json.JSONDecodeError:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).strip().splitlines()[0]
            raise ConfigurationError(f"{option} {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(config, dict):
        what = "empty" if config is None else f"a {type(config).__name__}"
        raise ConfigurationError(f"{option} {path} is {what}, not a mapping of settings (model:, data:, trainer:, ...)")
    return config


def check_config_files(argv: Sequence[str]) -> None:
    """Every ``--config`` file of a command line is a YAML mapping (:func:`read_config_file`); a value that is no file
    is left to the parser (which reads it as YAML text)."""
    for index, argument in enumerate(argv):
        if argument in ("--config", "-c") and index + 1 < len(argv):
            value = argv[index + 1]
        elif argument.startswith("--config="):
            value = argument.removeprefix("--config=")
        else:
            continue
        if os.path.isfile(value):  # False for YAML text, however long (no OSError for a name too long)
            read_config_file(value, argument.split("=")[0])


def check_out(out: str | Path, overwrite: bool, outputs: Iterable[str] | None = None, option: str = "--out") -> Path:
    """Create ``out`` and make sure the command can write its files there, before any work.

    Raises :class:`ConfigurationError` when ``out`` cannot be created or written in, or, without ``overwrite``, when
    it already holds files (``outputs``: only these names count; ``None``: any file, bar partial files a killed
    writer left). Returns ``out``."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigurationError(f"{option} {out} is a file; give a folder") from None
    except OSError as error:
        raise ConfigurationError(f"{option} {out}: cannot create the folder: {describe_os_error(error)}") from None
    try:
        descriptor, probe = tempfile.mkstemp(dir=out, prefix=".hfmca-write-test-")
    except OSError as error:
        raise ConfigurationError(f"{option} {out}: cannot write there: {describe_os_error(error)}") from None
    os.close(descriptor)
    os.unlink(probe)
    names = set(outputs) if outputs is not None else None
    present = sorted(
        entry.name for entry in out.iterdir() if not is_partial(entry) and (names is None or entry.name in names)
    )
    if present and not overwrite:
        shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise ConfigurationError(
            f"{option} {out} already holds {shown}; pass --overwrite to replace them, or choose another folder"
        )
    return out
