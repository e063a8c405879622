"""Contrastive baselines on lightly's losses and heads: SimCLR and MoCo v2."""

from __future__ import annotations

from lightly.loss import NTXentLoss
from lightly.models.modules import MoCoProjectionHead, SimCLRProjectionHead
from torch import Tensor, nn

from hfmca_lightning.methods.baselines.base import MomentumBaseline, ProjectedPairBaseline
from hfmca_lightning.methods.optim import LRSchedulerCallable, OptimizerCallable

__all__ = ["SimCLR", "MoCo"]


class SimCLR(ProjectedPairBaseline):
    """SimCLR (Chen et al. 2020): NT-Xent between the projections of the first two views."""

    def __init__(
        self,
        backbone: nn.Module,
        hidden_dim: int = 512,
        output_dim: int = 128,
        temperature: float = 0.5,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, lr_scheduler)
        self.projection_head = SimCLRProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.criterion = NTXentLoss(temperature=temperature, gather_distributed=True)


class MoCo(MomentumBaseline):
    """MoCo v2 (He et al. 2020; Chen et al. 2020): momentum key encoder and a memory bank of negatives."""

    max_views = 2

    def __init__(
        self,
        backbone: nn.Module,
        hidden_dim: int = 512,
        output_dim: int = 128,
        temperature: float = 0.1,
        memory_bank_size: int = 4096,
        momentum: float = 0.99,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, lr_scheduler)
        self.projection_head = MoCoProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.key_backbone = self.momentum_copy(self.backbone)
        self.key_projection_head = self.momentum_copy(self.projection_head)
        self.momentum = momentum
        self.criterion = NTXentLoss(
            temperature=temperature, memory_bank_size=(memory_bank_size, output_dim), gather_distributed=True
        )

    def views_loss(self, views: list[Tensor]) -> Tensor:
        self.update_momentum_copies(
            [(self.backbone, self.key_backbone), (self.projection_head, self.key_projection_head)]
        )
        query = self.projection_head(self.backbone(views[0]))
        key = self.key_projection_head(self.key_backbone(views[1])).detach()
        return self.criterion(query, key)
