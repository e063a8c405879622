"""Plug MultiViewDataModule into your own Lightning SSL module (docs/baselines.md).

A minimal SimCLR-style module written from scratch against the DataModule's batch format, with the
project's kNN evaluation. Runs anywhere:

    python examples/custom_ssl_module.py --epochs 1 --limit-train-batches 5
"""

from __future__ import annotations

import argparse

import torch
from lightly.loss import NTXentLoss
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn

from hfmca_lightning.callbacks import KNNEvaluation
from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.models import SmallConvNet


class TwoViewContrastive(LightningModule):
    def __init__(self, temperature: float = 0.5, lr: float = 1e-3) -> None:
        super().__init__()
        self.backbone = SmallConvNet(width=16, num_stages=3)
        self.head = nn.Sequential(nn.Linear(self.backbone.feature_dim, 128), nn.ReLU(), nn.Linear(128, 64))
        self.criterion = NTXentLoss(temperature=temperature, gather_distributed=True)
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        views, _ = batch  # (B, 2, C, H, W): the two SimCLR views of each image
        z0, z1 = (self.head(self.backbone(views[:, i])) for i in (0, 1))
        loss = self.criterion(z0, z1)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(
        self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        images, targets = batch  # dataloader 0: kNN bank (train split), 1: queries (test split)
        return {"features": self.backbone(images), "targets": targets}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--limit-train-batches", type=float, default=1.0)
    args = parser.parse_args(argv)
    source = SyntheticShapes(train_per_class=50, test_per_class=20)
    data = MultiViewDataModule(source, views=SimCLRViews(count=2), batch_size=64, num_workers=0)
    limit = int(args.limit_train_batches) if args.limit_train_batches > 1 else args.limit_train_batches
    trainer = Trainer(
        max_epochs=args.epochs,
        limit_train_batches=limit,
        callbacks=[KNNEvaluation(k=50)],
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(TwoViewContrastive(), data)
    accuracy = float(trainer.callback_metrics["knn/top1"])
    print(f"kNN top-1: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
