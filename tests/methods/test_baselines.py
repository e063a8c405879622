"""Every baseline consumes MultiViewDataModule batches unchanged, trains real steps, and its loss decreases."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods.baselines import BYOL, BarlowTwins, FastSiam, MoCo, SimCLR, SimSiam, VICReg, VICRegL
from hfmca_lightning.methods.compatibility import ArchitectureMismatch
from hfmca_lightning.models import SmallConvNet
from tests.helpers import RaiseAtStep, quiet_trainer

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


def shapes_data(
    views: int = 2, grids: int = 0, batch_size: int = 4, num_classes: int = 2, per_class: int = 8, image_size: int = 16
) -> MultiViewDataModule:
    """The tiny SyntheticShapes data of these tests: ``views`` SimCLR views per image, crop grids if ``grids``."""
    return MultiViewDataModule(
        SyntheticShapes(num_classes=num_classes, train_per_class=per_class, image_size=image_size),
        views=SimCLRViews(count=views, grids=grids),
        batch_size=batch_size,
        num_workers=0,
    )


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
    data = shapes_data(views=views, grids=grids, batch_size=16, num_classes=4, per_class=16)
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
    data = shapes_data(image_size=32)
    with pytest.raises(ConfigurationError, match="FastSiam needs at least 3 views per image; the data gives 2"):
        quiet_trainer(max_epochs=1).fit(module, data)


@pytest.mark.parametrize("method", [SimCLR, MoCo, BYOL, SimSiam, BarlowTwins, VICReg], ids=lambda m: m.__name__)
def test_a_pair_baseline_given_more_views_than_it_compares_is_refused(method):
    """The pair losses read views 0 and 1: more views per image would be drawn and never used."""
    module = method(SmallConvNet(width=8, num_stages=2), **SMALL_HEADS[method])
    data = shapes_data(views=4, image_size=32)
    with pytest.raises(ConfigurationError, match=f"{method.__name__} compares 2 views per image, but the data gives 4"):
        quiet_trainer(max_epochs=1).fit(module, data)


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
    data = shapes_data(grids=4, batch_size=8)
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
    data = shapes_data()
    with pytest.raises(
        ConfigurationError, match=r"hfmca_lightning\.data\.SimCLRViews, init_args: \{.*grids: G\}"
    ) as error:
        quiet_trainer(max_epochs=1).fit(module, data)
    assert error.value.parameter == "views"
    with pytest.raises(ConfigurationError, match="no residual blocks"):
        VICRegL(SmallConvNet(width=4, num_stages=2))
    too_many = VICRegL(SmallConvNet(width=4, num_stages=2), **{**SMALL_HEADS[VICRegL], "num_matches": (20, 4)})
    data = shapes_data(grids=4)
    with pytest.raises(ConfigurationError, match="more matches than the 4x4 local map") as error:
        quiet_trainer(max_epochs=1).fit(too_many, data)
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


def _moco_run(seed: int) -> tuple[MoCo, MultiViewDataModule]:
    """A tiny MoCo (8 keys per step into a 64-key bank) and its data, the weights drawn from ``seed``."""
    torch.manual_seed(seed)
    module = MoCo(
        SmallConvNet(width=8, num_stages=2),
        optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        lr_scheduler=partial(torch.optim.lr_scheduler.ConstantLR, factor=1.0, total_iters=0),
        **SMALL_HEADS[MoCo],
    )
    data = shapes_data(batch_size=8, num_classes=4)
    return module, data


def _moco_state(module: MoCo) -> dict[str, torch.Tensor]:
    """Every weight and buffer, and the memory bank and its write position (not in lightly's state_dict)."""
    bank = module.criterion.memory_bank
    return {**module.state_dict(), "bank": bank.bank.clone(), "bank_ptr": bank.bank_ptr.clone()}


def _interrupted_moco(tmp_path: Path, steps: int, stop_at: int) -> MoCo:
    """A MoCo run of ``steps`` steps that fails at step ``stop_at`` (as a run killed there), a checkpoint of every
    step in ``tmp_path`` (``last.ckpt``: the state after ``stop_at`` steps)."""
    interrupted, data = _moco_run(seed=0)
    callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1), RaiseAtStep(stop_at, rank=0)]
    with pytest.raises(OSError, match="unreadable"):
        quiet_trainer(max_steps=steps, limit_val_batches=0, callbacks=callbacks, enable_checkpointing=True).fit(
            interrupted, data
        )
    assert interrupted.global_step == stop_at
    return interrupted


def test_an_interrupted_and_resumed_moco_fit_equals_an_uninterrupted_one(tmp_path):
    """The memory bank travels in the checkpoint: lightly keeps it in non-persistent buffers, so a resumed run
    started from a fresh random bank (weights 0.03 off the uninterrupted run's after 3 more steps)."""
    uninterrupted, data = _moco_run(seed=0)
    quiet_trainer(max_steps=8, limit_val_batches=0).fit(uninterrupted, data)
    interrupted = _interrupted_moco(tmp_path, steps=8, stop_at=5)  # the same run (momentum schedule over 8 steps)
    assert int(interrupted.criterion.memory_bank.bank_ptr) == 40  # 5 steps of 8 keys: the bank is part full
    resumed, data = _moco_run(seed=1)  # another fresh bank: what the checkpoint holds must replace it
    quiet_trainer(max_steps=8, limit_val_batches=0).fit(resumed, data, ckpt_path=str(tmp_path / "last.ckpt"))
    expected, got = _moco_state(uninterrupted), _moco_state(resumed)
    assert list(got) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, rtol=0, atol=0, msg=lambda problem, name=name: f"{name}: {problem}"
        )


def test_a_moco_checkpoint_without_its_memory_bank_resumes_with_a_warning(tmp_path):
    """A checkpoint written before banks were saved still resumes: with a fresh bank, and a warning saying so. A bank
    of another size is one clear error."""
    interrupted = _interrupted_moco(tmp_path, steps=4, stop_at=2)
    old = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert torch.equal(old.pop("moco_memory_bank")["bank"], interrupted.criterion.memory_bank.bank)
    torch.save(old, tmp_path / "old.ckpt")
    resumed, data = _moco_run(seed=0)
    with pytest.warns(UserWarning, match="MoCo: the checkpoint holds no memory bank .* fresh bank of random keys"):
        quiet_trainer(max_steps=4, limit_val_batches=0).fit(resumed, data, ckpt_path=str(tmp_path / "old.ckpt"))
    assert resumed.global_step == 4
    smaller, data = _moco_run(seed=0)
    smaller.criterion.memory_bank.bank = torch.zeros(32, 32)
    with pytest.raises(ArchitectureMismatch, match=r"memory bank: checkpoint \(64, 32\) vs model \(32, 32\)"):
        quiet_trainer(max_steps=4, limit_val_batches=0).fit(smaller, data, ckpt_path=str(tmp_path / "last.ckpt"))


@pytest.mark.parametrize("method", [BYOL, MoCo], ids=lambda m: m.__name__)
def test_a_momentum_baseline_without_a_known_run_length_is_refused_before_training(method):
    """The momentum schedule runs over ``estimated_stepping_batches``: with ``max_epochs -1`` and only ``max_time``
    that is inf, which was an OverflowError at the first step."""
    module = method(SmallConvNet(width=8, num_stages=2), **SMALL_HEADS[method])
    data = shapes_data()
    trainer = quiet_trainer(max_epochs=-1, max_time="00:00:00:30", limit_val_batches=0)
    with pytest.raises(
        ConfigurationError,
        match=r"momentum rises .* but this run has no known length \(trainer.max_epochs -1 and no trainer.max_steps",
    ):
        trainer.fit(module, data)
    assert trainer.global_step == 0
    quiet_trainer(max_epochs=-1, max_steps=2, limit_val_batches=0).fit(module, data)  # a known length trains


@pytest.mark.parametrize("method", [m for m in SMALL_HEADS if m is not VICRegL], ids=lambda m: m.__name__)
def test_crop_grids_for_a_baseline_other_than_vicregl_are_refused_before_training(method):
    """Crop grids make batches (views, targets, grids): before, 'too many values to unpack' at the first step."""
    module = method(SmallConvNet(width=8, num_stages=2), **SMALL_HEADS[method])
    data = shapes_data(views=4 if method is FastSiam else 2, grids=4)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    with pytest.raises(
        ConfigurationError, match=f"only VICRegL reads; {method.__name__} takes .*remove grids from the views"
    ) as refused:
        trainer.fit(module, data)
    assert refused.value.parameter == "grids" and trainer.global_step == 0


@pytest.mark.parametrize("method", list(SMALL_HEADS), ids=lambda m: m.__name__)
def test_one_sample_per_batch_is_refused_before_training_where_a_head_normalises_over_the_samples(method):
    """BatchNorm in the heads needs two samples: before, torch's 'Expected more than 1 value per channel' at the first
    step. MoCo's heads have none and its backbone's BatchNorm2d normalises over the map's positions: it trains."""
    module = method(SmallConvNet(width=8, num_stages=2), **SMALL_HEADS[method])
    data = shapes_data(views=4 if method is FastSiam else 2, grids=4 if method is VICRegL else 0, batch_size=1)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0)
    if method is MoCo:
        trainer.fit(module, data)
        assert trainer.global_step == 2
        return
    with pytest.raises(
        ConfigurationError,
        match=f"{method.__name__} trains on batches of 1 sample per process, but its BatchNorm layer "
        r"projection_head\.layers\.1 normalises over the samples and needs at least 2 \(under DDP the batch is per "
        r"process\): set data\.init_args\.batch_size to 2 or more",
    ) as refused:
        trainer.fit(module, data)
    assert refused.value.parameter == "batch_size" and trainer.global_step == 0
