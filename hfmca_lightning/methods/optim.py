"""Optimisers and schedules shared by every LightningModule of the project (paper Table 1 defaults)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

__all__ = ["cosine_schedule", "configure_optimizers"]


def cosine_schedule(module: LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Cosine annealing to 0 over ``max_epochs`` (per epoch), or over all steps when epochs are unbounded."""
    max_epochs = module.trainer.max_epochs
    if max_epochs is not None and max_epochs > 0:
        return {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_epochs), "interval": "epoch"}
    steps = max(1, int(module.trainer.estimated_stepping_batches))
    return {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps), "interval": "step"}


def configure_optimizers(
    module: LightningModule, optimizer: OptimizerCallable | None, lr_scheduler: LRSchedulerCallable | None
) -> dict[str, Any]:
    """``optimizer`` / ``lr_scheduler`` from the CLI, defaulting to the paper's Table 1 setting: SGD lr 0.06,
    momentum 0.9, weight decay 5e-4, cosine annealing over the run."""
    built = optimizer(module.parameters()) if optimizer is not None else torch.optim.SGD(module.parameters(), lr=0.06, momentum=0.9, weight_decay=5e-4)
    schedule = lr_scheduler(built) if lr_scheduler is not None else cosine_schedule(module, built)
    return {"optimizer": built, "lr_scheduler": schedule}
