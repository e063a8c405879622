"""Where callbacks put figures: PNG under the run directory, and into every logger that takes images."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from matplotlib.figure import Figure

from hfmca_lightning.visualization import save_figure

__all__ = ["figure_directory", "publish_figure"]


def figure_directory(trainer: Trainer, output_dir: str | None = None) -> Path:
    """``output_dir`` if given, else ``<run directory>/figures`` (the logger's folder, or default_root_dir)."""
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
