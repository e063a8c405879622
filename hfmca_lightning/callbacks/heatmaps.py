"""Density-ratio heatmaps during training (paper Alg. 4 + Alg. 5, Fig. "global-to-local response")."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer

from hfmca_lightning.callbacks.figures import FigureCallback
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods.inspection import default_figure_layers, density_ratio_heatmaps
from hfmca_lightning.visualization import heatmap_overlay_figure

__all__ = ["DensityRatioHeatmapCallback"]


class DensityRatioHeatmapCallback(FigureCallback):
    """Every ``every_n_epochs``, the telescoping density-ratio response of a fixed set of test images.

    The first ``num_images`` images of the evaluation split (``datamodule.evaluation_images``) go through
    the backbone; each internal pair is decomposed (Alg. 4) from the statistics of those images and the
    response is propagated from the top hooked layer down (Alg. 5). The figure overlays the response at
    ``layers`` (log names such as ``L2``; default: the three lowest) on the images, saved as
    ``<run dir>/figures/density_ratio_epochNNN.png`` and sent to W&B / TensorBoard. Needs a module with
    internal costs. Rank 0 only.
    """

    def __init__(self, num_images: int = 8, layers: list[str] | None = None, every_n_epochs: int = 1, output_dir: str | None = None) -> None:
        super().__init__(output_dir)
        for name, value in (("num_images", num_images), ("every_n_epochs", every_n_epochs)):
            if value < 1:
                raise ConfigurationError(f"DensityRatioHeatmapCallback needs {name} >= 1; got {value}", parameter=name)
        self.num_images = num_images
        self.layers = layers
        self.every_n_epochs = every_n_epochs

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        internal = getattr(pl_module, "internal_costs", None)
        if internal is None:
            raise ConfigurationError("DensityRatioHeatmapCallback needs a module with internal_costs (the heatmaps propagate through them)")
        names = [pair.log_name for pair in internal.pairs]
        unknown = set(self.layers or []) - set(names)
        if unknown:
            raise ConfigurationError(f"DensityRatioHeatmapCallback layers {sorted(unknown)} are not internal cost layers {names}", parameter="layers")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or (trainer.current_epoch + 1) % self.every_n_epochs != 0:
            return
        images, _ = trainer.datamodule.evaluation_images(self.num_images)
        heatmaps = density_ratio_heatmaps(pl_module, images)
        chosen = self.layers or default_figure_layers(list(heatmaps))
        figure = heatmap_overlay_figure(trainer.datamodule.denormalise(images), {name: heatmaps[name] for name in chosen})
        self.publish(trainer, figure, "density_ratio", f"density_ratio_epoch{trainer.current_epoch:03d}.png")
