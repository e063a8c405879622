"""HFMCA-SS(*): self-supervised training with the external cost (paper §3, Alg. 1; SPEC §2)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from hfmca_lightning.analysis.spectral import decompose
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.hfmca_cost import HFMCACost
from hfmca_lightning.models.heads import GridExternalHead

__all__ = ["HFMCAModule", "check_checkpoint_architecture", "paper_optimizers"]


def paper_optimizers(module: LightningModule, parameters: Any) -> dict[str, Any]:
    """The paper's Table 1 optimisation: SGD lr 0.06, momentum 0.9, weight decay 5e-4, cosine over the run."""
    optimizer = torch.optim.SGD(parameters, lr=0.06, momentum=0.9, weight_decay=5e-4)
    return {"optimizer": optimizer, "lr_scheduler": cosine_schedule(module, optimizer)}


def cosine_schedule(module: LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Cosine annealing to 0 over ``max_epochs`` (per epoch), or over all steps when epochs are unbounded."""
    max_epochs = module.trainer.max_epochs
    if max_epochs is not None and max_epochs > 0:
        return {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_epochs), "interval": "epoch"}
    steps = max(1, int(module.trainer.estimated_stepping_batches))
    return {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps), "interval": "step"}


def check_checkpoint_architecture(module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Raise one clear error if ``checkpoint`` was written by a model of another architecture."""
    saved = checkpoint.get("state_dict", {})
    current = module.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    mismatched = [
        f"{key}: checkpoint {tuple(saved[key].shape)} vs model {tuple(current[key].shape)}"
        for key in sorted(set(saved) & set(current))
        if saved[key].shape != current[key].shape and current[key].numel() > 0  # lazily sized buffers adapt
    ]
    if missing or unexpected or mismatched:
        details = []
        if missing:
            details.append(f"{len(missing)} parameters missing from the checkpoint (e.g. {missing[0]})")
        if unexpected:
            details.append(f"{len(unexpected)} parameters the model does not have (e.g. {unexpected[0]})")
        if mismatched:
            details.append(f"{len(mismatched)} shape mismatches (e.g. {mismatched[0]})")
        raise ConfigurationError(
            f"the checkpoint was trained with a different architecture than {type(module).__name__} as "
            f"configured: {'; '.join(details)}. Resume with the config the checkpoint was trained with "
            "(saved as config.yaml in the run folder)."
        )


class HFMCAModule(LightningModule):
    """Backbone -> per-view projector -> external head LF, trained with the HFMCA external cost.

    A batch ``(views (B, L, C, H, W), target)`` is encoded as one ``(B*L, C, H, W)`` batch; the ``L``
    view features ``(B, L, K)`` are the low level and the head output ``(B, K)`` the high level of the
    cost. kNN evaluation uses the backbone output (``validation_step`` returns it).

    Args:
        backbone: images ``(N, 3, H, W)`` -> ``(N, D)``.
        projector: ``(N, D)`` -> ``(N, K)`` view features (sigmoid output).
        external_head: ``(B, L, K)`` -> ``(B, K)``; its ``num_views`` must equal the data's.
        external_cost: the cost (``reg``, ``beta``, ``sync_dist``); default ``HFMCACost(reg=0.1, beta=0)``.
        optimizer / lr_scheduler: callables from the CLI; default SGD(0.06, 0.9, wd 5e-4) and cosine
            annealing over ``max_epochs``.
    """

    def __init__(
        self,
        backbone: nn.Module,
        projector: nn.Module,
        external_head: GridExternalHead,
        external_cost: HFMCACost | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone", "projector", "external_head", "external_cost"])
        self.backbone = backbone
        self.projector = projector
        self.external_head = external_head
        self.external_cost = external_cost if external_cost is not None else HFMCACost(reg=0.1, beta=0.0, name="external")
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        num_views = getattr(datamodule, "num_views", None)
        if num_views is not None and num_views != self.external_head.num_views:
            grid = self.external_head.grid
            raise ConfigurationError(
                f"data.num_views={num_views} does not fit the external head's {grid[0]}x{grid[1]} grid "
                f"({self.external_head.num_views} views): set data num_views to {self.external_head.num_views} "
                "or change the head's grid_height / grid_width so that their product is num_views"
            )

    def forward(self, images: Tensor) -> Tensor:
        """Backbone features ``(N, D)`` of un-augmented images (what kNN evaluates)."""
        return self.backbone(images)

    def encode_views(self, views: Tensor) -> tuple[Tensor, Tensor]:
        """``(B, L, C, H, W)`` -> view features ``(B, L, K)`` and group features ``(B, K)``."""
        if views.dim() != 5:
            raise ValueError(f"HFMCAModule expects views of shape (B, L, C, H, W); got {tuple(views.shape)}")
        batch, num_views = views.shape[:2]
        view_features = self.projector(self.backbone(views.flatten(0, 1))).reshape(batch, num_views, -1)
        return view_features, self.external_head(view_features)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        views, _ = batch
        view_features, group_features = self.encode_views(views)
        cost = self.external_cost(view_features, group_features)
        self.log("cost/external", cost, prog_bar=True)
        self.log("train/loss", cost)
        if self.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            self._log_spectrum_summary("external", self.external_cost)
        return cost

    def _log_spectrum_summary(self, name: str, cost: HFMCACost) -> None:
        if cost.last_statistics is None:
            return
        eigenvalues = decompose(cost.last_statistics, reg=cost.reg).eigenvalues
        self.log(f"spectrum/{name}/top1", eigenvalues[0].item())
        self.log(f"spectrum/{name}/top10_mean", eigenvalues[:10].mean().item())

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Backbone features of an evaluation batch, for :class:`~hfmca_lightning.callbacks.KNNEvaluation`."""
        images, targets = batch
        return {"features": self(images), "targets": targets}

    test_step = validation_step

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            return paper_optimizers(self, self.parameters())
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return {"optimizer": optimizer, "lr_scheduler": cosine_schedule(self, optimizer)}
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_checkpoint_architecture(self, checkpoint)
