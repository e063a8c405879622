"""Exact resume: random-number-generator states and the W&B run id travel with the checkpoint."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from hfmca_lightning.loggers import OfflineSafeWandbLogger

__all__ = ["RunState"]


class RunState(Callback):
    """Saves torch (CPU and CUDA), numpy and Python RNG states and the W&B run id in every checkpoint.

    On resume (``--ckpt_path``) the states are restored, so noise channels and anything else drawn from
    the global generators continue exactly as in an uninterrupted run, and an
    :class:`~hfmca_lightning.loggers.OfflineSafeWandbLogger` keeps logging into the same W&B run.
    The ``hfmca`` CLI adds this callback to every run.
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        if self._trainer is not None:
            for logger in self._trainer.loggers:
                if isinstance(logger, OfflineSafeWandbLogger):
                    state["wandb_run_id"] = logger.version
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        np.random.set_state(state_dict["numpy"])
        random.setstate(state_dict["python"])
        if "cuda" in state_dict and torch.cuda.is_available() and len(state_dict["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state_dict["cuda"])
        run_id = state_dict.get("wandb_run_id")
        if run_id and self._trainer is not None:
            for logger in self._trainer.loggers:
                if isinstance(logger, OfflineSafeWandbLogger):
                    logger.resume_run(run_id)
