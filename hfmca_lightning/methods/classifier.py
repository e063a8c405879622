"""Supervised fine-tuning of a pre-trained backbone (``hfmca linear --finetune``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["FineTunedClassifier"]


class FineTunedClassifier(LightningModule):
    """``backbone`` + a linear layer, trained end to end with cross-entropy: the full fine-tuning protocol.

    SGD (Nesterov momentum 0.9, ``lr`` scaled by ``batch / 256``) with a cosine schedule over the run;
    validation logs ``finetune/top1`` and ``finetune/top5`` (torchmetrics, synchronised across processes).

    Args:
        backbone: ``(N, C, H, W) -> (N, feature_dim)``. feature_dim, num_classes: of the linear layer.
        lr: base learning rate at batch 256; batch_size: the training batch (scales ``lr``).
        weight_decay: of every parameter.
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
        self.backbone = backbone
        self.classifier = nn.Linear(feature_dim, num_classes)
        self.lr, self.batch_size, self.weight_decay = lr, batch_size, weight_decay
        self.top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.backbone(images))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, targets = batch
        loss = F.cross_entropy(self(images), targets)
        self.log("finetune/train_loss", loss, prog_bar=True)
        return loss

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
