"""Non-contrastive siamese baselines on lightly's losses and heads: BYOL, SimSiam, FastSiam."""

from __future__ import annotations

import torch
from lightly.loss import NegativeCosineSimilarity
from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead, SimSiamPredictionHead, SimSiamProjectionHead
from torch import Tensor, nn

from hfmca_lightning.methods.baselines.base import MomentumBaseline, SSLBaseline
from hfmca_lightning.methods.optim import LRSchedulerCallable, OptimizerCallable

__all__ = ["BYOL", "SimSiam", "FastSiam"]


class BYOL(MomentumBaseline):
    """BYOL (Grill et al. 2020): online network predicts the momentum network's projection, symmetrised.

    Args:
        backbone: as :class:`SSLBaseline`; its momentum copy is the target network's backbone.
        hidden_dim: hidden width of lightly's ``BYOLProjectionHead`` and ``BYOLPredictionHead``.
        output_dim: size of the projections and of the predictions (lightly's ``NegativeCosineSimilarity``
            between them).
        momentum: start of the target network's EMA momentum, raised to 1 on a cosine over the run's steps
            (lightly's ``cosine_schedule``); in [0, 1].
        optimizer: as :class:`SSLBaseline`; ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4.
        lr_scheduler: as :class:`SSLBaseline`; ``None``: cosine annealing to 0 over the run.

    Raises:
        ConfigurationError: when a setting is out of range (as :class:`SSLBaseline`) or the backbone has no
            ``feature_dim``.
    """

    max_views = 2
    backbone_names = ("backbone", "momentum_backbone")

    def __init__(
        self,
        backbone: nn.Module,
        hidden_dim: int = 1024,
        output_dim: int = 256,
        momentum: float = 0.99,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, lr_scheduler)
        self.projection_head = BYOLProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.prediction_head = BYOLPredictionHead(output_dim, hidden_dim, output_dim)
        self.momentum_backbone = self.momentum_copy(self.backbone)
        self.momentum_projection_head = self.momentum_copy(self.projection_head)
        self.momentum = momentum
        self.criterion = NegativeCosineSimilarity()

    def views_loss(self, views: list[Tensor]) -> Tensor:
        self.update_momentum_copies(
            [(self.backbone, self.momentum_backbone), (self.projection_head, self.momentum_projection_head)]
        )
        online = [self.prediction_head(self.projection_head(self.backbone(v))) for v in views[:2]]
        with torch.no_grad():
            target = [self.momentum_projection_head(self.momentum_backbone(v)) for v in views[:2]]
        return 0.5 * (self.criterion(online[0], target[1]) + self.criterion(online[1], target[0]))


class SimSiam(SSLBaseline):
    """SimSiam (Chen & He 2021): predictor against the stop-gradient projection of the other view.

    Args:
        backbone: as :class:`SSLBaseline`; its ``feature_dim`` is the projection head's input.
        hidden_dim: hidden width of lightly's ``SimSiamProjectionHead`` (3 layers, BatchNorm).
        output_dim: size of the projections and of the predictions (lightly's ``NegativeCosineSimilarity``
            between them).
        prediction_dim: hidden width of lightly's ``SimSiamPredictionHead`` (the bottleneck of the predictor).
        optimizer: as :class:`SSLBaseline`; ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4.
        lr_scheduler: as :class:`SSLBaseline`; ``None``: cosine annealing to 0 over the run.

    Raises:
        ConfigurationError: when a setting is out of range (as :class:`SSLBaseline`) or the backbone has no
            ``feature_dim``.
    """

    max_views: int | None = 2

    def __init__(
        self,
        backbone: nn.Module,
        hidden_dim: int = 512,
        output_dim: int = 128,
        prediction_dim: int = 64,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, lr_scheduler)
        self.projection_head = SimSiamProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.prediction_head = SimSiamPredictionHead(output_dim, prediction_dim, output_dim)
        self.criterion = NegativeCosineSimilarity()

    def project(self, views: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Projections ``z`` and predictions ``p`` of each view."""
        projections = [self.projection_head(self.backbone(v)) for v in views]
        return projections, [self.prediction_head(z) for z in projections]

    def views_loss(self, views: list[Tensor]) -> Tensor:
        (z0, z1), (p0, p1) = self.project(views[:2])
        return 0.5 * (self.criterion(p0, z1.detach()) + self.criterion(p1, z0.detach()))


class FastSiam(SimSiam):
    """FastSiam (Pototzky et al. 2022): SimSiam with L views; each view's prediction targets the mean of the
    other views' stop-gradient projections. Uses all ``L`` views of the batch (the paper: 4), at least 3.

    Args:
        backbone: as :class:`SSLBaseline`; its ``feature_dim`` is the projection head's input.
        hidden_dim: hidden width of lightly's ``SimSiamProjectionHead`` (3 layers, BatchNorm).
        output_dim: size of the projections and of the predictions (lightly's ``NegativeCosineSimilarity``
            between them).
        prediction_dim: hidden width of lightly's ``SimSiamPredictionHead`` (the bottleneck of the predictor).
        optimizer: as :class:`SSLBaseline`; ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4.
        lr_scheduler: as :class:`SSLBaseline`; ``None``: cosine annealing to 0 over the run.

    Raises:
        ConfigurationError: when a setting is out of range (as :class:`SSLBaseline`) or the backbone has no
            ``feature_dim``.
    """

    min_views = 3
    max_views = None

    def views_loss(self, views: list[Tensor]) -> Tensor:
        projections, predictions = self.project(views)
        stacked = torch.stack(projections).detach()  # (L, B, D)
        total = stacked.sum(dim=0)
        losses = [self.criterion(p, (total - stacked[i]) / (len(views) - 1)) for i, p in enumerate(predictions)]
        return torch.stack(losses).mean()
