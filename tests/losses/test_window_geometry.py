import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from hfmca_lightning.losses import WindowGeometry, window_geometry


def probed_windows(block: nn.Module, size: int, channels: int) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """Receptive field of every output position, read off input gradients (independent of the rules)."""
    torch.manual_seed(0)
    block.eval()
    with torch.no_grad():  # positive weights and inputs keep every ReLU open, so no gradient is lost
        for parameter in block.parameters():
            parameter.copy_(parameter.abs() + 0.01)
    x = torch.rand(1, channels, size, size, requires_grad=True)
    out = block(x)
    fields = {}
    for i in range(out.shape[-2]):
        for j in range(out.shape[-1]):
            (grad,) = torch.autograd.grad(out[0, :, i, j].sum(), x, retain_graph=True)
            fields[(i, j)] = {tuple(p) for p in grad[0].abs().sum(0).nonzero().tolist()}
    return fields


def windows_of(geometry: WindowGeometry, size: int) -> dict[tuple[int, int], set[tuple[int, int]]]:
    out = geometry.output_size((size, size))
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    return {
        (i, j): {
            (i * s - p + di, j * s - p + dj)
            for di in range(k)
            for dj in range(k)
            if 0 <= i * s - p + di < size and 0 <= j * s - p + dj < size
        }
        for i in range(out[0])
        for j in range(out[1])
    }


def test_composition_rule():
    first, second = WindowGeometry(3, 2, 1), WindowGeometry(3, 1, 1)
    assert first.then(second) == WindowGeometry(3 + 2 * 2, 2, 1 + 1 * 2)
    assert WindowGeometry.identity().then(first) == first == first.then(WindowGeometry.identity())


@pytest.mark.parametrize("stride", [1, 2])
def test_torchvision_basic_block_geometry(stride: int):
    downsample = None
    if stride != 1:
        downsample = nn.Sequential(nn.Conv2d(4, 4, 1, stride, bias=False), nn.BatchNorm2d(4))
    block = BasicBlock(4, 4, stride=stride, downsample=downsample)
    geometry = window_geometry(block)
    assert geometry == WindowGeometry(2 * stride + 3, stride, stride + 1)
    assert probed_windows(block, 8, 4) == windows_of(geometry, 8)


def test_torchvision_bottleneck_geometry():
    block = Bottleneck(8, 2, stride=2, downsample=nn.Sequential(nn.Conv2d(8, 8, 1, 2)))
    geometry = window_geometry(block)
    assert geometry == WindowGeometry(1, 1, 0).then(WindowGeometry(3, 2, 1)).then(WindowGeometry(1, 1, 0))
    assert probed_windows(block, 8, 8) == windows_of(geometry, 8)


def test_paper_block_has_geometry_3_1_1():
    # Paper appendix table for L1..L8: padding layer, 1x1, 3x3 without padding, 1x1.
    block = nn.Sequential(
        nn.ZeroPad2d(1),
        nn.Conv2d(3, 6, 1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 3, 1),
        nn.Sigmoid(),
    )
    assert window_geometry(block) == WindowGeometry(3, 1, 1)
    assert probed_windows(block, 6, 3) == windows_of(WindowGeometry(3, 1, 1), 6)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ([nn.Conv2d(2, 2, 3, stride=1, padding=1), nn.AvgPool2d(2)], WindowGeometry(4, 2, 1)),
        ([nn.Conv2d(2, 2, 5, padding="same")], WindowGeometry(5, 1, 2)),
        ([nn.AvgPool2d(3, 2, 1), nn.Conv2d(2, 2, 1)], WindowGeometry(3, 2, 1)),
        ([nn.AvgPool2d(4)], WindowGeometry(4, 4, 0)),
    ],
)
def test_conv_and_pool_chains_match_probed_receptive_fields(layers, expected):
    block = nn.Sequential(*layers)
    assert window_geometry(block) == expected
    assert probed_windows(block, 8, 2) == windows_of(expected, 8)


def test_max_pool_geometry():
    # Max pooling's gradient only reaches the arg-max, so it is checked against the rule alone.
    assert window_geometry(nn.Sequential(nn.Conv2d(2, 2, 3), nn.MaxPool2d(3, 2, 1))) == WindowGeometry(5, 2, 1)


def test_declared_geometry_wins():
    class Custom(nn.Module):
        window_geometry = WindowGeometry(5, 1, 2)

    assert window_geometry(nn.Sequential(Custom(), nn.AvgPool2d(2))) == WindowGeometry(6, 2, 2)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (nn.AdaptiveAvgPool2d(1), "cannot derive the window geometry of AdaptiveAvgPool2d"),
        (nn.Conv2d(2, 2, (3, 1)), "square"),
        (nn.MaxPool2d(2, ceil_mode=True), "ceil_mode"),
        (nn.Conv2d(2, 2, 3, dilation=2), "dilated"),
        (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "reflect"),
    ],
)
def test_layers_without_a_fixed_square_window_are_rejected(layer, message):
    with pytest.raises(ValueError, match=message):
        window_geometry(nn.Sequential(nn.Conv2d(2, 2, 1), layer))


def test_output_size_rejects_inputs_smaller_than_the_window():
    assert WindowGeometry(3, 2, 1).output_size((32, 32)) == (16, 16)
    with pytest.raises(ValueError, match="does not fit"):
        WindowGeometry(5, 1, 0).output_size((3, 3))


class InputMapOf(nn.Module):
    """The input map of ``root``'s submodule ``name`` for an image (the part of the network before it)."""

    def __init__(self, root: nn.Module, name: str) -> None:
        super().__init__()
        self.root, self.name = root, name

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        captured = []
        handle = self.root.get_submodule(self.name).register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            self.root(images)
        finally:
            handle.remove()
        return captured[0]


@pytest.mark.parametrize(
    ("backbone", "name", "size", "expected"),
    [
        ("spectrum", "blocks.L1", 16, WindowGeometry(1, 1, 1)),  # L0's padding ring: map position 0 is padding
        ("spectrum", "blocks.L3", 16, WindowGeometry(6, 2, 3)),  # L0 pad, L1, L2 (3, 1, 1), 2x2 pool
        ("resnet", "layer1.0", 16, WindowGeometry(3, 1, 1)),  # the CIFAR stem conv
        ("resnet", "layer3.0", 16, WindowGeometry(25, 2, 12)),
    ],
)
def test_input_geometry_matches_the_probed_receptive_field_of_the_map(backbone, name, size, expected):
    from hfmca_lightning.losses import input_geometry
    from hfmca_lightning.models import SpectrumCNN, TorchvisionBackbone

    if backbone == "spectrum":
        root = SpectrumCNN(channels=3, hidden_dim=4, noise_channels=0, image_size=16)
    else:
        root, name = TorchvisionBackbone("resnet18", cifar_stem=True), f"net.{name}"
    geometry = input_geometry(root, name)
    assert geometry == expected
    assert probed_windows(InputMapOf(root, name), size, 3) == windows_of(geometry, size)


@pytest.mark.parametrize(
    ("model", "options", "probed"),
    [
        ("resnet18", {}, "layer2.0"),  # BasicBlock, stride in conv1, downsample registered last
        ("resnet50", {"drop_path_rate": 0.1, "drop_block_rate": 0.1}, "layer3.0"),  # Bottleneck, DropBlock2d, DropPath
        ("resnetaa50", {}, "layer2.0"),  # anti-aliased: conv2 at stride 1, then a 2x2 average pool (`aa`)
    ],
)
def test_timm_resnet_blocks_match_their_forward_pass(model, options, probed):
    """Any block named BasicBlock / Bottleneck is its main path without ``downsample``: timm registers the shortcut
    after conv2, and composing it too gave layer2.0 of resnet18 stride 4 instead of 2."""
    timm = pytest.importorskip("timm")
    from hfmca_lightning.methods.inspection import residual_blocks

    net = timm.create_model(model, num_classes=0, **options).eval()
    sizes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def record(name: str, inputs: torch.Tensor, output: torch.Tensor) -> None:
        sizes[name] = (tuple(inputs.shape[-2:]), tuple(output.shape[-2:]))

    handles = [
        net.get_submodule(name).register_forward_hook(lambda _m, args, out, name=name: record(name, args[0], out))
        for name in residual_blocks(net)
    ]
    with torch.no_grad():
        net(torch.rand(1, 3, 64, 64))
    for handle in handles:
        handle.remove()
    assert len(sizes) >= 8
    for name, (input_size, output_size) in sizes.items():
        assert window_geometry(net.get_submodule(name)).output_size(input_size) == output_size, name
    block = net.get_submodule(probed)
    geometry = window_geometry(block)
    assert geometry.stride == 2
    assert probed_windows(block, 8, block.conv1.in_channels) == windows_of(geometry, 8)
