"""LinearProbe (its learning on SyntheticShapes: tests/methods/test_hfmca_learning.py): leaves the trained module exactly as a run without it, resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from hfmca_lightning.callbacks import LinearProbe, RunState
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes
from hfmca_lightning.methods.baselines import SimCLR
from hfmca_lightning.models import SmallConvNet

NUM_CLASSES = 4


def _data() -> MultiViewDataModule:
    source = SyntheticShapes(num_classes=NUM_CLASSES, train_per_class=24, test_per_class=10, image_size=16)
    return MultiViewDataModule(source, num_views=2, batch_size=16, eval_batch_size=32, num_workers=0, crop_strength=0.3, color_strength=0.2)


def _fit(callbacks: list, epochs: int, ckpt_path: Path | None = None) -> tuple[SimCLR, Trainer]:
    seed_everything(0)
    module = SimCLR(SmallConvNet(width=8, num_stages=2), hidden_dim=32, output_dim=16)
    trainer = Trainer(
        max_epochs=epochs, callbacks=[*callbacks, RunState()], logger=False, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", deterministic=True,
    )
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return module, trainer


def test_module_trains_exactly_as_without_the_probe():
    """No gradient, BatchNorm statistic or random draw of the run changes: weights and buffers are identical."""
    with_probe, _ = _fit([LinearProbe()], epochs=1)
    without, _ = _fit([], epochs=1)
    for (name, value), (_, reference) in zip(with_probe.state_dict().items(), without.state_dict().items()):
        torch.testing.assert_close(value, reference, rtol=0, atol=0, msg=name)


def test_resumed_probe_equals_an_uninterrupted_one(tmp_path):
    straight = LinearProbe()
    every_epoch = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)
    straight_module, _ = _fit([straight, every_epoch], epochs=2)
    resumed = LinearProbe()
    resumed_module, _ = _fit([resumed], epochs=2, ckpt_path=next(tmp_path.glob("epoch=0-*.ckpt")))
    for key, value in straight_module.state_dict().items():
        torch.testing.assert_close(resumed_module.state_dict()[key], value, rtol=0, atol=0, msg=key)
    for part in ("standardise", "classifier"):
        for key, value in straight.state_dict()[part].items():
            torch.testing.assert_close(resumed.state_dict()[part][key], value, rtol=0, atol=0, msg=key)
    assert resumed.optimizer.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0


def test_wrong_number_of_classes_is_one_clear_error():
    with pytest.raises(ConfigurationError, match="num_classes=7 but the data has 4 classes"):
        _fit([LinearProbe(num_classes=7)], epochs=1)
