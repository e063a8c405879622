"""Redundancy-reduction baselines on lightly's losses and heads: Barlow Twins, VICReg and VICRegL."""

from __future__ import annotations

from typing import Any

from lightly.loss import BarlowTwinsLoss, VICRegLLoss, VICRegLoss
from lightly.models.modules import BarlowTwinsProjectionHead
from lightly.models.modules.heads import VicRegLLocalProjectionHead
from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods.baselines.base import ProjectedPairBaseline, SSLBaseline
from hfmca_lightning.methods.inspection import residual_blocks
from hfmca_lightning.methods.optim import LRSchedulerCallable, OptimizerCallable

__all__ = ["BarlowTwins", "VICReg", "VICRegL"]


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
    """Barlow Twins (Zbontar et al. 2021): cross-correlation of two views' projections pushed to identity.

    Args:
        backbone: as :class:`SSLBaseline`; its ``feature_dim`` is the projection head's input.
        hidden_dim: width of the two hidden layers of lightly's ``BarlowTwinsProjectionHead`` (3 layers, BatchNorm).
        output_dim: size of the projections lightly's ``BarlowTwinsLoss`` compares.
        optimizer: as :class:`SSLBaseline`; ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4.
        lr_scheduler: as :class:`SSLBaseline`; ``None``: cosine annealing to 0 over the run.

    Raises:
        ConfigurationError: when a setting is out of range (as :class:`SSLBaseline`) or the backbone has no
            ``feature_dim``.
    """

    criterion_class = BarlowTwinsLoss


class VICReg(_RedundancyReduction):
    """VICReg (Bardes et al. 2022): invariance, variance and covariance terms on two views' projections.

    lightly ships no separate VICReg head; its VICReg example uses this same 3-layer BN MLP.

    Args:
        backbone: as :class:`SSLBaseline`; its ``feature_dim`` is the projection head's input.
        hidden_dim: width of the two hidden layers of lightly's ``BarlowTwinsProjectionHead`` (3 layers, BatchNorm).
        output_dim: size of the projections lightly's ``VICRegLoss`` compares.
        optimizer: as :class:`SSLBaseline`; ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4.
        lr_scheduler: as :class:`SSLBaseline`; ``None``: cosine annealing to 0 over the run.

    Raises:
        ConfigurationError: when a setting is out of range (as :class:`SSLBaseline`) or the backbone has no
            ``feature_dim``.
    """

    criterion_class = VICRegLoss


class VICRegL(SSLBaseline):
    """VICRegL (Bardes et al. 2022): VICReg on the global features plus VICReg between local features matched
    by feature distance and by position in the source image (lightly's ``VICRegLLoss``, ``alpha`` global weight).

    Global features: the backbone output through the 3-layer BN projection MLP (as :class:`VICReg`). Local
    features: the output map ``(B, C, g, g)`` of ``local_layer`` (default: the last residual block), each
    position through lightly's ``VicRegLLocalProjectionHead``. Positions come from the data: the DataModule
    must draw views with grids (``views: SimCLRViews(count=2, grids=g)``: batches ``(views, target, grids)``). All
    ``L`` views are global views at the data's image size (lightly's example also feeds smaller local crops).

    Args:
        backbone: as :class:`SSLBaseline`; ``local_layer`` is one of its modules.
        local_layer: module name (in ``backbone``) of the local feature map; ``None``: the last residual block.
        hidden_dim: width of the two hidden layers of the global projection MLP (lightly's
            ``BarlowTwinsProjectionHead``, as :class:`VICReg`).
        output_dim: size of the global projections.
        local_hidden_dim: width of the hidden layers of the local head (lightly's ``VicRegLLocalProjectionHead``,
            applied at each position of the local map).
        local_output_dim: size of the local projections.
        alpha: weight of the global loss (``1 - alpha`` local), lightly's default 0.75; in [0, 1].
        num_matches: nearest neighbours kept in the two feature-distance matchings, lightly's (20, 4); at most
            the local map's positions.
        optimizer: as :class:`SSLBaseline`; ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4.
        lr_scheduler: as :class:`SSLBaseline`; ``None``: cosine annealing to 0 over the run.

    Raises:
        ConfigurationError: when a setting is out of range (as :class:`SSLBaseline`), the backbone has no
            ``feature_dim``, or ``local_layer`` is not a module of the backbone with a convolution (or is ``None``
            and the backbone has no residual blocks).
    """

    reads_crop_grids = True

    def __init__(
        self,
        backbone: nn.Module,
        local_layer: str | None = None,
        hidden_dim: int = 2048,
        output_dim: int = 2048,
        local_hidden_dim: int = 128,
        local_output_dim: int = 128,
        alpha: float = 0.75,
        num_matches: tuple[int, int] = (20, 4),
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, lr_scheduler)
        if local_layer is None:
            blocks = residual_blocks(backbone)
            if not blocks:
                raise ConfigurationError(
                    f"{type(backbone).__name__} has no residual blocks: name the module whose output map gives "
                    "VICRegL's local features with local_layer",
                    parameter="local_layer",
                )
            local_layer = blocks[-1]
        try:
            local_module = backbone.get_submodule(local_layer)
        except AttributeError:
            names = [name for name, _ in backbone.named_modules() if name][:12]
            raise ConfigurationError(
                f"local_layer {local_layer!r} is not a module of the backbone; e.g. {names}", parameter="local_layer"
            ) from None
        channels = [module.out_channels for module in local_module.modules() if isinstance(module, nn.Conv2d)]
        if not channels:
            raise ConfigurationError(
                f"local_layer {local_layer!r} has no convolution: its output is not a feature map",
                parameter="local_layer",
            )
        self.local_layer = local_layer
        self.projection_head = BarlowTwinsProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.local_projection_head = VicRegLLocalProjectionHead(channels[-1], local_hidden_dim, local_output_dim)
        self.criterion = VICRegLLoss(
            alpha=alpha, num_matches=(int(num_matches[0]), int(num_matches[1])), gather_distributed=True
        )
        self._local_map: Tensor | None = None
        local_module.register_forward_hook(self._keep_local_map)

    def _keep_local_map(self, module: nn.Module, inputs: Any, output: Tensor) -> None:
        if module.training:  # training steps only; evaluation passes need no local map
            self._local_map = output

    def setup(self, stage: str) -> None:
        super().setup(stage)
        views = getattr(getattr(self.trainer, "datamodule", None), "views", None)
        grids = getattr(views, "grids", 0) if views is not None else None
        if stage == "fit" and grids is not None and grids < 1:
            raise ConfigurationError(
                "VICRegL matches local features by their positions in the image: set data.init_args.views to "
                "{class_path: hfmca_lightning.data.SimCLRViews, init_args: {count: 2, grids: G}}, G the side of the "
                f"output map of {self.local_layer} (4 for a CIFAR ResNet-18 on 32 px images)",
                parameter="views",
            )
        if stage == "fit" and grids and max(self.criterion.num_matches) > grids**2:
            raise ConfigurationError(
                f"num_matches {tuple(self.criterion.num_matches)} keeps more matches than the {grids}x{grids} local "
                "map has "
                f"positions ({grids**2}); lower model.init_args.num_matches (lightly's (20, 4) is for 7x7 maps)",
                parameter="num_matches",
            )

    def embed_views(self, view: Tensor) -> tuple[Tensor, Tensor]:
        """``(B, C, H, W)`` views -> (global projection ``(B, D)``, local projections ``(B, g, g, D_local)``)."""
        features = self.backbone(view)
        local = self._local_map
        assert local is not None
        self._local_map = None
        return self.projection_head(features), self.local_projection_head(local.permute(0, 2, 3, 1))

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor | dict[str, Tensor]]:
        if len(batch) != 3:
            raise ConfigurationError(
                "VICRegL needs batches (views, target, grids): set data.init_args.views to SimCLRViews with grids",
                parameter="views",
            )
        views, _, grids = batch
        features = [self.embed_views(view) for view in views.unbind(dim=1)]
        if features[0][1].shape[1:3] != grids.shape[2:4]:
            raise ConfigurationError(
                f"the local feature map of {self.local_layer} is {tuple(features[0][1].shape[1:3])} but the data's "
                "grids are "
                f"{tuple(grids.shape[2:4])}: set the grids of data.init_args.views to {features[0][1].shape[1]}",
                parameter="views",
            )
        loss = self.criterion(global_view_features=features, global_view_grids=list(grids.unbind(dim=1)))
        self.log("train/loss", loss)
        return {"loss": loss, "progress_bar": {"train/loss": loss.detach()}}
