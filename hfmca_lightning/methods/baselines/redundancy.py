"""Redundancy-reduction baselines on lightly's losses and heads: Barlow Twins and VICReg."""

from __future__ import annotations

from lightly.loss import BarlowTwinsLoss, VICRegLoss
from lightly.models.modules import BarlowTwinsProjectionHead
from torch import nn

from hfmca_lightning.methods.optim import LRSchedulerCallable, OptimizerCallable
from hfmca_lightning.methods.baselines.base import ProjectedPairBaseline

__all__ = ["BarlowTwins", "VICReg"]


class _RedundancyReduction(ProjectedPairBaseline):
    """Two views through the 3-layer BN projection MLP of Barlow Twins into ``criterion_class``."""

    criterion_class: type[nn.Module]

    def __init__(
        self,
        backbone: nn.Module,
        hidden_dim: int = 2048,
        output_dim: int = 2048,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, lr_scheduler)
        self.projection_head = BarlowTwinsProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.criterion = self.criterion_class(gather_distributed=True)


class BarlowTwins(_RedundancyReduction):
    """Barlow Twins (Zbontar et al. 2021): cross-correlation of two views' projections pushed to identity."""

    criterion_class = BarlowTwinsLoss


class VICReg(_RedundancyReduction):
    """VICReg (Bardes et al. 2022): invariance, variance and covariance terms on two views' projections.

    lightly ships no separate VICReg head; its VICReg example uses this same 3-layer BN MLP.
    """

    criterion_class = VICRegLoss
