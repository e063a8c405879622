"""Where callbacks put figures: PNG under the run directory, and into every logger that takes images."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from matplotlib.figure import Figure

from hfmca_lightning.visualization import save_figure

__all__ = ["FigureCallback", "figure_directory", "publish_figure"]


def figure_directory(trainer: Trainer, output_dir: str | None = None) -> Path:
    """``output_dir`` if given, else ``<run directory>/figures`` (the logger's folder, or default_root_dir).

    ``Trainer.log_dir`` broadcasts rank 0's folder, so under DDP every rank must call this together.
    """
    if output_dir is not None:
        return Path(output_dir)
    return Path(trainer.log_dir or trainer.default_root_dir) / "figures"


def publish_figure(trainer: Trainer, figure: Figure, key: str, path: Path) -> Path:
    """Log ``figure`` under ``key`` to W&B / TensorBoard loggers and write it to ``path`` (PNG); closes it."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_figure(key, figure, global_step=trainer.global_step, close=False)
    saved = save_figure(figure, path)
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key=key, images=[str(saved)], step=trainer.global_step)
    return saved


class FigureCallback(Callback):
    """Base of the callbacks that draw figures on rank 0.

    The figure folder is resolved in :meth:`setup`, which every rank runs: resolving it later inside a
    rank-0-only branch would call a collective on one rank and hang a DDP run.

    Args:
        output_dir: where the PNG files go; default ``<run directory>/figures``.
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__()
        self.output_dir = output_dir
        self._directory: Path | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._directory = figure_directory(trainer, self.output_dir)

    def publish(self, trainer: Trainer, figure: Figure, key: str, filename: str) -> Path:
        """Write ``figure`` as ``<figure folder>/<filename>`` and send it to the loggers (rank 0 only)."""
        if self._directory is None:
            raise RuntimeError(f"{type(self).__name__}.setup has not run: the figure folder is unknown")
        return publish_figure(trainer, figure, key, self._directory / filename)
