"""The spectrum-analysis CNN of the paper's appendix tables (docs/conventions.md §3)."""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.models.layers import NoiseChannels, PaddingLayer

__all__ = ["SpectrumCNN", "spectrum_block"]


def spectrum_block(
    in_channels: int, out_channels: int, hidden_dim: int, noise_channels: int, kernel: int, padding: int
) -> nn.Sequential:
    """Padding, noise channels, 1x1 conv -> ``kernel`` conv (no padding) -> 1x1 conv, each with BN; ReLU
    between, sigmoid at the end. ``kernel = 3, padding = 1`` is the paper's L1..L8 (window (3, 1, 1));
    ``kernel = 1, padding = 0`` its all-1x1 L0 / L9 body."""
    return nn.Sequential(
        PaddingLayer(padding),
        NoiseChannels(noise_channels),
        nn.Conv2d(in_channels + noise_channels, hidden_dim, 1, bias=False),
        nn.BatchNorm2d(hidden_dim),
        nn.ReLU(inplace=True),
        nn.Conv2d(hidden_dim, hidden_dim, kernel, bias=False),
        nn.BatchNorm2d(hidden_dim),
        nn.ReLU(inplace=True),
        nn.Conv2d(hidden_dim, out_channels, 1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.Sigmoid(),
    )


class SpectrumCNN(nn.Module):
    """Blocks ``L0`` .. ``L9`` of the paper's appendix, for spectrum analysis with internal costs.

    ``L0``: all 1x1 (3 -> channels). ``L1`` .. ``L8``: padding 1, noise channels, 1x1 / 3x3 / 1x1 convs,
    sigmoid; 2x2 average pooling after ``L2``, ``L4`` and ``L6`` (32 -> 16 -> 8 -> 4). ``L9``: 1x1 convs,
    then 4x4 average pooling to a 1x1 map. Internal costs go on ``L1`` .. ``L9`` (module names are the
    block names). Output ``(N, channels)``.

    Deviations from the tables, where they contradict themselves: ``L0`` and ``L9`` have no padding
    layer (their convolutions are all 1x1, so padding would only add zero positions — in ``L9`` it would
    even shift the 4x4 pool off the map), and pooling comes after every second block of ``L1`` .. ``L6``
    (three pools), the only reading under which ``L9``'s 4x4 pool sees a 4x4 map of a 32x32 image.
    """

    def __init__(
        self, in_channels: int = 3, channels: int = 64, hidden_dim: int = 200, noise_channels: int = 20, image_size: int = 32
    ) -> None:
        super().__init__()
        if image_size % 8 != 0:
            raise ConfigurationError(f"SpectrumCNN pools by 8 before L9; image_size must be a multiple of 8, got {image_size}", parameter="image_size")
        self.feature_dim = channels
        blocks: OrderedDict[str, nn.Module] = OrderedDict()
        blocks["L0"] = spectrum_block(in_channels, channels, hidden_dim, noise_channels, kernel=1, padding=0)
        for index in range(1, 9):
            blocks[f"L{index}"] = spectrum_block(channels, channels, hidden_dim, noise_channels, kernel=3, padding=1)
            if index in (2, 4, 6):
                blocks[f"pool{index}"] = nn.AvgPool2d(2)
        final = image_size // 8
        blocks["L9"] = nn.Sequential(
            spectrum_block(channels, channels, hidden_dim, noise_channels, kernel=1, padding=0), nn.AvgPool2d(final)
        )
        self.blocks = nn.Sequential(blocks)

    @property
    def internal_layers(self) -> list[str]:
        """Module names of the blocks that carry internal costs: ``blocks.L1`` .. ``blocks.L9``."""
        return [f"blocks.L{index}" for index in range(1, 10)]

    def forward(self, images: Tensor) -> Tensor:
        return self.blocks(images).flatten(1)
