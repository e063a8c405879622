"""The config inside every checkpoint is the run's own, also after a resume with changed settings."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from hfmca_lightning.callbacks.stored_config import StoredConfig, saved_config
from tests.helpers import fit, interrupted_fit


def test_a_resumed_run_stores_its_own_config_not_the_checkpoints(tmp_path: Path) -> None:
    """Stopped after one epoch of two, resumed with ``max_epochs: 3``: the checkpoints the resumed run writes hold
    ``max_epochs: 3`` (Lightning restores the callback's state after the CLI has set the run's config)."""
    interrupted_fit(tmp_path, 1, "--trainer.max_epochs", "2")
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert yaml.safe_load(saved_config(torch.load(last, weights_only=True)) or "")["trainer"]["max_epochs"] == 2
    fit(tmp_path, "--trainer.max_epochs", "3", "--ckpt_path", "last")
    resumed = torch.load(last, weights_only=True)
    assert resumed["epoch"] == 2 and yaml.safe_load(saved_config(resumed) or "")["trainer"]["max_epochs"] == 3


def test_without_a_config_of_its_own_the_callback_keeps_the_checkpoints() -> None:
    stored = StoredConfig()
    stored.load_state_dict({"config": "trainer: {}\n"})
    assert stored.config == "trainer: {}\n"
    stored.load_state_dict({"config": "model: {}\n"})  # set now: its own stays
    assert stored.config == "trainer: {}\n"
