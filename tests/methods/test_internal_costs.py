from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses import WindowGeometry, cost_from_statistics
from hfmca_lightning.methods import InternalCosts
from hfmca_lightning.models import CIFARResNet18, SpectrumCNN
from tests.helpers import (
    FLOAT64_UNIT,
    cost_error,
    gamma,
    reference_cost,
    reference_group_moments,
    reference_unfold_windows,
)


def window_mean_backbone() -> nn.Sequential:
    """Blocks whose output is, by construction, the mean of the input positions their window covers."""
    return nn.Sequential(
        OrderedDict(
            one_by_one=nn.AvgPool2d(1),
            padded_3x3=nn.AvgPool2d(3, 1, 1, count_include_pad=False),
            resnet_stride2=nn.AvgPool2d(7, 2, 3, count_include_pad=False),  # a stride-2 BasicBlock's window
            l9_pool=nn.AvgPool2d(4),
        )
    )


def _capture_io(module: nn.Module) -> dict[str, torch.Tensor]:
    seen = {}

    def hook(_, args, output):
        seen["low"], seen["high"] = args[0].detach(), output.detach()

    module.register_forward_hook(hook)
    return seen


def test_window_mean_blocks_match_the_hand_computed_statistics():
    backbone = window_mean_backbone()
    names = [name for name, _ in backbone.named_children()]
    internal = InternalCosts(names, reg=1e-3, precision="float64")
    internal.attach(backbone)
    geometries = {pair.module_path: pair.geometry for pair in internal.pairs}
    assert [geometries[n] for n in names] == [
        WindowGeometry(1, 1, 0),
        WindowGeometry(3, 1, 1),
        WindowGeometry(7, 2, 3),
        WindowGeometry(4, 4, 0),
    ]
    captured = {name: _capture_io(module) for name, module in backbone.named_children()}
    torch.manual_seed(0)
    with internal.record() as recording:
        backbone(torch.rand(3, 4, 8, 8, dtype=torch.float64))
    statistics = {pair.module_path: recording.statistics[pair.cost_name] for pair in internal.pairs}
    for name in names:
        geometry = geometries[name]
        members, highs, real = reference_unfold_windows(
            captured[name]["low"], captured[name]["high"], geometry.kernel, geometry.stride, geometry.padding
        )
        # The block output really is its window mean...
        torch.testing.assert_close(members.sum(dim=1) / real.sum(dim=1, keepdim=True), highs)
        r1, r2, cross = reference_group_moments(members, highs, real)
        got = statistics[name].means()
        # float64 moments of non-negative terms (window means of rand maps) over at most 3 x 64 x 49 members, in two
        # orders: 2 gamma_n ~ 2e-12 relative
        for value, expected in zip(got, (r1, r2, cross)):
            np.testing.assert_allclose(value.numpy(), expected, rtol=1e-11, atol=0)
        # ... so P = E[(mean z) h^T] = E[h h^T] = R2.
        np.testing.assert_allclose(got[2].numpy(), got[1].numpy(), rtol=1e-11, atol=0)
        cost = cost_from_statistics(statistics[name], reg=1e-3).item()
        bound = 2 * cost_error(members, highs, 1e-3)  # numpy's log-dets and the Cholesky ones
        assert cost == pytest.approx(reference_cost(r1, r2, cross, 1e-3), rel=0, abs=bound)


def test_resnet_stride2_block_statistics_match_unfolded_windows():
    backbone = CIFARResNet18()
    internal = InternalCosts(["net.layer2.0", "net.layer2.1"], precision="float64")
    internal.attach(backbone)
    assert [(pair.module_path, pair.log_name, pair.cost_name, pair.geometry) for pair in internal.pairs] == [
        ("net.layer2.0", "layer2.0", "internal/layer2.0", WindowGeometry(7, 2, 3)),
        ("net.layer2.1", "layer2.1", "internal/layer2.1", WindowGeometry(5, 1, 2)),
    ]
    assert [pair.cost.name for pair in internal.pairs] == ["internal/layer2.0", "internal/layer2.1"]
    seen = _capture_io(backbone.net.layer2[0])
    with internal.record() as recording:
        backbone(torch.rand(2, 3, 16, 16))
    members, highs, real = reference_unfold_windows(seen["low"], seen["high"], 7, 2, 3)
    # float64 moments of float32 maps summed over 2 x 8 x 8 groups of 49 members in two orders: 2 gamma_n of the
    # terms' magnitudes, which for these post-ReLU / BN maps are the moments of the absolute values
    n = members.shape[0] * members.shape[1]
    magnitudes = reference_group_moments(members.abs(), highs.abs(), real)
    for value, expected, magnitude in zip(
        recording.statistics["internal/layer2.0"].detach().means(),
        reference_group_moments(members, highs, real),
        magnitudes,
    ):
        np.testing.assert_allclose(value.numpy(), expected, rtol=0, atol=2 * gamma(n, FLOAT64_UNIT) * magnitude.max())


def log_names(layers: list[str]) -> dict[str, str]:
    return {pair.module_path: pair.log_name for pair in InternalCosts(layers).pairs}


def test_log_names_drop_the_shared_prefix():
    assert log_names(SpectrumCNN().internal_layers)["blocks.L3"] == "L3"
    assert log_names(["net.layer1.0", "net.layer2.1"]) == {"net.layer1.0": "layer1.0", "net.layer2.1": "layer2.1"}
    assert log_names(["layer1", "net.layer2"]) == {"layer1": "layer1", "net.layer2": "net.layer2"}


def test_hooks_are_idle_outside_record():
    backbone = window_mean_backbone()
    internal = InternalCosts(["padded_3x3"])
    internal.attach(backbone)
    backbone(torch.rand(1, 2, 8, 8))  # no record block: the hooks do nothing
    with internal.record() as recording:
        pass
    assert recording.statistics == {} and recording.maps == {}


def test_unknown_layer_and_layers_without_geometry_are_configuration_errors():
    with pytest.raises(
        ConfigurationError, match=r"'net.layer9' is not a module of the backbone CIFARResNet18.*net.layer1"
    ):
        InternalCosts(["net.layer9"]).attach(CIFARResNet18())
    backbone = nn.Sequential(OrderedDict(pool=nn.AdaptiveAvgPool2d(1)))
    with pytest.raises(ConfigurationError, match="internal cost layer 'pool'.*cannot derive the window geometry"):
        InternalCosts(["pool"]).attach(backbone)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch operation produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_resnet18_internal_costs_never_allocate_the_unfolded_windows():
    """9 views of 32x32 at batch 8 through ResNet-18 with internal costs on every BasicBlock."""
    backbone = CIFARResNet18()
    layers = [f"net.layer{stage}.{block}" for stage in range(1, 5) for block in range(2)]
    internal = InternalCosts(layers)
    internal.attach(backbone)
    images = torch.rand(8 * 9, 3, 32, 32)
    # The smallest unfolded window tensor: layer1 blocks, (72 * 32 * 32 windows) x 25 members x 64 channels.
    unfolded = 72 * 32 * 32 * 25 * 64
    largest_activation = 72 * 64 * 32 * 32
    tracker = LargestTensor()
    with tracker, internal.record() as recording:
        features = backbone(images)
        costs = {
            pair.cost_name: pair.cost.forward_statistics(recording.statistics[pair.cost_name])
            for pair in internal.pairs
        }
        (sum(costs.values()) + features.sum() * 0).backward()
    assert len(costs) == 8 and all(torch.isfinite(c) for c in costs.values())
    assert tracker.largest <= 2 * largest_activation < unfolded / 10


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"weight": -1.0}, "finite and >= 0; got -1.0"),
        ({"weight": float("nan")}, "finite and >= 0; got nan"),
        ({"layers": ["blocks.L1", ""]}, "none empty"),
    ],
)
def test_a_weight_that_would_not_train_or_an_empty_layer_name_is_refused(settings, message):
    with pytest.raises(ConfigurationError, match=message):
        InternalCosts(**{"layers": ["blocks.L1"], **settings})


def test_internal_costs_of_weight_zero_without_a_head_are_refused():
    """Nothing would train the model (``cost/total`` is 0); with an external head, weight 0 only logs them."""
    from hfmca_lightning.methods import HFMCAModule
    from hfmca_lightning.models import GridExternalHead

    backbone = SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0)
    with pytest.raises(ConfigurationError, match="weight is 0 and there is no external_head"):
        HFMCAModule(backbone, internal_costs=InternalCosts(["blocks.L1"], weight=0.0))
    head = GridExternalHead(4, 2, 2, 6, noise_channels=0)
    HFMCAModule(backbone, external_head=head, internal_costs=InternalCosts(["blocks.L1"], weight=0.0))
