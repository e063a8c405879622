"""Density-ratio heatmaps during training (paper Alg. 4 + Alg. 5, Fig. "global-to-local response")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from hfmca_lightning.callbacks.figures import FigureCallback
from hfmca_lightning.data.datamodule import MultiViewDataModule
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning, check_at_least
from hfmca_lightning.evaluation_data import denormalise, figure_batches, figure_images
from hfmca_lightning.methods.hfmca import HFMCAModule
from hfmca_lightning.methods.inspection import (
    collect_statistics,
    default_figure_layers,
    density_ratio_heatmaps,
    heatmap_placements,
)
from hfmca_lightning.visualization import heatmap_overlay_figure

__all__ = ["DensityRatioHeatmapCallback"]


class _Counted:
    """Iterates over image batches and counts the images."""

    def __init__(self, batches: Iterator[Tensor]) -> None:
        self.batches, self.images = batches, 0

    def __iter__(self) -> Iterator[Tensor]:
        for batch in self.batches:
            self.images += batch.shape[0]
            yield batch


class DensityRatioHeatmapCallback(FigureCallback):
    """Every ``every_n_epochs``, the telescoping density-ratio response of a fixed set of test images.

    ``num_images`` images of the evaluation split, taken from each class in turn
    (:func:`~hfmca_lightning.evaluation_data.figure_images`), go through the backbone; each internal pair is decomposed
    (Alg. 4) from statistics **accumulated over the first ``statistics_images`` images** of that split (default 2,000;
    all of them when the split is smaller, with a warning), in float64 and eval mode, not from the few drawn images:
    with 9 images and 64 features the decomposition of independent features shows spurious eigenvalues above 0.5. The
    response is then propagated from the top hooked layer down (Alg. 5). ``image_class`` draws only images of that class
    (the appendix shows samples of one class) and ``first_image`` starts at that index of the split. The figure overlays
    the response at ``layers`` (log names such as ``L2``; default: the three lowest) on the images, saved as
    ``<run dir>/figures/density_ratio_epochNNN.png`` and sent to W&B / TensorBoard. Needs a module with internal
    costs and a :class:`~hfmca_lightning.data.MultiViewDataModule`. Rank 0 only.

    Args:
        num_images: images in the figure.
        layers: internal cost layers shown, by log name (``L2``); default: the three lowest.
        every_n_epochs: draw after every this many training epochs.
        output_dir: where figures go (default ``<run dir>/figures``).
        statistics_images: images of the evaluation split the decompositions are taken from.
        image_class: only images of this class; None: any.
        first_image: the index of the evaluation split the images start at.

    Raises:
        ConfigurationError: when ``num_images``, ``every_n_epochs`` or ``statistics_images`` is below 1 or an index
            below 0; at the start of fitting, when the module has no internal costs, ``layers`` names others, the run
            has no ``MultiViewDataModule``, or the evaluation split has no image of ``image_class`` from
            ``first_image`` on.
    """

    def __init__(
        self,
        num_images: int = 8,
        layers: list[str] | None = None,
        every_n_epochs: int = 1,
        output_dir: str | None = None,
        statistics_images: int = 2000,
        image_class: int | None = None,
        first_image: int = 0,
    ) -> None:
        super().__init__(output_dir)
        owner = "DensityRatioHeatmapCallback"
        for name, value in (
            ("num_images", num_images),
            ("every_n_epochs", every_n_epochs),
            ("statistics_images", statistics_images),
        ):
            check_at_least(value, 1, name, owner)
        for name, index in (("first_image", first_image), ("image_class", image_class)):
            if index is not None:
                check_at_least(index, 0, name, owner)
        if layers is not None and not layers:
            raise ConfigurationError(
                f"{owner}: layers is empty; name the internal cost layers to draw, or null for the default",
                parameter="layers",
            )
        self.num_images = num_images
        self.layers = layers
        self.every_n_epochs = every_n_epochs
        self.statistics_images = statistics_images
        self.image_class, self.first_image = image_class, first_image
        self.last_statistics_images = 0  # how many images the last figure's decomposition came from
        self._warned = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        internal = getattr(pl_module, "internal_costs", None)
        if internal is None:
            raise ConfigurationError(
                "DensityRatioHeatmapCallback draws the density ratios of internal cost pairs (paper Alg. 5), and this "
                "module has none: give it internal_costs, or draw the heatmaps of any checkpoint with `hfmca analyze`"
            )
        names = [pair.log_name for pair in internal.pairs]
        unknown = set(self.layers or []) - set(names)
        if unknown:
            raise ConfigurationError(
                f"DensityRatioHeatmapCallback layers: {', '.join(sorted(unknown))} "
                f"{'is' if len(unknown) == 1 else 'are'} not among the module's internal cost layers; choose from "
                f"{' '.join(names)}",
                parameter="layers",
            )
        datamodule = getattr(trainer, "datamodule", None)  # set by Lightning at run time (not in Trainer's type)
        if not isinstance(datamodule, MultiViewDataModule):
            raise ConfigurationError(
                "DensityRatioHeatmapCallback draws its figures from the images of a MultiViewDataModule, and this run "
                f"has {'no data module' if datamodule is None else type(datamodule).__name__}: fit with one, or draw "
                "the heatmaps of a checkpoint with `hfmca analyze`"
            )
        figure_images(datamodule, 1, target=self.image_class, start=self.first_image)  # they exist: now, not later

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or (trainer.current_epoch + 1) % self.every_n_epochs != 0:
            return
        datamodule = cast(MultiViewDataModule, getattr(trainer, "datamodule", None))  # checked by on_fit_start
        module = cast(HFMCAModule, pl_module)  # the module with internal costs (on_fit_start)
        images, _ = figure_images(datamodule, self.num_images, target=self.image_class, start=self.first_image)
        counted = _Counted(figure_batches(datamodule, self.statistics_images))
        statistics = collect_statistics(module, counted)
        if counted.images < self.statistics_images and not self._warned:
            rank_zero_warn(
                f"DensityRatioHeatmapCallback: the evaluation split has {counted.images} images, fewer than "
                f"statistics_images={self.statistics_images}",
                category=HFMCAWarning,
            )
            self._warned = True
        self.last_statistics_images = counted.images
        heatmaps = density_ratio_heatmaps(module, images, statistics)
        chosen = self.layers or default_figure_layers(list(heatmaps))
        figure = heatmap_overlay_figure(
            denormalise(datamodule, images),
            {name: heatmaps[name] for name in chosen},
            placements=heatmap_placements(module),
        )
        self.publish(trainer, figure, "density_ratio", f"density_ratio_epoch{trainer.current_epoch:03d}.png")
