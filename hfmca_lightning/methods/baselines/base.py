"""Shared plumbing of the baseline methods: one backbone, kNN features, the project's optimiser defaults."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.utils.scheduler import cosine_schedule
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods.compatibility import (
    check_batch_format,
    check_batch_norm_batch_size,
    check_crop_grids,
    check_image_size,
    check_strategy,
    load_checked_state_dict,
)
from hfmca_lightning.methods.evaluation_steps import KNNFeatureSteps
from hfmca_lightning.methods.optim import LRSchedulerCallable, OptimizerCallable, configure_optimizers
from hfmca_lightning.methods.update_guard import NonFiniteUpdateGuard

__all__ = ["SSLBaseline", "ProjectedPairBaseline", "MomentumBaseline"]


class SSLBaseline(KNNFeatureSteps, LightningModule):
    """Base of the baselines: consumes ``MultiViewDataModule`` batches ``(views (B, L, C, H, W), target)``
    unchanged, logs ``train/loss``, returns backbone features for :class:`KNNEvaluation`.

    Subclasses implement :meth:`views_loss` on the list of ``L`` view batches and set ``min_views``. Every update is
    guarded (:mod:`~hfmca_lightning.methods.update_guard`): a step whose loss or gradients are not finite is skipped
    on the device and stops the run a step later with one line, before any checkpoint is written.

    Args:
        backbone: images ``(N, C, H, W)`` -> features ``(N, D)``, with a ``feature_dim`` attribute (``D``) that
            sizes the subclasses' heads; its output is also the kNN evaluation's feature.
        optimizer: builds the optimiser from the module's parameters (the CLI's ``class_path`` / ``init_args``,
            e.g. ``torch.optim.AdamW`` or ``lightly.utils.lars.LARS``, without the parameters); ``None``: SGD lr 0.06,
            momentum 0.9, weight decay 5e-4 (:func:`~hfmca_lightning.methods.optim.configure_optimizers`).
        lr_scheduler: builds the learning-rate schedule from that optimiser (the CLI's ``class_path`` /
            ``init_args`` without the optimiser); ``None``: cosine annealing to 0 over the run
            (:func:`~hfmca_lightning.methods.optim.cosine_schedule`). ``ReduceLROnPlateau`` is refused when
            the optimisers are configured (there is no monitored metric).

    Raises:
        ConfigurationError: when a subclass's setting is out of range, checked here for every baseline: a
            ``*_dim`` not a whole number >= 1, ``temperature`` not finite and > 0, ``momentum`` or ``alpha`` outside
            [0, 1], ``num_matches`` not two counts >= 1.
    """

    min_views = 2
    max_views: int | None = None  # the views the loss reads (pair losses: 2); None: any number
    reads_crop_grids = False  # whether training batches may carry crop grids (VICRegL's)
    backbone_names: tuple[str, ...] = ("backbone",)  # the backbone and its momentum copies; the rest are heads

    def __init__(
        self,
        backbone: nn.Module,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone", "optimizer", "lr_scheduler"])
        _check_settings(type(self).__name__, dict(self.hparams))
        self.backbone = backbone
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self._update_guard = NonFiniteUpdateGuard(type(self).__name__)

    @property
    def feature_dim(self) -> int:
        dim = getattr(self.backbone, "feature_dim", None)
        if dim is None:
            raise ConfigurationError(
                f"{type(self.backbone).__name__} has no feature_dim attribute; baselines need it to size their heads"
            )
        return int(dim)

    def setup(self, stage: str) -> None:
        check_strategy(self, self.trainer.strategy)
        datamodule = getattr(self.trainer, "datamodule", None)
        check_image_size(self.backbone, datamodule)
        check_batch_format(self, datamodule)
        num_views = getattr(datamodule, "num_views", None)
        if num_views is not None and num_views < self.min_views:
            raise ConfigurationError(
                f"{type(self).__name__} needs at least {self.min_views} views per image; the data gives {num_views}"
            )
        if num_views is not None and self.max_views is not None and num_views > self.max_views:
            raise ConfigurationError(
                f"{type(self).__name__} compares {self.max_views} views per image, but the data gives {num_views}: "
                f"the others would be drawn and never used. Draw {self.max_views} (SimCLRViews' count, MultiCrop's "
                "crops)"
            )
        if stage == "fit":
            if not self.reads_crop_grids:
                check_crop_grids(self, datamodule, instead=", or train VICRegL")
            check_batch_norm_batch_size(self, datamodule, self._sample_normalising_layers())

    def _sample_normalising_layers(self) -> list[str]:
        """The BatchNorm layers that normalise over the samples alone: any in the heads (one vector per sample) and
        any ``BatchNorm1d``. A backbone's ``BatchNorm2d`` (or its momentum copy's) also normalises over the map's
        positions and trains on one sample (MoCo does)."""
        return [
            name
            for name, child in self.named_modules()
            if isinstance(child, _BatchNorm)
            and (name.split(".")[0] not in self.backbone_names or isinstance(child, nn.BatchNorm1d))
        ]

    def forward(self, images: Tensor) -> Tensor:
        return self.backbone(images)

    def views_loss(self, views: list[Tensor]) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor | dict[str, Tensor]]:
        """Logs ``train/loss``; returns it as ``loss`` and for :class:`~hfmca_lightning.callbacks.CostProgressBar`
        (on the bar without a host read per step)."""
        views, _ = batch
        if isinstance(views, (list, tuple)):  # groups of different sizes (multi-crop), global crops first
            view_list = [view for group in views for view in group.unbind(dim=1)]
        elif views.dim() == 5:
            view_list = list(views.unbind(dim=1))
        else:
            raise ValueError(f"{type(self).__name__} expects views of shape (B, L, C, H, W); got {tuple(views.shape)}")
        loss = self.views_loss(view_list)
        self.log("train/loss", loss)
        return {"loss": loss, "progress_bar": {"train/loss": loss.detach()}}

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self, self.optimizer_factory, self.scheduler_factory)

    def on_before_backward(self, loss: Tensor) -> None:
        self._update_guard.add_loss(loss)

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        scaler = getattr(getattr(self._trainer, "precision_plugin", None), "scaler", None)
        self._update_guard.before_update(
            optimizer, self.global_step, self.current_epoch, gradient_scaler=scaler is not None
        )

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().optimizer_step(*args, **kwargs)
        finally:
            self._update_guard.after_update()

    def raise_if_a_step_failed(self) -> None:
        """Raise the error of the first update skipped since the last read (as ``HFMCAModule``'s; callbacks that
        decompose features call it first)."""
        self._update_guard.raise_if_a_step_failed()

    def on_validation_start(self) -> None:
        self.raise_if_a_step_failed()

    def on_train_end(self) -> None:
        self.raise_if_a_step_failed()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.raise_if_a_step_failed()  # never a checkpoint after a failed step

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``; the state of another architecture is one clear error when ``strict``
        (:func:`~hfmca_lightning.methods.compatibility.load_checked_state_dict`)."""
        return load_checked_state_dict(self, state_dict, strict, assign)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._update_guard = NonFiniteUpdateGuard(type(self).__name__)  # a failure of this object's is gone


def _check_settings(method: str, settings: dict[str, Any]) -> None:
    """A baseline's sizes (``*_dim``) >= 1, ``temperature`` > 0, ``momentum`` and ``alpha`` in [0, 1] and
    ``num_matches`` two counts >= 1, each refused in one line before anything is built (else an IndexError deep in a
    head, a NaN loss, or a loss that trains nothing or the wrong way)."""
    for name, value in settings.items():
        if name.endswith("_dim") and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            problem = "a whole number >= 1"
        elif name.endswith("_dim") and isinstance(value, int) and value < 1:
            problem = "a size >= 1"
        elif name == "temperature" and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            problem = "finite and > 0"
        elif name == "momentum" and not (isinstance(value, (int, float)) and 0 <= value <= 1):
            problem = "in [0, 1] (the momentum copy's EMA weight)"
        elif name == "alpha" and not (isinstance(value, (int, float)) and 0 <= value <= 1):
            problem = "in [0, 1] (the global loss's weight; the local loss's is 1 - alpha)"
        elif name == "num_matches" and not (
            isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v >= 1 for v in value)
        ):
            problem = "two counts >= 1 (nearest neighbours kept by the two matchings)"
        else:
            continue
        raise ConfigurationError(f"{method}: {name} must be {problem}; got {value}", parameter=name)


class ProjectedPairBaseline(SSLBaseline):
    """A baseline whose loss is ``criterion(head(backbone(view 0)), head(backbone(view 1)))``; subclasses
    set ``projection_head`` and ``criterion``."""

    max_views = 2

    projection_head: nn.Module
    criterion: nn.Module

    def views_loss(self, views: list[Tensor]) -> Tensor:
        return self.criterion(
            self.projection_head(self.backbone(views[0])), self.projection_head(self.backbone(views[1]))
        )


class MomentumBaseline(SSLBaseline):
    """A baseline with a momentum copy of some of its modules (MoCo's key encoder, BYOL's target network),
    kept with lightly's ``update_momentum`` and its cosine momentum schedule from ``momentum`` to 1."""

    momentum: float

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self.trainer.max_epochs == -1 and self.trainer.max_steps == -1:
            raise self._unknown_run_length()

    def _unknown_run_length(self) -> ConfigurationError:
        return ConfigurationError(
            f"{type(self).__name__}'s momentum rises from {self.momentum} to 1 on a cosine over the run's steps, but "
            "this run has no known length (trainer.max_epochs -1 and no trainer.max_steps; a max_time alone stops at "
            "an unknown step): set trainer.max_epochs or trainer.max_steps",
            parameter="max_epochs",
        )

    def momentum_copy(self, module: nn.Module) -> nn.Module:
        """A frozen copy of ``module`` that follows it by exponential moving average."""
        copied = copy.deepcopy(module)
        deactivate_requires_grad(copied)
        return copied

    def update_momentum_copies(self, pairs: list[tuple[nn.Module, nn.Module]]) -> None:
        """One EMA step of every ``(module, momentum copy)`` pair, at this step's scheduled momentum."""
        total_steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(total_steps):  # a loader without a length and no max_steps: setup cannot tell
            raise self._unknown_run_length()
        momentum = cosine_schedule(self.global_step, max(1, int(total_steps)), self.momentum, 1.0)
        for module, copied in pairs:
            update_momentum(module, copied, m=momentum)
