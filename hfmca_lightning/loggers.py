"""Loggers that continue a run: a W&B logger that never crashes or hangs a run for want of an account or a network,
a resumed run's CSV log continued in the folder of the run it resumes, and a CSV log whose ``metrics.csv`` is never
left part-written when a new column makes Lightning rewrite it."""

from __future__ import annotations

import csv
import io
import netrc
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from hfmca_lightning.errors import HFMCAWarning
from hfmca_lightning.runtime.checkpoint_io import is_local
from hfmca_lightning.runtime.files import write_text_atomically

__all__ = ["OfflineSafeWandbLogger", "continue_csv_log", "rewrite_csv_log_atomically", "wandb_credentials_available"]


def wandb_credentials_available() -> bool:
    """True when an API key is configured (``WANDB_API_KEY`` or a ``~/.netrc`` entry from ``wandb login``)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].rstrip("/")
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class OfflineSafeWandbLogger(WandbLogger):
    """``lightning``'s ``WandbLogger`` that falls back to offline mode instead of failing.

    * No API key (``WANDB_API_KEY``, ``wandb login``) -> offline from the start, with a note saying where
      the run is stored and how to upload it (``wandb sync <dir>``).
    * A key but no network -> the online start gives up after ``init_timeout`` seconds and the run goes
      on offline.
    * ``WANDB_MODE=offline`` / ``disabled`` are respected as usual.

    ``resume_run(run_id)`` (used when a checkpoint is resumed) continues the same W&B run.

    Args:
        *args: ``WandbLogger``'s positional arguments.
        offline: ``True``: log offline; ``False``: online (unless ``WANDB_MODE`` says otherwise); ``None``: offline
            when ``WANDB_MODE`` is ``offline`` / ``dryrun`` or no API key is found (unless ``WANDB_MODE=disabled``),
            else online.
        init_timeout: the seconds an online start may take (``wandb.Settings(init_timeout=...)``); unused when
            ``settings`` is given.
        **kwargs: ``WandbLogger``'s other arguments (``project``, ``save_dir``, ``settings``, ...).
    """

    def __init__(self, *args: Any, offline: bool | None = None, init_timeout: float = 30.0, **kwargs: Any) -> None:
        if offline is None:
            mode = os.environ.get("WANDB_MODE", "").lower()
            offline = mode in ("offline", "dryrun") or (mode != "disabled" and not wandb_credentials_available())
            if offline and mode not in ("offline", "dryrun"):
                rank_zero_info(
                    "W&B: no API key found (WANDB_API_KEY or `wandb login`); logging offline under "
                    f"{kwargs.get('save_dir', '.')}/wandb. Upload later with `wandb sync <run folder>`."
                )
        kwargs.setdefault("settings", _settings(init_timeout))
        kwargs["offline"] = offline  # in kwargs: mypy cannot tell *args stops before it
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:  # wandb warns of the setting in every run, even unset
            self._wandb_init.pop("anonymous", None)

    def resume_run(self, run_id: str) -> None:
        """Log into the existing run ``run_id`` (must be called before the run starts)."""
        if self._experiment is not None:
            rank_zero_warn(f"W&B run already started; cannot switch to run {run_id}", category=HFMCAWarning)
            return
        self._id = run_id
        self._wandb_init.update(id=run_id, resume="allow")

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        try:
            return WandbLogger.experiment.fget(self)  # type: ignore[attr-defined]  # the parent's property getter
        except Exception as error:  # wandb raises several types for auth / network failures
            if self._offline:
                raise
            rank_zero_warn(f"W&B: could not start an online run ({error}); continuing offline.", category=HFMCAWarning)
            self._offline = True
            self._experiment = None
            self._wandb_init["mode"] = "offline"
            return WandbLogger.experiment.fget(self)  # type: ignore[attr-defined]  # the parent's property getter


def _settings(init_timeout: float) -> Any:
    import wandb

    return wandb.Settings(init_timeout=init_timeout)


class _AtomicMetrics(ExperimentWriter):
    """Lightning's CSV writer, whose ``metrics.csv`` is replaced whole when a new metric adds a column: Lightning's
    own rewrites the file in place (truncated, then written), so a kill at that moment loses the logged history.
    Rows are appended as Lightning does (a kill mid-append loses at most the rows being appended)."""

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = Path(self.metrics_file_path)
        with path.open(newline="", encoding="utf-8") as file:
            rows = list(csv.DictReader(file))
        write_text_atomically(path, _csv_text(fieldnames, rows))


class _ContinuedMetrics(_AtomicMetrics):
    """Lightning's CSV writer on a ``metrics.csv`` that holds the rows of the run being resumed: it keeps the rows of
    the steps before ``from_step`` (rewritten atomically) and appends. The rows of later steps (the resumed run logs
    those steps again) go to ``metrics-after-step-<from_step>.csv`` beside it, so that a resume from an older
    checkpoint loses no history; a file that cannot be read as CSV is moved aside with a warning."""

    def __init__(self, log_dir: str, from_step: int) -> None:
        self._from_step = from_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        try:
            with path.open(newline="", encoding="utf-8") as file:
                reader = csv.DictReader(file)
                rows = list(reader)
                keys = sorted(reader.fieldnames or [])  # Lightning appends under its sorted keys
            kept: list[dict[str, str]] = []
            dropped: list[dict[str, str]] = []
            for row in rows:
                (kept if _step_of(row) < self._from_step else dropped).append(row)
            kept_text, dropped_text = _csv_text(keys, kept), _csv_text(keys, dropped) if dropped else None
        except (csv.Error, ValueError, UnicodeDecodeError) as error:
            aside = path.with_name(f"metrics-unreadable-{os.getpid()}.csv")
            os.replace(path, aside)
            rank_zero_warn(
                f"{path} cannot be read as CSV ({error}); moved to {aside.name}, the resumed run starts a new one",
                category=HFMCAWarning,
            )
            return
        if dropped_text is not None:  # a new name each time: a second resume from the same step keeps the first's rows
            side = path.with_name(f"metrics-after-step-{self._from_step}.csv")
            version = 0
            while side.exists():
                version += 1
                side = path.with_name(f"metrics-after-step-{self._from_step}-v{version}.csv")
            write_text_atomically(side, dropped_text)
        write_text_atomically(path, kept_text)
        self.metrics_keys = keys


def _csv_text(keys: list[str], rows: list[dict[str, str]]) -> str:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def _step_of(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or "inf")
    except ValueError:
        return float("inf")


def rewrite_csv_log_atomically(logger: CSVLogger) -> None:
    """Give ``logger`` the writer of a new run that replaces ``metrics.csv`` whole when a new column appears, in the
    version folder Lightning would use; before Lightning makes its own (called on the global rank 0 alone: the other
    processes' writers are no-ops). A remote ``save_dir`` keeps Lightning's writer, and a writer made already
    (a resumed run's, :func:`continue_csv_log`) stays."""
    if logger._experiment is not None or not is_local(logger.root_dir):
        return
    os.makedirs(logger.root_dir, exist_ok=True)
    logger._experiment = _AtomicMetrics(logger.log_dir)


def continue_csv_log(logger: CSVLogger, log_dirs: Sequence[str], from_step: int, writes: bool = True) -> str | None:
    """Point ``logger`` at the version folder of the resumed run (the one of ``log_dirs``, stored in its checkpoint,
    under the logger's own ``save_dir / name``) and continue its ``metrics.csv`` from ``from_step``, the checkpoint's
    global step: the rows of earlier steps are kept, the rest moved to ``metrics-after-step-<from_step>.csv`` (the
    resumed run logs those steps again).
    Lightning writes a training step's row under ``global_step - 1`` and an epoch's end under its last step's, so
    exactly the rows of the work in the checkpoint are kept. ``writes``: whether this process writes the file (the
    global rank 0). Returns the folder, or None when no stored folder is under the logger's local ``save_dir`` (a new
    version folder then, as without this)."""
    if not is_local(logger.root_dir):
        return None
    root = os.path.abspath(logger.root_dir)
    folder = next((path for path in log_dirs if os.path.dirname(os.path.abspath(path)) == root), None)
    if folder is None:
        return None
    name = os.path.basename(os.path.normpath(folder))
    number = re.fullmatch(r"version_(\d+)", name)
    logger._version = int(number.group(1)) if number else name  # CSVLogger(version=...) after construction
    if writes:  # the writer is rank 0's (rank_zero_experiment)
        os.makedirs(logger.log_dir, exist_ok=True)
        logger._experiment = _ContinuedMetrics(logger.log_dir, from_step)
    return logger.log_dir
