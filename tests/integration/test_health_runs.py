"""The health callback under DDP (two CPU processes, gloo, spawned): the same values at the same steps as one
process with the same global batch, its sums all-reduced."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from hfmca_lightning.callbacks import HealthMetrics
from tests.helpers import PER_RANK_BATCH, ddp_data, ddp_trainer
from tests.helpers.health import HealthProbe, assert_health_equal, logged_health, window_steps

# HealthProbe trains only: the data module's kNN loaders go unused.
pytestmark = pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`")


class StepFeatures(Callback):
    """Each step's ``outputs["features"]`` as ``(B, L, D)`` float64, by the optimiser step it ends (this process)."""

    def __init__(self) -> None:
        self.steps: dict[int, torch.Tensor] = {}

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        views = batch[0]
        self.steps[trainer.global_step] = outputs["features"].double().reshape(views.shape[0], views.shape[1], -1)


def test_ddp_health_equals_one_process_with_the_doubled_batch(tmp_path):
    """24 images of 16 px, 4 views, embeddings the views' 2 x 2 average-pooled pixels (12 numbers, exactly the same
    whatever the batch: no weights, learning rate 0): a window of 3 steps of 8 samples (8 on one process, 4 on
    each of two) before every 4th step, across epochs of 3 steps. Both processes log the all-reduced values; they
    are those of one process to the float64 error of the same sums in another order."""
    settings = dict(max_steps=8, limit_val_batches=0)
    single = HealthProbe(dim=None, lr=0.0)
    features = StepFeatures()
    ddp_trainer(1, **settings, callbacks=[HealthMetrics(every_n_steps=4), features]).fit(
        single, ddp_data(2 * PER_RANK_BATCH)
    )
    distributed = HealthProbe(dim=None, lr=0.0, folder=str(tmp_path))
    ddp_trainer(2, **settings, callbacks=[HealthMetrics(every_n_steps=4)]).fit(distributed, ddp_data(PER_RANK_BATCH))

    one = logged_health(single.health)
    ranks = [logged_health(json.loads((tmp_path / f"health{rank}.json").read_text())) for rank in range(2)]
    assert ranks[0] == ranks[1]  # every process logs the same all-reduced sums' metrics
    assert sorted(one) == sorted(ranks[0]) == [4, 8]
    window = window_steps(2, 12, 2 * PER_RANK_BATCH)
    assert window == 3
    for step, values in one.items():
        embeddings = torch.cat([features.steps[s] for s in range(step - window + 1, step + 1)])
        assert embeddings.shape == (24, 4, 12)
        assert_health_equal(values, embeddings)  # one process: the window's embeddings
        assert_health_equal(ranks[0][step], embeddings)  # two processes: the same, summed in another order
