import pytest
import torch
from torch import nn

from hfmca_lightning.models import CIFARResNet18, GridExternalHead, NoiseChannels, SmallConvNet, ViewProjector


def test_cifar_resnet18_has_the_cifar_stem():
    backbone = CIFARResNet18()
    conv1 = backbone.net.conv1
    assert conv1.kernel_size == (3, 3) and conv1.stride == (1, 1) and conv1.padding == (1, 1)
    assert isinstance(backbone.net.maxpool, nn.Identity) and isinstance(backbone.net.fc, nn.Identity)
    assert backbone(torch.rand(2, 3, 32, 32)).shape == (2, 512)
    # No downsampling before layer2: layer1 keeps the 32x32 resolution.
    trunk = nn.Sequential(backbone.net.conv1, backbone.net.bn1, backbone.net.relu, backbone.net.maxpool, backbone.net.layer1)
    assert trunk(torch.rand(1, 3, 32, 32)).shape == (1, 64, 32, 32)


def test_small_conv_net_feature_dim():
    net = SmallConvNet(width=8, num_stages=2)
    assert net.feature_dim == 16 and net(torch.rand(3, 3, 16, 16)).shape == (3, 16)


def test_projector_outputs_in_unit_interval():
    out = ViewProjector(16, 8, 32)(torch.randn(10, 16) * 100)
    assert out.shape == (10, 8) and bool((out >= 0).all()) and bool((out <= 1).all())


def test_head_places_view_l_at_row_l_div_gw_and_column_l_mod_gw():
    head = GridExternalHead(feature_dim=1, grid_height=2, grid_width=3, hidden_dim=1)
    captured = {}
    head.layers[1].register_forward_hook(lambda module, args, out: captured.setdefault("grid", args[0]))
    head.eval()
    views = torch.arange(6, dtype=torch.float32).reshape(1, 6, 1)
    assert head(views).shape == (1, 1)
    grid = captured["grid"][0, 0]
    for view in range(6):
        assert grid[view // 3, view % 3] == view


def test_head_with_noise_channels_and_wrong_view_count():
    head = GridExternalHead(feature_dim=4, grid_height=3, grid_width=3, hidden_dim=8, noise_channels=20)
    assert head.layers[1].in_channels == 24 and head.num_views == 9
    assert head(torch.rand(2, 9, 4)).shape == (2, 4)
    with pytest.raises(ValueError, match=r"expects \(B, 9, 4\) view features for its 3x3 grid"):
        head(torch.rand(2, 8, 4))


def test_noise_channels_append_uniform_noise():
    x = torch.rand(2, 3, 5, 5)
    out = NoiseChannels(20)(x)
    assert out.shape == (2, 23, 5, 5) and torch.equal(out[:, :3], x)
    assert 0 <= float(out[:, 3:].min()) and float(out[:, 3:].max()) <= 1
    assert NoiseChannels(0)(x) is x
