"""Checkpoint files that survive kills: atomic writes, and reads that fail in one clear line.

:class:`AtomicCheckpointIO` is the checkpoint writer of every ``hfmca fit`` run. Lightning's own writer
stages the file in the system temporary folder and moves it into place; when that folder is on another
file system than the checkpoints (``/tmp`` on a local disk or tmpfs, checkpoints on NFS or Lustre: the
usual cluster layout) the move is a copy, and a kill during the copy leaves a truncated ``last.ckpt``.
This one writes beside the target, flushes to disk and renames, so a reader sees the old file or the new
one, never a part.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.runtime.files import write_atomically

__all__ = ["AtomicCheckpointIO", "check_checkpoint_path", "check_resumable", "is_local", "read_checkpoint"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic on local and network file systems.

    The checkpoint is written to ``.<name>.<host>.<pid>.partial`` in the target's folder, fsynced, renamed over
    the target (``os.replace``, atomic on POSIX file systems) and the folder is fsynced
    (:func:`~hfmca_lightning.runtime.files.write_atomically`). A partial file left by a process killed while saving
    is removed by a later save once that process is gone; another live writer's is left alone. Remote URLs
    (``s3://``) use Lightning's writer.
    """

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's own loads (``--ckpt_path``) as :func:`read_checkpoint` reads local files: tensors and plain data
        only, whatever ``weights_only`` Lightning asks for, on the CPU (Lightning copies them into the module); the
        weights' finiteness was checked when the command read its arguments."""
        if not is_local(path):
            return super().load_checkpoint(path, map_location)  # torch >= 2.6 loads weights only by default
        return read_checkpoint(path, check_weights=False)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        write_atomically(Path(path), lambda handle: torch.save(checkpoint, handle))


def is_local(path: _PATH) -> bool:
    """Whether ``path`` is on a local (or mounted) file system, not a remote URL such as ``s3://``."""
    return "file" in (get_filesystem(path).protocol or ("file",))


def check_checkpoint_path(path: str | Path, option: str = "--ckpt_path", missing_hint: str = "") -> Path:
    """``path`` when it names a file; else one :class:`ConfigurationError` naming ``option`` (and ending with
    ``missing_hint``) for a missing path, or the file to give for a folder: what commands check before any work."""
    path = Path(path)
    if not path.exists():
        raise ConfigurationError(f"checkpoint not found: {path}. Check {option}{missing_hint}.")
    if not path.is_file():
        raise ConfigurationError(
            f"checkpoint path {path} is a folder; give the .ckpt file inside it (e.g. {path / 'last.ckpt'})."
        )
    return path


def read_checkpoint(path: str | Path, check_weights: bool = True, missing_hint: str = "") -> dict[str, Any]:
    """Load a Lightning checkpoint on the CPU, or raise one :class:`ConfigurationError` naming the file
    (``check_weights=False``: without reading every weight for its finiteness, for a file checked before;
    ``missing_hint`` ends the message for a missing file).

    Tells apart a missing path, a file that is not a readable checkpoint (truncated, corrupt, another
    format), a readable file that is not a Lightning training checkpoint (e.g. a plain ``state_dict``) and one whose
    weights are not finite (a diverged run's: every evaluation of it would be NaN or chance).
    """
    path = check_checkpoint_path(path, missing_hint=missing_hint)
    try:
        checkpoint = _load(path)
    except (ConfigurationError, MemoryError):
        raise
    except Exception as error:  # any bytes may be in the file: whatever torch's reader raises means the same
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ConfigurationError(
            f"{path} is not a readable checkpoint (truncated or corrupt file?): {type(error).__name__}"
            f"{': ' if first_line else ''}{first_line}. "
            "Resume from another checkpoint of the run, e.g. an epoch=...-step=....ckpt beside it."
        ) from None
    if (
        not isinstance(checkpoint, dict)
        or not isinstance(checkpoint.get("state_dict"), dict)
        or "pytorch-lightning_version" not in checkpoint
    ):
        keys = ", ".join(list(checkpoint)[:5]) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ConfigurationError(
            f"{path} is not a Lightning training checkpoint (it holds {keys}); the commands take only checkpoints "
            "written by `hfmca fit` (runs/<name>/checkpoints/*.ckpt)."
        )
    nonfinite = [
        name
        for name, value in (checkpoint["state_dict"].items() if check_weights else ())
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all())
    ]
    if nonfinite:
        raise ConfigurationError(
            f"{path} holds weights that are not finite (NaN or Inf) in {len(nonfinite)} tensor(s), e.g. "
            f"{nonfinite[0]}: the run had diverged when it was written. Use an earlier checkpoint of the run (an "
            "epoch=...-step=....ckpt beside it), and a lower learning rate to train on from it."
        )
    return checkpoint


def check_resumable(checkpoint: dict[str, Any], path: str | Path) -> None:
    """One :class:`ConfigurationError` when ``checkpoint`` (read from ``path``) cannot continue a run: one written with
    ``save_weights_only`` holds the weights without the optimiser state and the loops' position (Lightning's own
    resume ends in a ``KeyError``). It can still be scored and analysed."""
    missing = [key for key in ("optimizer_states", "loops") if key not in checkpoint]
    if missing:
        raise ConfigurationError(
            f"{path} holds the weights only (no {' and no '.join(missing)}: a checkpoint callback with "
            "save_weights_only: true wrote it), so `fit --ckpt_path` cannot continue its run: resume from a checkpoint "
            "written without save_weights_only (leave it false in runs meant to be resumed), or start a new run "
            "without --ckpt_path; validate, test, analyze and linear take this checkpoint as it is"
        )


def _load(path: Path) -> Any:
    """The file's contents, unpickling nothing but tensors and plain containers (``weights_only``): a checkpoint from
    someone else cannot run code. mmap reads only what is used (checkpoints with optimiser state are large); files
    in torch's legacy format cannot be mapped."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        if found is None:  # no object named: bytes the safe reader cannot parse (corrupt, or no checkpoint)
            reason = re.search(r"WeightsUnpickler error:\s*(.+)", str(error))
            raise pickle.UnpicklingError(reason.group(1) if reason else "not a pickle of tensors") from None
        raise ConfigurationError(
            f"{path} is refused: it holds pickled Python objects ({found.group(1)}), "
            "and loading it could run any code. Checkpoints written by `hfmca fit` hold tensors and plain data only; "
            "if you trust the file's author, ask them for a checkpoint of plain data (numbers, strings, tensors)."
        ) from None
