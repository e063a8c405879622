"""A W&B logger that never crashes or hangs a run for want of an account or a network."""

from __future__ import annotations

import netrc
import os
from typing import Any

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from hfmca_lightning.errors import HFMCAWarning

__all__ = ["OfflineSafeWandbLogger", "wandb_credentials_available"]


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
    All other arguments are ``WandbLogger``'s.
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
        super().__init__(*args, offline=offline, **kwargs)

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
