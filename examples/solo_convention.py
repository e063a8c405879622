"""A module written the way solo-learn's methods are, trained from MultiViewDataModule (docs/baselines.md).

solo-learn's methods unpack ``indexes, X, targets = batch`` with ``X`` the list of crops, large crops first, and check
``len(X) == num_crops`` (``num_large_crops + num_small_crops``); its SimCLR finds the positives of each crop by the
samples' indexes. ``batch_format: solo`` gives exactly that, here with 2 large and 2 small crops (the ``MultiCrop``
spec).

    python examples/solo_convention.py --epochs 1 --steps 3
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn

from hfmca_lightning.callbacks import KNNEvaluation
from hfmca_lightning.data import MultiCrop, MultiViewDataModule, SyntheticShapes
from hfmca_lightning.models import SmallConvNet


def simclr_loss(z: Tensor, indexes: Tensor, temperature: float = 0.2) -> Tensor:
    """solo-learn's multi-positive SimCLR loss: ``z (N, D)`` of all crops, ``indexes (N,)`` their samples; every
    other crop of the same sample is a positive."""
    z = F.normalize(z, dim=-1)
    similarity = torch.exp(z @ z.T / temperature)
    positives = indexes[:, None] == indexes[None, :]
    positives.fill_diagonal_(False)
    negatives = indexes[:, None] != indexes[None, :]
    pos = (similarity * positives).sum(1)
    neg = (similarity * negatives).sum(1)
    return -torch.mean(torch.log(pos / (pos + neg)))


class SoloSimCLR(LightningModule):
    """The shape of a solo-learn method: crops counted at construction, checked on every batch."""

    def __init__(self, num_large_crops: int = 2, num_small_crops: int = 2) -> None:
        super().__init__()
        self.num_large_crops, self.num_small_crops = num_large_crops, num_small_crops
        self.num_crops = num_large_crops + num_small_crops
        self.backbone = SmallConvNet(width=8, num_stages=3)
        self.projector = nn.Sequential(nn.Linear(self.backbone.feature_dim, 64), nn.ReLU(), nn.Linear(64, 32))

    def loss(self, indexes: Tensor, crops: list[Tensor]) -> Tensor:
        z = torch.cat([self.projector(self.backbone(crop)) for crop in crops])
        return simclr_loss(z, indexes.repeat(self.num_crops))

    def training_step(self, batch, batch_idx: int) -> Tensor:
        indexes, X, targets = batch  # solo-learn's convention
        X = [X] if isinstance(X, Tensor) else X
        assert len(X) == self.num_crops  # solo-learn checks this too
        loss = self.loss(indexes, X)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        images, targets = batch  # evaluation loaders keep (images, targets) in every batch format
        return {"features": self.backbone(images), "targets": targets}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.001)


def solo_data(**options) -> MultiViewDataModule:
    """2 large crops of 32 px and 2 small ones of 16 px, in solo-learn's batch layout."""
    source = SyntheticShapes(train_per_class=8, test_per_class=4)
    views = MultiCrop(global_crops=2, local_crops=2)
    return MultiViewDataModule(source, views=views, batch_format="solo", batch_size=16, **options)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="training batches per epoch (default: all)")
    args = parser.parse_args(argv)
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
    trainer.fit(SoloSimCLR(), solo_data(num_workers=0))
    loss = float(trainer.callback_metrics["train/loss"])
    print(f"solo-style SimCLR: loss {loss:.3f}, kNN top-1 {float(trainer.callback_metrics['knn/top1']):.3f}")
    return loss


if __name__ == "__main__":
    main()
