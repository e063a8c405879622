"""Every baseline consumes MultiViewDataModule batches unchanged, trains real steps, and its loss decreases."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods.baselines import BYOL, BarlowTwins, FastSiam, MoCo, SimCLR, SimSiam, VICReg, VICRegL
from hfmca_lightning.models import SmallConvNet
from tests.helpers import quiet_trainer

SMALL_HEADS = {
    SimCLR: {"hidden_dim": 64, "output_dim": 32},
    MoCo: {"hidden_dim": 64, "output_dim": 32, "memory_bank_size": 64},
    BYOL: {"hidden_dim": 64, "output_dim": 32},
    SimSiam: {"hidden_dim": 64, "output_dim": 32, "prediction_dim": 16},
    FastSiam: {"hidden_dim": 64, "output_dim": 32, "prediction_dim": 16},
    BarlowTwins: {"hidden_dim": 64, "output_dim": 64},
    VICReg: {"hidden_dim": 64, "output_dim": 64},
    VICRegL: {
        "hidden_dim": 64,
        "output_dim": 64,
        "local_hidden_dim": 16,
        "local_output_dim": 16,
        "local_layer": "features",
        "num_matches": (8, 2),
    },
}


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


@pytest.mark.parametrize("method", list(SMALL_HEADS), ids=lambda m: m.__name__)
def test_baseline_trains_and_its_loss_decreases(method):
    torch.manual_seed(0)
    module = method(
        SmallConvNet(width=8, num_stages=2),
        optimizer=partial(torch.optim.Adam, lr=3e-3),
        lr_scheduler=partial(torch.optim.lr_scheduler.ConstantLR, factor=1.0, total_iters=0),
        **SMALL_HEADS[method],
    )
    views = 4 if method is FastSiam else 2
    grids = 4 if method is VICRegL else 0  # SmallConvNet's 2 stages: 16 px -> a 4x4 local map
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=4, train_per_class=16, image_size=16),
        views=SimCLRViews(count=views, grids=grids),
        batch_size=16,
        num_workers=0,
    )
    losses = Losses()
    quiet_trainer(
        max_epochs=4,
        limit_val_batches=0,
        callbacks=[losses],
    ).fit(module, data)
    assert len(losses.values) == 16
    # MoCo's loss first rises while its memory bank (64 keys, 16 per step) fills with negatives.
    start = 4 if method is MoCo else 0
    first, last = sum(losses.values[start : start + 4]) / 4, sum(losses.values[-4:]) / 4
    assert last < first, (method.__name__, losses.values)


def test_fastsiam_needs_several_views():
    module = FastSiam(SmallConvNet(width=8, num_stages=2), **SMALL_HEADS[FastSiam])
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=2, train_per_class=8), views=SimCLRViews(count=2), batch_size=4, num_workers=0
    )
    with pytest.raises(ConfigurationError, match="FastSiam needs at least 3 views per image; the data gives 2"):
        Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False).fit(module, data)


@pytest.mark.parametrize("method", [SimCLR, MoCo, BYOL, SimSiam, BarlowTwins, VICReg], ids=lambda m: m.__name__)
def test_a_pair_baseline_given_more_views_than_it_compares_is_refused(method):
    """The pair losses read views 0 and 1: more views per image would be drawn and never used."""
    module = method(SmallConvNet(width=8, num_stages=2), **SMALL_HEADS[method])
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=2, train_per_class=8), views=SimCLRViews(count=4), batch_size=4, num_workers=0
    )
    with pytest.raises(ConfigurationError, match=f"{method.__name__} compares 2 views per image, but the data gives 4"):
        Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False).fit(module, data)


def test_fastsiam_target_is_the_mean_of_the_other_views():
    torch.manual_seed(0)
    module = FastSiam(SmallConvNet(width=4, num_stages=1), **SMALL_HEADS[FastSiam]).eval()
    views = [torch.rand(3, 3, 8, 8) for _ in range(4)]
    projections, predictions = module.project(views)
    expected = torch.stack(
        [
            module.criterion(predictions[i], torch.stack([projections[j] for j in range(4) if j != i]).mean(0))
            for i in range(4)
        ]
    ).mean()
    torch.testing.assert_close(module.views_loss(views), expected)


def test_vicregl_loss_is_lightlys_on_the_views_global_and_local_projections_and_grids():
    torch.manual_seed(0)
    module = VICRegL(SmallConvNet(width=4, num_stages=2), **SMALL_HEADS[VICRegL])
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=2, train_per_class=8, image_size=16),
        views=SimCLRViews(count=2, grids=4),
        batch_size=8,
        num_workers=0,
    )
    views, targets, grids = next(iter(data.train_dataloader()))
    loss = module.training_step((views, targets, grids), 0)["loss"]
    features = []
    for view in views.unbind(1):
        local_map = module.backbone.features(view)  # (B, 8, 4, 4): the named local layer's output
        features.append(
            (module.projection_head(module.backbone(view)), module.local_projection_head(local_map.permute(0, 2, 3, 1)))
        )
    expected = module.criterion(global_view_features=features, global_view_grids=[grids[:, 0], grids[:, 1]])
    torch.testing.assert_close(loss, expected)
    swapped = module.criterion(global_view_features=features, global_view_grids=[grids[:, 1], grids[:, 0]])
    assert not torch.allclose(loss, swapped)  # the grids matter: each view is matched with its own positions


def test_vicregl_without_view_grids_fails_before_training():
    module = VICRegL(SmallConvNet(width=4, num_stages=2), **SMALL_HEADS[VICRegL])
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=2, train_per_class=8, image_size=16),
        views=SimCLRViews(count=2),
        batch_size=4,
        num_workers=0,
    )
    with pytest.raises(
        ConfigurationError, match=r"hfmca_lightning\.data\.SimCLRViews, init_args: \{.*grids: G\}"
    ) as error:
        Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False).fit(module, data)
    assert error.value.parameter == "views"
    with pytest.raises(ConfigurationError, match="no residual blocks"):
        VICRegL(SmallConvNet(width=4, num_stages=2))
    too_many = VICRegL(SmallConvNet(width=4, num_stages=2), **{**SMALL_HEADS[VICRegL], "num_matches": (20, 4)})
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=2, train_per_class=8, image_size=16),
        views=SimCLRViews(count=2, grids=4),
        batch_size=4,
        num_workers=0,
    )
    with pytest.raises(ConfigurationError, match="more matches than the 4x4 local map") as error:
        Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False).fit(too_many, data)
    assert error.value.parameter == "num_matches"


@pytest.mark.parametrize(
    ("method", "settings", "message"),
    [
        (SimCLR, {"temperature": -1.0}, "SimCLR: temperature must be finite and > 0; got -1.0"),
        (MoCo, {"momentum": 1.5}, r"MoCo: momentum must be in \[0, 1\]"),
        (BYOL, {"momentum": -1.0}, r"BYOL: momentum must be in \[0, 1\]"),
        (SimCLR, {"hidden_dim": 0}, "SimCLR: hidden_dim must be a size >= 1; got 0"),
        (SimSiam, {"prediction_dim": 0}, "SimSiam: prediction_dim must be a size >= 1"),
        (BarlowTwins, {"output_dim": 0}, "BarlowTwins: output_dim must be a size >= 1"),
        (SimCLR, {"hidden_dim": 64.0}, "SimCLR: hidden_dim must be a whole number >= 1; got 64.0"),  # before: torch's
        # before: the local loss maximised (alpha 2: weight -1), a NaN loss (no matches), or a value dropped
        (VICRegL, {"alpha": 2.0}, r"VICRegL: alpha must be in \[0, 1\] \(the global loss's weight"),
        (VICRegL, {"alpha": -0.5}, r"VICRegL: alpha must be in \[0, 1\]"),
        (VICRegL, {"num_matches": (0, 0)}, r"VICRegL: num_matches must be two counts >= 1 .*; got \(0, 0\)"),
        (VICRegL, {"num_matches": (-1, 4)}, "VICRegL: num_matches must be two counts >= 1"),
        (VICRegL, {"num_matches": (1, 2, 3)}, "VICRegL: num_matches must be two counts >= 1"),
    ],
)
def test_a_baseline_setting_out_of_its_range_is_one_line(method, settings, message):
    """Before: trained silently (a negative temperature, a momentum outside [0, 1]) or an error deep in a head."""
    with pytest.raises(ConfigurationError, match=message):
        method(SmallConvNet(width=8, num_stages=2), **settings)
