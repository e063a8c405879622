"""Trained runs as objects: the module and DataModule of a checkpoint, rebuilt from the config inside it.

Shared by ``hfmca analyze`` / ``compare`` / ``linear`` / ``knn`` / ``export``. Any LightningModule of the
package is accepted (:class:`~hfmca_lightning.methods.HFMCAModule` and every baseline): each has a
``backbone`` and a ``forward`` that returns backbone features ``(N, D)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningModule
from torch import nn

from hfmca_lightning.callbacks.stored_config import saved_config
from hfmca_lightning.cli.trainer_cli import HFMCACLI
from hfmca_lightning.data.datamodule import MultiViewDataModule
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.runtime.checkpoint_io import read_checkpoint

__all__ = ["load_run", "run_config", "backbone_of"]


def run_config(
    ckpt_path: str | Path, checkpoint: dict[str, Any], config_path: str | Path | None = None
) -> dict[str, Any]:
    """The run's config: the YAML ``hfmca fit`` stored in ``checkpoint``, or ``config_path`` for checkpoints written
    elsewhere."""
    text = Path(config_path).read_text() if config_path else saved_config(checkpoint)
    if text is None:
        raise ConfigurationError(
            f"{ckpt_path} holds no config (it was not written by `hfmca fit`); pass --config with the run's YAML"
        )
    return yaml.safe_load(text)


def load_run(
    ckpt_path: str | Path, config_path: str | Path | None = None, checkpoint: dict[str, Any] | None = None
) -> tuple[LightningModule, MultiViewDataModule]:
    """Rebuild the module (with the checkpoint's weights, in float32, in eval mode) and the DataModule of a run.

    The config is the one ``hfmca fit`` stored in the checkpoint, or ``config_path`` for checkpoints
    written elsewhere. The DataModule is set up (its splits are read). ``checkpoint``: the file's contents
    when the caller has already read it.
    """
    ckpt_path = Path(ckpt_path)
    if checkpoint is None:
        checkpoint = read_checkpoint(ckpt_path)
    config = {
        key: value
        for key, value in run_config(ckpt_path, checkpoint, config_path).items()
        if key in ("seed_everything", "trainer", "model", "data")
    }
    # Built in float32 whatever the run trained in ("64-true" builds float64 weights): the commands feed float32
    # images, and the checkpoint's weights are copied into the float32 ones.
    config.setdefault("trainer", {}).update(logger=False, callbacks=[], enable_progress_bar=False, precision="32-true")
    cli = HFMCACLI(args=config, run=False)
    module, datamodule = cli.model, cli.datamodule
    if not isinstance(datamodule, MultiViewDataModule):
        raise ConfigurationError(
            f"{ckpt_path}: the run's data is a {type(datamodule).__name__}; evaluation and analysis need a "
            "MultiViewDataModule"
        )
    backbone_of(module)
    module.on_load_checkpoint(checkpoint)
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0]
        raise ConfigurationError(
            f"{ckpt_path} does not fit the model of its config ({first}); pass --config with the run's YAML"
        ) from None
    module.eval()
    datamodule.setup("fit")
    return module, datamodule


def backbone_of(module: LightningModule) -> nn.Module:
    """The module's backbone (every method of the package has one under ``backbone``)."""
    backbone = getattr(module, "backbone", None)
    if not isinstance(backbone, nn.Module):
        raise ConfigurationError(
            f"{type(module).__name__} has no `backbone` module; evaluation, export and analysis need one"
        )
    return backbone
