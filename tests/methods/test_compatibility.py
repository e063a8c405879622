"""Start-up checks of ``methods/compatibility.py``: a backbone of one input size against every view size the data
gives (a MultiCrop's local crops included), and the feature sizes of projectors that state them as a
``torch.nn.Linear`` does, each one clear ``ConfigurationError`` before the first step."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from torch import nn

from hfmca_lightning.data import MultiCrop, MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods import HFMCAModule
from hfmca_lightning.methods.baselines import SimCLR
from hfmca_lightning.methods.compatibility import check_feature_sizes, check_image_size, check_strategy
from hfmca_lightning.models import GridExternalHead, SmallConvNet, SpectrumCNN
from tests.helpers import DEMO, quiet_trainer, tiny_overrides


def multicrop_data(**crops: int) -> MultiViewDataModule:
    """32-px images, two global and two local crops (16 px unless ``crops`` set the sizes), 4 a batch."""
    return MultiViewDataModule(
        SyntheticShapes(num_classes=4, train_per_class=8, test_per_class=3, image_size=32),
        views=MultiCrop(global_crops=2, local_crops=2, **crops),
        batch_size=4,
        num_workers=0,
    )


def test_multicrop_views_of_another_size_than_a_fixed_size_backbone_are_refused_before_the_first_step():
    """The 32-px SpectrumCNN on MultiCrop's 16-px local crops passed the check (the source is 32 px) and failed in
    torch's average pool inside the first step."""
    torch.manual_seed(0)
    backbone = SpectrumCNN(channels=6, hidden_dim=8, noise_channels=0, image_size=32)
    module = HFMCAModule(backbone, external_head=GridExternalHead(6, 2, 2, 8, noise_channels=0))
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, accelerator="cpu")
    with pytest.raises(
        ConfigurationError,
        match=r"the data's MultiCrop views are 32 px, 16 px \(from the 32-px images of SyntheticShapes\), but the "
        r"backbone SpectrumCNN is built for image_size=32 and takes no other size: set every view group to 32 px",
    ):
        trainer.fit(module, multicrop_data())
    assert trainer.global_step == 0
    check_image_size(backbone, multicrop_data(local_size=32))  # every view 32 px: passes


def test_a_fixed_size_vit_is_checked_against_every_multicrop_size():
    """A timm ViT built for 32 px failed with timm's "Input height (16) doesn't match model (32)" in the first step;
    one that takes any size (``dynamic_img_size``) passes."""
    pytest.importorskip("timm")
    from hfmca_lightning.methods.baselines import FastSiam
    from hfmca_lightning.models import TimmBackbone

    settings = {"img_size": 32, "patch_size": 8, "depth": 1}
    module = FastSiam(
        TimmBackbone("vit_tiny_patch16_224", model_kwargs=settings), hidden_dim=16, output_dim=16, prediction_dim=8
    )
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, accelerator="cpu")
    with pytest.raises(ConfigurationError, match=r"views are 32 px, 16 px .* backbone TimmBackbone is built for"):
        trainer.fit(module, multicrop_data())
    assert trainer.global_step == 0
    dynamic = TimmBackbone("vit_tiny_patch16_224", model_kwargs={**settings, "dynamic_img_size": True})
    check_image_size(dynamic, multicrop_data())


def tiny_data() -> MultiViewDataModule:
    return MultiViewDataModule(
        SyntheticShapes(num_classes=4, train_per_class=8, test_per_class=3, image_size=16),
        views=SimCLRViews(count=4),
        batch_size=8,
        num_workers=0,
    )


@pytest.mark.parametrize(
    ("projector", "head_dim", "message"),
    [
        (
            nn.Linear(16, 32),
            32,
            r"the backbone gives 8 features, but model.init_args.projector takes in_features=16: set "
            r"model.init_args.projector.init_args.in_features to 8",
        ),
        (
            nn.Linear(8, 32),
            16,
            r"the projector gives 32 features, but model.init_args.external_head takes feature_dim=16",
        ),
        (
            nn.Sequential(nn.Dropout(0.1), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)),
            16,
            r"model.init_args.projector \(Sequential\) takes 16 \(the in_features of its first Linear\): make that "
            r"Linear take 8 features",
        ),
        (
            nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU()),
            16,
            r"the projector gives 24 features, but model.init_args.external_head takes feature_dim=16",
        ),
    ],
    ids=["Linear input", "Linear output", "Sequential input", "Sequential output"],
)
def test_a_torch_linear_projector_of_the_wrong_size_is_refused_when_the_module_is_made(projector, head_dim, message):
    """``projector: {class_path: torch.nn.Linear}`` has no ``input_dim`` / ``output_dim``: the module was built and
    the first step failed with "mat1 and mat2 shapes cannot be multiplied"."""
    with pytest.raises(ConfigurationError, match=message):
        HFMCAModule(
            SmallConvNet(width=4, num_stages=2),  # 8 features
            projector=projector,
            external_head=GridExternalHead(head_dim, 2, 2, 8, noise_channels=0),
        )


def test_a_torch_linear_projector_of_the_right_sizes_trains():
    torch.manual_seed(0)
    module = HFMCAModule(
        SmallConvNet(width=4, num_stages=2),
        projector=nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)),
        external_head=GridExternalHead(16, 2, 2, 8, noise_channels=0),
    )
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, accelerator="cpu")
    trainer.fit(module, tiny_data())
    assert trainer.global_step == 1


class Doubles(nn.Module):
    """A layer that changes the feature size and states no size: (N, D) -> (N, 2 D)."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.cat([features, features], dim=1)


def test_sizes_behind_a_layer_that_states_none_are_not_guessed():
    """The first Linear after a layer of unknown effect says nothing about what the projector takes, and the last
    Linear before one nothing about what it gives; a lazily sized Linear takes any size."""
    backbone = SmallConvNet(width=4, num_stages=2)  # 8 features
    check_feature_sizes(backbone, nn.Sequential(Doubles(), nn.Linear(16, 16)), None)
    check_feature_sizes(backbone, nn.Sequential(nn.Linear(8, 16), Doubles()), GridExternalHead(16, 2, 2, 8))
    check_feature_sizes(backbone, nn.LazyLinear(16), GridExternalHead(16, 2, 2, 8))


def test_a_linear_projector_by_class_path_is_checked_when_the_cli_builds_the_module(tmp_path):
    """``projector: {class_path: torch.nn.Linear, init_args: {in_features: 32, ...}}`` in a config for the demo's
    16-feature backbone: one line naming the setting, from the CLI, before any data is read."""
    from hfmca_lightning.cli.trainer_cli import HFMCACLI

    linear = {"class_path": "torch.nn.Linear", "init_args": {"in_features": 32, "out_features": 16}}
    overrides = tiny_overrides(tmp_path, **{"model.init_args.projector": linear})
    with pytest.raises(ConfigurationError, match=r"set model.init_args.projector.init_args.in_features to 16"):
        HFMCACLI(args=["--config", str(DEMO), "--config", str(overrides)], run=False)


class ShardedBySubclass(FSDPStrategy):
    """A user's FSDP strategy: Lightning lets a subclass of FSDP run on CPUs."""


@pytest.mark.parametrize("strategy", [FSDPStrategy, ShardedBySubclass, DeepSpeedStrategy, ModelParallelStrategy])
def test_a_strategy_that_shards_the_model_is_refused_and_one_device_or_ddp_is_not(strategy):
    """FSDP, DeepSpeed and model parallelism write and read their own checkpoints, past the atomic writes, loading
    without unpickling and the architecture check; the costs are tested on one device and under DDP."""
    module = object.__new__(HFMCAModule)  # the check reads the module's name only
    with pytest.raises(ConfigurationError, match=f"{strategy.__name__} shards the model") as error:
        check_strategy(module, object.__new__(strategy))
    assert error.value.parameter == "strategy" and str(error.value).endswith("set trainer.strategy to auto or ddp")
    for allowed in (SingleDeviceStrategy(torch.device("cpu")), DDPStrategy(), DDPStrategy(start_method="spawn")):
        check_strategy(module, allowed)


def test_the_command_also_refuses_spawned_ddp_and_reads_strategy_names_without_building_them():
    """``ddp_spawn`` hands the weights back in a plain file that the command's checkpoint reader refused after a whole
    run; names are read from Lightning's registry, before its advice for them (fsdp on a CPU: "set accelerator
    cuda"; deepspeed: "pip install deepspeed")."""
    module = object.__new__(HFMCAModule)
    for name, problem in [
        ("fsdp", "FSDPStrategy shards the model"),
        ("deepspeed_stage_2", "DeepSpeedStrategy shards the model"),
        ("ddp_spawn", "DDP started by spawn hands the trained weights back in a file the command refuses to read"),
        ("ddp_notebook", "DDP started by fork hands"),
    ]:
        with pytest.raises(ConfigurationError, match=f"^HFMCAModule trains on one device or under DDP; {problem}"):
            check_strategy(module, name, command=True)
    with pytest.raises(ConfigurationError, match="DDP started by spawn"):
        check_strategy(module, DDPStrategy(start_method="spawn"), command=True)
    for name in ("auto", "ddp", "ddp_find_unused_parameters_true", "single_device", "not a strategy"):
        check_strategy(module, name, command=True)  # an unknown name is Lightning's to refuse
    check_strategy(module, "ddp_spawn")  # in Python, spawned DDP returns the weights through Lightning's own reader


def test_a_baseline_refuses_a_sharded_strategy_in_its_setup():
    """The modules' own check, for runs outside the command (the command refuses before the trainer starts)."""
    module = SimCLR(SmallConvNet(width=8, num_stages=2), hidden_dim=16, output_dim=8)
    module.trainer = quiet_trainer(accelerator="cpu", strategy=ShardedBySubclass())
    with pytest.raises(ConfigurationError, match="SimCLR trains on one device or under DDP; ShardedBySubclass shards"):
        module.setup("fit")
