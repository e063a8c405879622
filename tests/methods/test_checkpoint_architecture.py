"""Loading the state of another architecture into a method's module is one clear error (``ArchitectureMismatch``), on
every path that loads one (Lightning's restore, ``load_from_checkpoint``, ``load_run``), as torch sees the keys after
the modules' own load hooks; ``strict=False`` loads what fits, and lazily sized parameters take the checkpoint's."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from hfmca_lightning.errors import HFMCAWarning
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule
from hfmca_lightning.methods.baselines import SimCLR
from hfmca_lightning.methods.compatibility import ArchitectureMismatch, load_checked_state_dict
from hfmca_lightning.models import GridExternalHead, SmallConvNet, SpectrumCNN, ViewProjector


def simclr(width: int = 8, hidden_dim: int = 32) -> SimCLR:
    return SimCLR(SmallConvNet(width=width, num_stages=2), hidden_dim=hidden_dim, output_dim=16)


def hfmca(width: int = 8) -> HFMCAModule:
    return HFMCAModule(
        SmallConvNet(width=width, num_stages=2),
        projector=ViewProjector(2 * width, 8, 16),
        external_head=GridExternalHead(8, 2, 2, 12),
        external_cost=HFMCACost(reg=0.1),
    )


@pytest.mark.parametrize("build", [simclr, hfmca], ids=["SimCLR", "HFMCAModule"])
def test_another_architecture_is_one_clear_error_and_loads_nothing(build):
    module, other = build(), build(width=4)
    before = {key: value.clone() for key, value in module.state_dict().items()}
    with pytest.raises(ArchitectureMismatch) as refused:
        module.load_state_dict(other.state_dict())
    assert "shape mismatches (e.g. backbone.features.0.0.weight: checkpoint (4, 3, 3, 3) vs model (8, 3, 3, 3))" in (
        refused.value.details
    )
    assert all(torch.equal(value, before[key]) for key, value in module.state_dict().items())


def test_missing_and_unexpected_parameters_are_named_and_the_module_is_left_as_it_was():
    module, state = simclr(), simclr().state_dict()
    before = {key: value.clone() for key, value in module.state_dict().items()}
    state["backbone.extra.weight"] = torch.zeros(1)
    del state["projection_head.layers.0.weight"]
    with pytest.raises(ArchitectureMismatch, match="1 parameters missing from the checkpoint") as refused:
        module.load_state_dict(state)
    assert "(e.g. projection_head.layers.0.weight)" in refused.value.details
    assert "1 parameters the model does not have (e.g. backbone.extra.weight)" in refused.value.details
    assert all(torch.equal(value, before[key]) for key, value in module.state_dict().items())


def test_strict_false_loads_what_fits():
    """``SimCLR.load_from_checkpoint(..., strict=False)`` with the backbone's weights only (it was refused)."""
    module, trained = simclr(), simclr()
    backbone_only = {key: value for key, value in trained.state_dict().items() if key.startswith("backbone.")}
    result = module.load_state_dict(backbone_only, strict=False)
    assert result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(module.state_dict()[key], value) for key, value in backbone_only.items())


def test_lazily_sized_parameters_take_the_checkpoints_sizes():
    """An uninitialised ``LazyLinear`` has no shape to compare (reading it raised from inside torch)."""
    trained = nn.Sequential(nn.LazyLinear(5))
    trained(torch.zeros(2, 3))
    fresh = nn.Sequential(nn.LazyLinear(5))
    load_checked_state_dict(fresh, trained.state_dict())
    assert torch.equal(fresh[0].weight, trained[0].weight)


class RenamesOnLoad(nn.Module):
    """A module that reads an older key (``old_weight``) as its ``weight`` in a load hook."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "old_weight" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "old_weight")
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_keys_are_compared_after_the_modules_load_hooks():
    module = nn.Sequential(RenamesOnLoad())
    load_checked_state_dict(module, {"0.old_weight": torch.ones(3)})
    assert torch.equal(module[0].weight, torch.ones(3))


def spectrum_module(layout: str) -> HFMCAModule:
    return HFMCAModule(
        SpectrumCNN(channels=6, hidden_dim=8, noise_channels=0, layout=layout),
        external_head=GridExternalHead(6, 2, 2, 8, noise_channels=0),
    )


def test_a_refused_checkpoint_leaves_a_spectrum_cnn_in_its_own_layout():
    """The SpectrumCNN takes a checkpoint's layout from its extra state while torch loads; a checkpoint of another
    layout and a missing key was refused, and the module was left with the checkpoint's layout (three pools), not its
    own. Now its extra state is put back with its tensors, and no warning says it switched."""
    torch.manual_seed(0)
    module = spectrum_module("paper").eval()
    images = torch.rand(2, 3, 32, 32)
    before = module.backbone(images)
    other = spectrum_module("three_pools").state_dict()
    del other["external_head.layers.1.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the layout warning of a load that did not happen is no news
        with pytest.raises(ArchitectureMismatch, match="1 parameters missing from the checkpoint"):
            module.load_state_dict(other)
    assert module.backbone.layout == "paper" and module.backbone.state_dict()["_extra_state"] == {"layout": "paper"}
    assert [name for name, _ in module.backbone.blocks.named_children() if name.startswith("pool")] == [
        "pool2",
        "pool4",
        "pool6",
        "pool8",
    ]
    torch.testing.assert_close(module.backbone(images), before, rtol=0, atol=0)
    # a checkpoint of the other layout that fits loads, and switches the layout with a warning
    with pytest.warns(HFMCAWarning, match="trained with layout 'three_pools'; using it instead of the configured"):
        module.load_state_dict(spectrum_module("three_pools").state_dict())
    assert module.backbone.layout == "three_pools"
