import pytest
import torch

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import GridExternalHead, SmallConvNet, SpectrumCNN


def test_a_module_without_any_cost_is_rejected():
    with pytest.raises(ConfigurationError, match="needs an external_head, internal_costs, or both"):
        HFMCAModule(SmallConvNet())


def test_a_projector_without_a_head_is_rejected():
    with pytest.raises(ConfigurationError, match="no external_head"):
        HFMCAModule(SpectrumCNN(), projector=torch.nn.Identity(), internal_costs=InternalCosts(["blocks.L1"]))


def test_cost_modules_are_named_like_their_logs():
    module = HFMCAModule(
        SpectrumCNN(channels=4, hidden_dim=8, noise_channels=0),
        external_head=GridExternalHead(4, 3, 3, 8),
        internal_costs=InternalCosts(["blocks.L1", "blocks.L9"], reg=1e-3, beta=0.5),
    )
    costs = module.cost_modules()
    assert list(costs) == ["external", "internal/L1", "internal/L9"]
    assert costs["internal/L9"].beta == 0.5 and costs["external"].reg == 0.1
    # The EMA buffers of every internal cost are part of the checkpointed state.
    assert "internal_costs.costs.blocks/L9.joint_ema" in module.state_dict()


def _bn_free_module(**kwargs) -> HFMCAModule:
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    return HFMCAModule(backbone, projector=torch.nn.Linear(4, 4), external_head=GridExternalHead(4, 2, 2, 8), **kwargs)


def test_per_view_and_concatenated_views_agree_without_batch_norm_in_the_backbone():
    views = torch.rand(3, 4, 3, 8, 8)
    concat, per_view = _bn_free_module(), _bn_free_module(views_through_backbone="per_view")
    per_view.load_state_dict(concat.state_dict())
    for module in (concat, per_view):
        module.eval()
    for got, expected in zip(per_view.encode_views(views), concat.encode_views(views)):
        torch.testing.assert_close(got, expected)


def test_per_view_batch_norm_sees_one_view_at_a_time():
    module = HFMCAModule(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.BatchNorm1d(3)), external_head=GridExternalHead(3, 1, 2, 4), views_through_backbone="per_view")
    seen = []
    module.backbone[1].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    module.encode_views(torch.rand(5, 2, 3, 1, 1))
    assert seen == [5, 5]


def test_channels_last_and_compiled_backbone_give_the_same_features():
    images = torch.rand(2, 3, 8, 8)
    reference = _bn_free_module()
    fast = _bn_free_module(channels_last=True, compile_backbone=True)
    fast.load_state_dict(reference.state_dict())
    assert list(fast.state_dict()) == list(reference.state_dict())  # compiling does not rename weights
    assert fast.backbone[0].weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(fast(images), reference(images), rtol=1e-5, atol=1e-6)


def test_unknown_view_mode_is_rejected():
    with pytest.raises(ConfigurationError, match="views_through_backbone"):
        _bn_free_module(views_through_backbone="stacked")
