"""Modules written the way lightly's examples are, trained from MultiViewDataModule (docs/baselines.md).

lightly's examples take ``batch[0]`` as a list of view batches ``(B, C, H, W)`` (with ``LightlyDataset``: the batch
is ``(views, targets, filenames)``). ``batch_format: lightly`` gives exactly that, for any view spec. Two of
lightly's example modules, with their training steps as lightly writes them (smaller networks):

* MMCR (8 views through lightly's ``MMCRLoss``), the views drawn by lightly's own ``MMCRTransform``, given as the
  data module's ``views`` (the number of views is the transform's);
* DINO (2 global + 4 local crops through ``DINOLoss``), the crops drawn by the ``MultiCrop`` spec.

    python examples/lightly_convention.py --epochs 1 --steps 3
"""

from __future__ import annotations

import argparse
import copy

import torch
from lightly.loss import DINOLoss, MMCRLoss
from lightly.models.modules import DINOProjectionHead, SimCLRProjectionHead
from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.transforms.mmcr_transform import MMCRTransform
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor

from hfmca_lightning.callbacks import KNNEvaluation
from hfmca_lightning.data import MultiCrop, MultiViewDataModule, SyntheticShapes
from hfmca_lightning.models import SmallConvNet


class MMCR(LightningModule):
    """lightly's MMCR example: online and momentum networks, ``MMCRLoss`` over the ``k`` views of each image."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = SmallConvNet(width=8, num_stages=3)
        self.projection_head = SimCLRProjectionHead(self.backbone.feature_dim, 64, 32)
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)
        self.criterion = MMCRLoss()

    def forward(self, x: Tensor) -> Tensor:
        return self.projection_head(self.backbone(x).flatten(start_dim=1))

    def forward_momentum(self, x: Tensor) -> Tensor:
        return self.projection_head_momentum(self.backbone_momentum(x).flatten(start_dim=1)).detach()

    def training_step(self, batch, batch_idx: int) -> Tensor:
        update_momentum(self.backbone, self.backbone_momentum, m=0.99)
        update_momentum(self.projection_head, self.projection_head_momentum, m=0.99)
        z_o = [self(x) for x in batch[0]]  # lightly's convention: batch[0] is the list of view batches
        z_m = [self.forward_momentum(x) for x in batch[0]]
        loss = self.criterion(torch.stack(z_o, dim=1), torch.stack(z_m, dim=1))
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        images, targets = batch  # evaluation loaders keep (images, targets) in every batch format
        return {"features": self.backbone(images), "targets": targets}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.06)


class DINO(LightningModule):
    """lightly's DINO example: a student on every crop, a teacher on the two global crops."""

    def __init__(self) -> None:
        super().__init__()
        self.student_backbone = SmallConvNet(width=8, num_stages=3)
        dim = self.student_backbone.feature_dim
        self.student_head = DINOProjectionHead(dim, 64, 16, 128, freeze_last_layer=1)
        self.teacher_backbone = copy.deepcopy(self.student_backbone)
        self.teacher_head = DINOProjectionHead(dim, 64, 16, 128)
        deactivate_requires_grad(self.teacher_backbone)
        deactivate_requires_grad(self.teacher_head)
        self.criterion = DINOLoss(output_dim=128, warmup_teacher_temp_epochs=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.student_head(self.student_backbone(x).flatten(start_dim=1))

    def forward_teacher(self, x: Tensor) -> Tensor:
        return self.teacher_head(self.teacher_backbone(x).flatten(start_dim=1))

    def training_step(self, batch, batch_idx: int) -> Tensor:
        update_momentum(self.student_backbone, self.teacher_backbone, m=0.99)
        update_momentum(self.student_head, self.teacher_head, m=0.99)
        views, _, _ = batch  # lightly's convention: (views, targets, filenames), global crops first
        global_views = views[:2]
        teacher_out = [self.forward_teacher(view) for view in global_views]
        student_out = [self.forward(view) for view in views]
        loss = self.criterion(teacher_out, student_out, epoch=self.current_epoch)
        self.log("train/loss", loss)
        return loss

    def on_after_backward(self) -> None:
        self.student_head.cancel_last_layer_gradients(current_epoch=self.current_epoch)

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        images, targets = batch
        return {"features": self.student_backbone(images), "targets": targets}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.001)


def mmcr_data(**options) -> MultiViewDataModule:
    """8 views per image by lightly's own MMCRTransform (its ``k``), in lightly's batch layout."""
    transform = MMCRTransform(k=8, input_size=32, gaussian_blur=0.0)
    source = SyntheticShapes(train_per_class=8, test_per_class=4)
    return MultiViewDataModule(source, views=transform, batch_format="lightly", batch_size=16, **options)


def dino_data(**options) -> MultiViewDataModule:
    """2 global crops of 32 px and 4 local crops of 16 px (the project's MultiCrop), in lightly's batch layout."""
    source = SyntheticShapes(train_per_class=8, test_per_class=4)
    views = MultiCrop(global_crops=2, local_crops=4)
    return MultiViewDataModule(source, views=views, batch_format="lightly", batch_size=16, **options)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="training batches per epoch (default: all)")
    args = parser.parse_args(argv)
    losses = {}
    for name, module, data in (("MMCR", MMCR(), mmcr_data(num_workers=0)), ("DINO", DINO(), dino_data(num_workers=0))):
        trainer = Trainer(
            max_epochs=args.epochs,
            limit_train_batches=args.steps,
            callbacks=[KNNEvaluation(k=20)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, data)
        losses[name] = float(trainer.callback_metrics["train/loss"])
        print(f"{name}: loss {losses[name]:.3f}, kNN top-1 {float(trainer.callback_metrics['knn/top1']):.3f}")
    return losses


if __name__ == "__main__":
    main()
