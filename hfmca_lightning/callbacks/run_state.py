"""Exact resume: the randomness of every training batch is a function of ``(seed, batch index, rank)``; the run's
identity (seed, W&B run id, CSV log folders) travels with the checkpoint."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from hfmca_lightning.runtime.seeding import step_seed

__all__ = ["RunState", "saved_csv_log_dirs", "saved_wandb_run_id"]


def _saved_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What :class:`RunState` stored in ``checkpoint`` (empty where nothing)."""
    return checkpoint.get("callbacks", {}).get(RunState.__name__, {})


def saved_wandb_run_id(checkpoint: dict[str, Any]) -> str | None:
    """The W&B run id that :class:`RunState` stored in ``checkpoint``, if any."""
    return _saved_state(checkpoint).get("wandb_run_id")


def saved_csv_log_dirs(checkpoint: dict[str, Any]) -> list[str]:
    """The version folders of the run's CSV loggers that :class:`RunState` stored in ``checkpoint``."""
    return [str(folder) for folder in _saved_state(checkpoint).get("csv_log_dirs") or []]


class RunState(Callback):
    """Makes a run resumable to the bit, and remembers which run it is.

    Before every training batch the global generators (torch CPU and CUDA, numpy, Python ``random``) are
    seeded with :func:`step_seed` of ``(seed, batch index, global_rank)``, the batch index counting every
    training batch of the run (``Trainer.fit_loop.total_batch_idx``; unlike ``global_step`` it differs
    between the micro-batches of one accumulated step). Anything the model draws from
    them (noise channels, dropout) is then a function of the step alone, however the run got there: a run
    resumed from any checkpoint, with any number of data-loader workers, draws exactly what an
    uninterrupted run draws, whatever else consumed random numbers in between (data-loader start-up,
    validation, a different number of sanity-check batches). Ranks draw different numbers.

    The seed is stored in every checkpoint and restored on resume, together with the W&B run id and the CSV loggers'
    version folders (read by the ``hfmca`` CLI before Lightning starts the loggers, so that a resumed run continues
    the same W&B run and ``metrics.csv``). The CSV loggers write their rows to disk with every checkpoint. The CLI adds
    this callback to every run.

    Args:
        seed: the run's seed; default: ``seed_everything``'s (the ``PL_GLOBAL_SEED`` environment variable Lightning
            sets), else a random one.
    """

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = seed
        self._trainer: Trainer | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if self.seed is None:
            from_env = os.environ.get("PL_GLOBAL_SEED")
            self.seed = int(from_env) if from_env is not None else random.SystemRandom().randrange(2**31)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        seed = step_seed(int(self.seed or 0), trainer.fit_loop.total_batch_idx, trainer.global_rank)
        torch.manual_seed(seed)  # CPU and every CUDA device
        np.random.seed(seed % 2**32)
        random.seed(seed)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:  # rows logged straight to the loggers (spectra) on disk with the checkpoint
            if isinstance(logger, CSVLogger):
                logger.save()  # rank 0's rows; a no-op elsewhere

    def state_dict(self) -> dict[str, Any]:
        # Numbers and strings only, so checkpoints load with torch.load(weights_only=True).
        state: dict[str, Any] = {"seed": self.seed}
        if self._trainer is not None:
            for logger in self._trainer.loggers:
                if isinstance(logger, WandbLogger):
                    state["wandb_run_id"] = logger.version
            folders = [os.path.abspath(log.log_dir) for log in self._trainer.loggers if isinstance(log, CSVLogger)]
            if folders:
                state["csv_log_dirs"] = folders
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("seed") is not None:
            self.seed = int(state_dict["seed"])
