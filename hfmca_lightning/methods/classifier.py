"""Supervised fine-tuning of a pre-trained backbone (``hfmca linear --finetune``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from hfmca_lightning.errors import ConfigurationError, check_at_least
from hfmca_lightning.evaluation.linear import NonFiniteLossError

__all__ = ["FineTunedClassifier"]


class FineTunedClassifier(LightningModule):
    """``backbone`` + a linear layer, trained end to end with cross-entropy: the full fine-tuning protocol.

    SGD (Nesterov momentum 0.9, ``lr`` scaled by ``batch / 256``) with a cosine schedule over the run;
    validation logs ``finetune/top1`` and ``finetune/top5`` (torchmetrics, synchronised across processes). A training
    loss or weights that turn NaN or Inf stop the run with
    :class:`~hfmca_lightning.evaluation.linear.NonFiniteLossError` before each validation and at the end (one host read
    each), so no accuracy of diverged weights is reported.

    Args:
        backbone: ``(N, C, H, W) -> (N, feature_dim)``. feature_dim, num_classes: of the linear layer.
        lr: base learning rate at batch 256; batch_size: the training batch (scales ``lr``).
        weight_decay: of every parameter.

    Raises:
        ConfigurationError: for fewer than 2 classes, a ``feature_dim`` other than the backbone's, a batch below 1,
            or an ``lr`` / ``weight_decay`` that is not finite (``lr`` > 0, ``weight_decay`` >= 0).
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        num_classes: int,
        lr: float = 0.05,
        batch_size: int = 256,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        check_at_least(feature_dim, 1, "feature_dim", "FineTunedClassifier")
        check_at_least(num_classes, 2, "num_classes", "FineTunedClassifier")
        check_at_least(batch_size, 1, "batch_size", "FineTunedClassifier")
        given = getattr(backbone, "feature_dim", feature_dim)
        if given != feature_dim:
            raise ConfigurationError(
                f"FineTunedClassifier: feature_dim is {feature_dim}, but the backbone gives {given} features",
                parameter="feature_dim",
            )
        if not (0 < lr < math.inf and 0 <= weight_decay < math.inf):  # NaN too
            raise ConfigurationError(
                f"FineTunedClassifier needs a finite lr > 0 and weight_decay >= 0; got {lr} and {weight_decay}",
                parameter="lr" if not 0 < lr < math.inf else "weight_decay",
            )
        self.backbone = backbone
        self.classifier = nn.Linear(feature_dim, num_classes)
        self.lr, self.batch_size, self.weight_decay = lr, batch_size, weight_decay
        self.top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self._finite_losses: Tensor | None = None  # whether every training loss since the last check was finite

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.backbone(images))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, targets = batch
        loss = F.cross_entropy(self(images), targets)
        finite = torch.isfinite(loss.detach())
        self._finite_losses = finite if self._finite_losses is None else self._finite_losses & finite
        self.log("finetune/train_loss", loss, prog_bar=True)
        return loss

    def on_validation_start(self) -> None:
        self._check_losses()

    def on_train_end(self) -> None:
        self._check_losses()

    def _check_losses(self) -> None:
        """One host read: the losses since the last check and the weights now (the last update may be the bad one)."""
        finite, self._finite_losses = self._finite_losses, None
        weights = torch.stack([torch.isfinite(parameter).all() for parameter in self.parameters()]).all()
        if not bool(weights if finite is None else weights & finite):
            raise NonFiniteLossError(
                f"fine-tuning stopped after step {self.global_step}: the training loss or the weights became NaN or "
                f"Inf; lower the learning rate (lr {self.lr:g})"
            )

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, targets = batch
        logits = self(images)
        self.top1(logits, targets)
        self.top5(logits, targets)
        self.log("finetune/top1", self.top1, prog_bar=True)
        self.log("finetune/top5", self.top5)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=self.lr * self.batch_size / 256,
            momentum=0.9,
            nesterov=True,
            weight_decay=self.weight_decay,
        )
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=max(1, int(self.trainer.estimated_stepping_batches))
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
