"""The callbacks read a step's embeddings and labels by name: this project's ``features`` / ``targets`` and
stable-pretraining's ``embedding`` / ``label`` (views concatenated view after view) give the same numbers, and other
names are set on the callback."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor

from hfmca_lightning.callbacks import EigenspectrumCallback, HealthMetrics, KNNEvaluation, LinearProbe
from hfmca_lightning.callbacks.step_outputs import evaluation_rows, step_embeddings
from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule
from hfmca_lightning.models import GridExternalHead, SmallConvNet, ViewProjector
from tests.helpers import quiet_trainer


def test_both_conventions_give_the_same_embeddings_per_sample():
    per_sample = torch.randn(3, 4, 5)  # (B, L, D)
    samples_first = per_sample.reshape(12, 5)  # this project's features: a sample's views together
    views_first = per_sample.transpose(0, 1).reshape(12, 5)  # stable-pretraining: torch.cat over the views
    assert torch.equal(step_embeddings({"features": samples_first}, None, 3), per_sample)
    assert torch.equal(step_embeddings({"embedding": views_first}, None, 3), per_sample)
    assert torch.equal(step_embeddings({"z": samples_first}, "z", 3), per_sample)  # a named key: samples first
    assert torch.equal(step_embeddings({"z": views_first}, "z", 3, views_first=True), per_sample)
    assert torch.equal(step_embeddings({"embedding": samples_first}, None, 3, views_first=False), per_sample)
    assert torch.equal(step_embeddings({"features": per_sample}, None, 3), per_sample)
    assert step_embeddings({"embedding": views_first}, "z", 3) is None  # a named key only
    assert step_embeddings({"features": samples_first[:11]}, None, 3) is None  # not B rows per view
    assert step_embeddings(torch.zeros(3), None, 3) is None  # a bare loss


def test_an_evaluation_output_without_the_keys_is_one_line_naming_them():
    embeddings, labels = evaluation_rows({"embedding": torch.ones(2, 3), "label": torch.zeros(2)}, None, None, "K", 0)
    assert embeddings.shape == (2, 3) and labels.shape == (2,)
    with pytest.raises(ConfigurationError) as error:  # one line from the hfmca command, not a traceback
        evaluation_rows({"logits": torch.ones(2, 3)}, None, None, "KNNEvaluation", object())
    message = str(error.value)
    assert "\n" not in message and "'features' / 'embedding'" in message and "'targets' / 'label'" in message
    assert "['logits']" in message and "embedding_key / label_key" in message
    with pytest.raises(ConfigurationError, match="under 'z' and the labels"):
        evaluation_rows({"features": torch.ones(2, 3), "targets": torch.zeros(2)}, "z", None, "LinearProbe", 0)


class StablePretrainingNames(HFMCAModule):
    """An HFMCA module that speaks stable-pretraining's convention: a training step returns ``embedding`` (the views
    concatenated view after view, ``(L * B, D)``) and ``label`` ``(L * B,)``; evaluation ``embedding`` / ``label``."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        outputs = super().training_step(batch, batch_idx)
        views, targets = batch
        samples, count = views.shape[:2]
        features = outputs.pop("features")
        outputs["embedding"] = features.reshape(samples, count, -1).transpose(0, 1).reshape(samples * count, -1)
        outputs["label"] = targets.repeat(count)
        return outputs

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        outputs = super().validation_step(batch, batch_idx, dataloader_idx)
        return {"embedding": outputs["features"], "label": outputs["targets"]}


def tiny_run(module_class: type[HFMCAModule] = HFMCAModule) -> tuple[HFMCAModule, MultiViewDataModule]:
    """A tiny HFMCA module and its data: 4 views of 16-px shapes, 8 a batch."""
    torch.manual_seed(0)
    module = module_class(
        SmallConvNet(width=8, num_stages=2),
        projector=ViewProjector(16, 8, 8),
        external_head=GridExternalHead(8, 2, 2, 8, noise_channels=0),
        external_cost=HFMCACost(reg=0.1, name="external"),
    )
    source = SyntheticShapes(num_classes=4, train_per_class=6, test_per_class=3, image_size=16)
    return module, MultiViewDataModule(
        source, views=SimCLRViews(count=4), batch_size=8, num_workers=0, eval_batch_size=10
    )


def logged(module_class: type[HFMCAModule], folder: Path) -> dict[str, dict[int, float]]:
    """Every metric the four callbacks logged in 6 steps of a tiny HFMCA run, ``{name: {step: value}}``."""
    module, data = tiny_run(module_class)
    callbacks = [
        KNNEvaluation(k=5),
        LinearProbe(),
        EigenspectrumCallback(every_n_steps=2, min_groups=8),
        HealthMetrics(every_n_steps=2, samples_per_dim=1),
    ]
    logger = CSVLogger(folder, name="run")
    trainer = quiet_trainer(max_steps=6, callbacks=callbacks, logger=logger, log_every_n_steps=1, accelerator="cpu")
    trainer.fit(module, datamodule=data)
    (path,) = folder.glob("**/metrics.csv")
    columns: dict[str, dict[int, float]] = {}
    for row in csv.DictReader(path.open()):
        for name, value in row.items():
            if value and name not in ("step", "epoch"):
                columns.setdefault(name, {})[int(row["step"])] = float(value)
    return columns


def test_the_callbacks_log_the_same_numbers_for_either_convention(tmp_path):
    ours = logged(HFMCAModule, tmp_path / "features")
    theirs = logged(StablePretrainingNames, tmp_path / "embedding")
    expected = ("knn/top1", "linear/top1", "linear/train_loss", "rankme/backbone", "health/lidar",
                "health/effective_rank", "spectrum/external/top1")  # fmt: skip
    assert not [name for name in expected if name not in ours], sorted(ours)
    assert ours.keys() == theirs.keys()
    for name, values in ours.items():
        assert theirs[name].keys() == values.keys(), name
        for step, value in values.items():
            # RankMe sees the same rows in another order: singular values agree to float32 rounding
            assert theirs[name][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, step)


@pytest.mark.parametrize(
    "callback",
    [
        LinearProbe(embedding_key="featurs"),
        EigenspectrumCallback(every_n_steps=1, min_groups=8, embedding_key="featurs"),
        HealthMetrics(every_n_steps=1, samples_per_dim=1, embedding_key="featurs"),
    ],
    ids=["LinearProbe", "EigenspectrumCallback", "HealthMetrics"],
)
def test_an_embedding_key_the_training_steps_do_not_return_stops_the_first_step(callback):
    """A mistyped key is refused at the first training step, not read as "no key": the probe ran a forward pass of
    its own every step and the spectrum callback never logged RankMe, without a word."""
    module, data = tiny_run()
    trainer = quiet_trainer(max_steps=3, callbacks=[callback], limit_val_batches=0, accelerator="cpu")
    name = type(callback).__name__
    with pytest.raises(ConfigurationError, match=rf"^{name}: embedding_key 'featurs' names no \(B \* L, D\) embed"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1
