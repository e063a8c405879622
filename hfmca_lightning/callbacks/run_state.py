"""Exact resume: random-number-generator states and the W&B run id travel with the checkpoint."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger


__all__ = ["RunState", "saved_config", "saved_wandb_run_id"]


def saved_wandb_run_id(checkpoint: dict[str, Any]) -> str | None:
    """The W&B run id that :class:`RunState` stored in ``checkpoint``, if any."""
    return checkpoint.get("callbacks", {}).get(RunState.__name__, {}).get("wandb_run_id")


def saved_config(checkpoint: dict[str, Any]) -> str | None:
    """The resolved YAML config that the ``hfmca`` CLI stored in ``checkpoint``, if any."""
    return checkpoint.get("callbacks", {}).get(RunState.__name__, {}).get("config")


class RunState(Callback):
    """Saves torch (CPU and CUDA), numpy and Python RNG states and the W&B run id in every checkpoint.

    On resume (``--ckpt_path``) the states are restored, so noise channels and anything else drawn from
    the global generators continue exactly as in an uninterrupted run. The run id is read by the
    ``hfmca`` CLI before the trainer starts (Lightning creates the W&B run before any checkpoint is
    restored), so the resumed run logs into the same W&B run. The CLI adds this callback to every run.
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self.config: str | None = None  # the run's resolved YAML config, set by the hfmca CLI

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        # Tensors, strings and numbers only, so checkpoints load with torch.load(weights_only=True).
        kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
        version, python_state, gauss_next = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian],
            "python": [version, torch.tensor(python_state, dtype=torch.int64), gauss_next],
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        if self.config is not None:
            state["config"] = self.config
        if self._trainer is not None:
            for logger in self._trainer.loggers:
                if isinstance(logger, WandbLogger):
                    state["wandb_run_id"] = logger.version
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        kind, keys, position, has_gauss, cached_gaussian = state_dict["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
        version, python_state, gauss_next = state_dict["python"]
        random.setstate((version, tuple(python_state.tolist()), gauss_next))
        if "cuda" in state_dict and torch.cuda.is_available() and len(state_dict["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state_dict["cuda"])
