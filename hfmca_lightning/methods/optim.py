"""Optimisers and schedules shared by every LightningModule of the project (paper Table 1 defaults, and the
large-batch settings of ImageNet-scale runs)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from hfmca_lightning.errors import ConfigurationError

__all__ = ["LRSchedulerCallable", "OptimizerCallable", "configure_optimizers", "cosine_schedule", "parameter_groups"]

# The types of Lightning's CLI (lightning.pytorch.cli), spelled out here so that the methods import without
# jsonargparse (installed with the CLI; GPU machines without it still train from Python).
OptimizerCallable = Callable[[Iterable], Optimizer]
LRSchedulerCallable = Callable[[Optimizer], LRScheduler | ReduceLROnPlateau]


def parameter_groups(module: nn.Module, weight_decay_on_bias_and_norm: bool = True) -> Any:
    """The module's trainable parameters, as one group, or with ``weight_decay_on_bias_and_norm=False`` as two:
    weights, and biases plus normalisation parameters (every parameter with at most one dimension) with
    ``weight_decay: 0``. lightly's LARS also leaves zero-decay groups out of its layer-wise scaling, as
    SimCLR and BYOL do."""
    if weight_decay_on_bias_and_norm:
        return module.parameters()
    parameters = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in parameters if p.ndim > 1]},
        {"params": [p for p in parameters if p.ndim <= 1], "weight_decay": 0.0},
    ]


def cosine_schedule(
    module: LightningModule, optimizer: torch.optim.Optimizer, warmup_epochs: float = 0.0
) -> dict[str, Any]:
    """Cosine annealing to 0 over the run, whichever of ``max_epochs`` and ``max_steps`` ends it.

    Without warm-up: per epoch over ``max_epochs`` when the run is whole epochs (no ``max_steps``, or one that does
    not end the run before them); otherwise per optimiser step over ``Trainer.estimated_stepping_batches`` (a
    ``max_steps`` shorter than ``max_epochs`` epochs, or epochs unbounded). With ``warmup_epochs > 0``: lightly's
    ``CosineWarmupScheduler`` per optimiser step, a linear warm-up over ``warmup_epochs`` epochs then a cosine to 0
    over the rest of ``Trainer.estimated_stepping_batches``.

    Raises:
        ConfigurationError: when the run has no known length (``max_epochs`` -1 and no ``max_steps``; a
            ``max_time`` alone does not give one), or the warm-up is longer than the run.
    """
    trainer = module.trainer
    max_epochs = trainer.max_epochs
    if warmup_epochs <= 0 and max_epochs is not None and max_epochs > 0 and _runs_whole_epochs(trainer, max_epochs):
        return {
            "scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_epochs),
            "interval": "epoch",
        }
    if math.isinf(trainer.estimated_stepping_batches):
        raise ConfigurationError(
            "the cosine schedule anneals over the whole run, and this run has no known length (trainer.max_epochs -1 "
            "and no trainer.max_steps; a max_time alone does not give one): set max_epochs or max_steps, or give the "
            "module an lr_scheduler",
            parameter="max_epochs",
        )
    total = max(1, int(trainer.estimated_stepping_batches))
    if warmup_epochs <= 0:
        return {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total), "interval": "step"}
    steps_per_epoch = max(1, math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches))
    warmup = round(warmup_epochs * steps_per_epoch)
    if trainer.fast_dev_run:  # type: ignore[attr-defined]  # set by Lightning's trainer setup, not declared on Trainer
        warmup = min(warmup, total)  # a debugging run of a few batches: warm up over them
    if warmup > total:
        raise ConfigurationError(
            f"warmup_epochs={warmup_epochs} is {warmup} steps, longer than the whole run ({total} steps)",
            parameter="warmup_epochs",
        )
    from lightly.utils.scheduler import CosineWarmupScheduler  # only runs with a warm-up need lightly

    scheduler = CosineWarmupScheduler(optimizer, warmup_epochs=warmup, max_epochs=total, end_value=0.0)
    return {"scheduler": scheduler, "interval": "step"}


def _runs_whole_epochs(trainer: Any, max_epochs: int) -> bool:
    """Whether the run ends with its ``max_epochs``-th epoch: no ``max_steps``, or one at least as long (a
    ``max_steps`` that ends the run within the epochs makes the per-epoch cosine stop before it anneals)."""
    if trainer.max_steps == -1:
        return True  # the plain max_epochs run: the data is not loaded here
    planned = trainer.estimated_stepping_batches  # loads the train data first when it has to
    batches = trainer.num_training_batches
    if math.isinf(batches):  # an iterable data set of unknown length: max_steps ends the run
        return False
    return bool(planned == max_epochs * math.ceil(batches / trainer.accumulate_grad_batches))


def configure_optimizers(
    module: LightningModule,
    optimizer: OptimizerCallable | None,
    lr_scheduler: LRSchedulerCallable | None,
    warmup_epochs: float = 0.0,
    weight_decay_on_bias_and_norm: bool = True,
) -> dict[str, Any]:
    """``optimizer`` / ``lr_scheduler`` from the CLI, defaulting to the paper's Table 1 setting: SGD lr 0.06,
    momentum 0.9, weight decay 5e-4 (torch's fused kernel, which also skips a failed step's update on the device),
    cosine annealing over the run (with ``warmup_epochs`` of linear warm-up).

    Any ``torch.optim`` optimiser or ``lightly.utils.lars.LARS`` can be configured by ``class_path``;
    ``weight_decay_on_bias_and_norm=False`` exempts biases and normalisation parameters from weight decay
    (and from LARS's scaling).
    """
    groups = parameter_groups(module, weight_decay_on_bias_and_norm)
    try:
        built = (
            optimizer(groups)
            if optimizer is not None
            else torch.optim.SGD(groups, lr=0.06, momentum=0.9, weight_decay=5e-4, fused=True)
        )
    except ValueError as error:  # torch's optimisers check their settings: lr < 0, momentum < 0, ...
        raise ConfigurationError(f"the optimizer cannot be built: {error} (model.init_args.optimizer)") from None
    if lr_scheduler is None:
        return {"optimizer": built, "lr_scheduler": cosine_schedule(module, built, warmup_epochs)}
    if warmup_epochs:
        raise ConfigurationError(
            f"warmup_epochs ({warmup_epochs}) warms up the default cosine schedule, but an lr_scheduler is given: "
            "leave lr_scheduler out for the cosine schedule with this warm-up, or set warmup_epochs to 0",
            parameter="warmup_epochs",
        )
    schedule = lr_scheduler(built)
    if isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigurationError(
            "lr_scheduler ReduceLROnPlateau steps on a monitored validation metric, which these training runs do not "
            "have; use a schedule over steps or epochs (the default cosine, StepLR, OneCycleLR, ...)",
            parameter="lr_scheduler",
        )
    return {"optimizer": built, "lr_scheduler": schedule}
