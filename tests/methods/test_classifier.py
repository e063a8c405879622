"""The fine-tuning classifier of ``hfmca linear --finetune``: its settings are checked when it is made, and a run
that diverges stops in one line."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation import NonFiniteLossError
from hfmca_lightning.methods.classifier import FineTunedClassifier
from hfmca_lightning.models import SmallConvNet
from tests.helpers import quiet_trainer


@pytest.mark.parametrize(
    ("settings", "message", "parameter"),
    [
        # before: torchmetrics' "num_classes ... larger than 1" from inside the metric
        ({"num_classes": 1}, "FineTunedClassifier: num_classes must be >= 2; got 1", "num_classes"),
        # before: accepted, then a shape error at the first matrix product
        ({"feature_dim": 9}, "feature_dim is 9, but the backbone gives 8 features", "feature_dim"),
        # before: accepted; batch 0 scales the learning rate to 0, NaN trains NaN weights
        ({"batch_size": 0}, "FineTunedClassifier: batch_size must be >= 1; got 0", "batch_size"),
        ({"lr": float("nan")}, "needs a finite lr > 0 and weight_decay >= 0; got nan", "lr"),
        ({"weight_decay": -1.0}, "needs a finite lr > 0 and weight_decay >= 0; got 0.05 and -1.0", "weight_decay"),
    ],
    ids=["one class", "feature size", "batch 0", "NaN lr", "negative decay"],
)
def test_a_setting_out_of_range_is_one_line_when_the_classifier_is_made(settings, message, parameter):
    backbone = SmallConvNet(width=4, num_stages=2)  # 8 features
    arguments = {"feature_dim": 8, "num_classes": 10, **settings}
    with pytest.raises(ConfigurationError, match=message) as error:
        FineTunedClassifier(backbone, **arguments)
    assert error.value.parameter == parameter
    FineTunedClassifier(backbone, feature_dim=8, num_classes=10)  # the defaults are fine


def test_weights_made_nan_by_the_last_update_stop_the_run_without_a_validation():
    """Without a validation to check before, the losses and the weights are checked at the end of training: the last
    update's NaN weights would otherwise be scored by the command's final validation."""
    torch.manual_seed(0)
    classifier = FineTunedClassifier(SmallConvNet(width=4, num_stages=2), feature_dim=8, num_classes=2, lr=1e30)
    images, targets = torch.rand(8, 3, 16, 16), torch.tensor([0, 1] * 4)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, accelerator="cpu")
    with pytest.raises(
        NonFiniteLossError, match=r"^fine-tuning stopped after step 2: the training loss or the weights"
    ):
        loader = DataLoader(TensorDataset(images, targets), batch_size=4)
        trainer.fit(classifier, loader, val_dataloaders=loader)  # limit_val_batches=0: no validation
