"""Contrastive baselines on lightly's losses and heads: SimCLR and MoCo v2."""

from __future__ import annotations

import copy

from lightly.loss import NTXentLoss
from lightly.models.modules import MoCoProjectionHead, SimCLRProjectionHead
from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.utils.scheduler import cosine_schedule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from hfmca_lightning.methods.baselines.base import ProjectedPairBaseline, SSLBaseline

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


class MoCo(SSLBaseline):
    """MoCo v2 (He et al. 2020; Chen et al. 2020): momentum key encoder and a memory bank of negatives."""

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
        self.key_backbone = copy.deepcopy(self.backbone)
        self.key_projection_head = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.key_backbone)
        deactivate_requires_grad(self.key_projection_head)
        self.momentum = momentum
        self.criterion = NTXentLoss(temperature=temperature, memory_bank_size=(memory_bank_size, output_dim), gather_distributed=True)

    def views_loss(self, views: list[Tensor]) -> Tensor:
        momentum = cosine_schedule(self.global_step, max(1, int(self.trainer.estimated_stepping_batches)), self.momentum, 1.0)
        update_momentum(self.backbone, self.key_backbone, m=momentum)
        update_momentum(self.projection_head, self.key_projection_head, m=momentum)
        query = self.projection_head(self.backbone(views[0]))
        key = self.key_projection_head(self.key_backbone(views[1])).detach()
        return self.criterion(query, key)
