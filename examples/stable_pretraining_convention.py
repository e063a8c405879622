"""A module written the way stable-pretraining's methods are, trained from MultiViewDataModule with this project's
callbacks (docs/baselines.md).

stable-pretraining's ``Module.training_step`` refuses any batch that is not a plain ``dict`` and writes
``batch["batch_idx"]`` into it; its forward functions read the views from ``batch["views"]``: a list of
``{"image", "label", ...}`` (SimCLR and the other symmetric methods) or a dict keyed ``global_0``, ...,
``local_0``, ... (DINO, which refuses a list). Its ``validation_step(batch, batch_idx)`` takes no loader index, and
its forward functions return ``{"embedding", "label", "loss"}``. ``batch_format: dict`` / ``dict_named`` give those
batches, ``evaluation_loaders: queries`` the one evaluation loader, and the callbacks read ``embedding`` /
``label``. The two forward functions below read batches as stable-pretraining's ``simclr`` and ``dino`` do (the
same keys, order and checks).

    python examples/stable_pretraining_convention.py --method simclr --epochs 1 --steps 3
    python examples/stable_pretraining_convention.py --method dino --epochs 1 --steps 3

Every callback logs to ``runs/stable_pretraining_convention/<method>/version_*/metrics.csv`` (kNN and linear top-1,
RankMe and the spectra of the backbone's stages, the label-free health), figures go beside it.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
from lightly.loss import DINOLoss, NTXentLoss
from lightly.models.utils import update_momentum
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn

from hfmca_lightning.callbacks import EigenspectrumCallback, HealthMetrics, KNNEvaluation, LinearProbe
from hfmca_lightning.data import MultiCrop, MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.models import SmallConvNet


def views_list(batch: dict[str, Any]) -> list[dict[str, Tensor]] | None:
    """stable-pretraining's ``_get_views_list``: the views, or None for a single-view batch."""
    if "views" in batch:
        return batch["views"]
    if "image" not in batch:
        return list(batch.values())
    return None


def views_by_prefix(batch: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
    """stable-pretraining's ``_get_views_by_prefix``: ``(global views, local views)`` by key, or None for a single
    view; a list of views is refused."""
    if "image" in batch and "views" not in batch:
        return None
    named = batch["views"]
    if isinstance(named, list):
        raise ValueError(f"expected a dict of named views (global_0, ..., local_0, ...); got a list of {len(named)}")
    global_views = [view for key, view in named.items() if key.startswith("global")]
    local_views = [view for key, view in named.items() if key.startswith("local")]
    if not global_views:
        raise ValueError(f"no views with the 'global' prefix in {list(named)}")
    return global_views, local_views


def simclr(self: SPTModule, batch: dict[str, Any], stage: str) -> dict[str, Tensor]:
    """stable-pretraining's ``simclr`` forward function: two views of a list, embeddings concatenated view after
    view, the NT-Xent loss of their projections."""
    out: dict[str, Tensor] = {}
    views = views_list(batch)
    if views is None:  # a single view: evaluation
        out["embedding"] = self.backbone(batch["image"])
        if "label" in batch:
            out["label"] = batch["label"]
        return out
    if len(views) != 2:
        raise ValueError(f"SimCLR requires exactly 2 views, got {len(views)}")
    embeddings = [self.backbone(view["image"]) for view in views]
    out["embedding"] = torch.cat(embeddings, dim=0)
    if "label" in views[0]:
        out["label"] = torch.cat([view["label"] for view in views], dim=0)
    if self.training:
        projections = [self.projector(embedding) for embedding in embeddings]
        out["loss"] = self.simclr_loss(projections[0], projections[1])
        batch_size = len(embeddings[0])  # images per view (Lightning cannot tell it from a dict of views)
        self.log(f"{stage}/loss", out["loss"], on_step=True, on_epoch=True, sync_dist=True, batch_size=batch_size)
    return out


def dino(self: SPTModule, batch: dict[str, Any], stage: str) -> dict[str, Tensor]:
    """stable-pretraining's ``dino`` forward function: global views by name through the teacher, every view through
    the student, the DINO loss; the embedding is the teacher's of the global views."""
    out: dict[str, Tensor] = {}
    named = views_by_prefix(batch)
    if named is None:
        if "label" in batch:
            out["label"] = batch["label"]
        with torch.no_grad():
            out["embedding"] = self.teacher_backbone(batch["image"])
        return out
    global_views, local_views = named
    if "label" in global_views[0]:
        out["label"] = torch.cat([view["label"] for view in global_views], dim=0)
    global_images = torch.cat([view["image"] for view in global_views])
    with torch.no_grad():
        teacher_features = self.teacher_backbone(global_images)
        teacher = self.teacher_projector(teacher_features).chunk(len(global_views))
    student = list(self.projector(self.backbone(global_images)).chunk(len(global_views)))
    if local_views:
        local_images = torch.cat([view["image"] for view in local_views])
        student += self.projector(self.backbone(local_images)).chunk(len(local_views))
    out["loss"] = self.dino_loss(list(teacher), student, epoch=self.current_epoch)
    out["embedding"] = teacher_features.detach()
    batch_size = len(teacher[0])  # images per view (Lightning cannot tell it from a dict of views)
    self.log(f"{stage}/loss", out["loss"], on_step=True, on_epoch=True, sync_dist=True, batch_size=batch_size)
    return out


class SPTModule(LightningModule):
    """The shape of stable-pretraining's ``Module``: a forward function bound to the module, a ``training_step`` that
    takes plain dicts only and writes into them, a ``validation_step`` without a loader index."""

    def __init__(self, forward: Callable[..., dict[str, Tensor]], lr: float = 1e-3) -> None:
        super().__init__()
        self.forward_function, self.lr = forward, lr
        self.backbone = SmallConvNet(width=8, num_stages=3)
        self.projector = nn.Sequential(nn.Linear(self.backbone.feature_dim, 64), nn.ReLU(), nn.Linear(64, 32))
        self.simclr_loss = NTXentLoss(temperature=0.5)
        self.dino_loss = DINOLoss(output_dim=32, warmup_teacher_temp_epochs=0)
        self.teacher_backbone = copy.deepcopy(self.backbone).requires_grad_(False)
        self.teacher_projector = copy.deepcopy(self.projector).requires_grad_(False)

    def forward(self, batch: dict[str, Any], stage: str) -> dict[str, Tensor]:
        return self.forward_function(self, batch, stage)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        if type(batch) is not dict:  # stable-pretraining's check
            raise ValueError(f"! batch is expected to be a dict! Not as {type(batch)}")
        batch["batch_idx"] = batch_idx
        # the teacher follows the student before the step (as lightly's DINO example): a checkpoint written after a
        # step holds the teacher that step used and the student it made, so a resumed run goes on exactly
        update_momentum(self.backbone, self.teacher_backbone, m=0.99)
        update_momentum(self.projector, self.teacher_projector, m=0.99)
        return self(batch, stage="fit")

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        batch["batch_idx"] = batch_idx
        return self(batch, stage="validate")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


FORWARD = {"simclr": simclr, "dino": dino}


def spt_data(method: str = "simclr", **options: Any) -> MultiViewDataModule:
    """stable-pretraining's batches: two SimCLR views in a list, or 2 global and 2 local crops by name."""
    source = SyntheticShapes(train_per_class=8, test_per_class=4)
    if method == "simclr":
        views, batch_format = SimCLRViews(count=2), "dict"
    else:
        views, batch_format = MultiCrop(global_crops=2, local_crops=2), "dict_named"
    options = {"batch_size": 16, "evaluation_loaders": "queries", **options}
    return MultiViewDataModule(source, views=views, batch_format=batch_format, **options)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=["simclr", "dino"], default="simclr")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="training batches per epoch (default: all)")
    parser.add_argument("--out", default="runs/stable_pretraining_convention", help="metrics.csv and figures")
    args = parser.parse_args(argv)
    seed_everything(0, verbose=False)
    trainer = Trainer(
        max_epochs=args.epochs,
        limit_train_batches=args.steps,
        callbacks=[
            KNNEvaluation(k=20),
            LinearProbe(),
            EigenspectrumCallback(every_n_steps=1, min_groups=16, output_dir=f"{args.out}/figures"),
            HealthMetrics(every_n_steps=1, samples_per_dim=1),
        ],
        logger=CSVLogger(args.out, name=args.method),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(SPTModule(FORWARD[args.method]), spt_data(args.method, num_workers=0))
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    print(
        f"stable-pretraining-style {args.method}: loss {metrics['fit/loss_epoch']:.3f}, kNN top-1 "
        f"{metrics['knn/top1']:.3f}, linear top-1 {metrics['linear/top1']:.3f}, LiDAR {metrics['health/lidar']:.2f}"
    )
    return metrics


if __name__ == "__main__":
    main()
