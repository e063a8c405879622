"""The spectrum-analysis CNN of the paper's appendix tables (docs/conventions.md §3)."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Literal

from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError, HFMCAWarning, check_at_least
from hfmca_lightning.models.layers import NoiseChannels, PaddingLayer

__all__ = ["SpectrumCNN", "spectrum_block", "SpectrumLayout"]

SpectrumLayout = Literal["paper", "three_pools"]


def spectrum_block(
    in_channels: int, out_channels: int, hidden_dim: int, noise_channels: int, kernel: int, padding: int
) -> nn.Sequential:
    """Padding, noise channels, 1x1 conv -> ``kernel`` conv (no padding) -> 1x1 conv, each with BN; ReLU
    between, sigmoid at the end. ``kernel = 3, padding = 1`` is the paper's L1..L8 (window (3, 1, 1));
    ``kernel = 1`` its all-1x1 L0 / L9 body."""
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
    """Blocks ``L0`` .. ``L9`` of the paper's appendix tables, for spectrum analysis with internal costs.

    ``layout="paper"`` (default) follows the tables literally: every block, ``L0`` and ``L9`` included,
    starts with a padding layer (pad 1) and the noise channels; ``L0`` is all 1x1 (``in_channels`` -> ``channels``),
    ``L1`` .. ``L8`` are 1x1 / 3x3 (no padding) / 1x1 and keep the size; "average pooling with a kernel size of 2 is
    applied every two blocks from L1 to L8" — after ``L2``, ``L4``, ``L6`` and ``L8``; ``L9`` is all 1x1 and
    ends with the average pool that leaves one position. For a 32x32 image::

        L0: 32 -> pad 34 -> 34     L1..L8 keep the size; pools 34 -> 17 -> 8 -> 4 -> 2
        L9: 2 -> pad 4 -> 4 -> 4x4 pool -> 1

    ``layout="three_pools"``: the earlier reading — no padding layer in ``L0`` / ``L9``, pools after ``L2``,
    ``L4``, ``L6`` (32 -> 16 -> 8 -> 4), ``L9``'s 4x4 pool over the unpadded 4x4 map. Internal costs go on
    ``L1`` .. ``L9`` (module names are the block names).

    The layout is saved with the weights (``state_dict`` extra state); loading weights of the other layout
    switches to it with a warning, and weights without a layout entry load as ``three_pools``.

    Args:
        in_channels: the channels of the input images, which ``L0`` takes (3 in the tables: RGB).
        channels: the output channels of every block, and the size of the output ``(N, channels)``.
        hidden_dim: the channels between the three convolutions of each block.
        noise_channels: how many U(0, 1) noise channels every block appends at its start (20 in the tables); 0 turns
            them off.
        image_size: the side of the input images in pixels; it sizes ``L9``'s final pool. ``"paper"`` needs at
            least 14, ``"three_pools"`` a multiple of 8.
        layout: ``"paper"`` or ``"three_pools"``, as above.

    Raises:
        ConfigurationError: when ``in_channels``, ``channels`` or ``hidden_dim`` is not a whole number >= 1,
            ``noise_channels`` not one >= 0, ``layout`` is unknown, or ``image_size`` does not fit the layout.
    """

    def __init__(
        self,
        in_channels: int = 3,
        channels: int = 64,
        hidden_dim: int = 200,
        noise_channels: int = 20,
        image_size: int = 32,
        layout: SpectrumLayout = "paper",
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("channels", channels), ("hidden_dim", hidden_dim)):
            check_at_least(value, 1, name, "SpectrumCNN")
        check_at_least(noise_channels, 0, "noise_channels", "SpectrumCNN")
        self.feature_dim = channels
        self.image_size = image_size
        self.in_channels = in_channels
        # L0's and L9's padding and L9's final pool depend on the layout: _arranged sets them.
        blocks = {"L0": spectrum_block(in_channels, channels, hidden_dim, noise_channels, kernel=1, padding=0)}
        blocks.update(
            {
                f"L{index}": spectrum_block(channels, channels, hidden_dim, noise_channels, kernel=3, padding=1)
                for index in range(1, 9)
            }
        )
        blocks["L9"] = nn.Sequential(
            spectrum_block(channels, channels, hidden_dim, noise_channels, kernel=1, padding=0), nn.AvgPool2d(1)
        )
        self.layout = layout
        self.blocks = self._arranged(blocks, layout)

    def _arranged(self, blocks: Mapping[str, nn.Module], layout: str) -> nn.Sequential:
        """``blocks`` L0..L9 (these very modules) with the padding of L0 / L9 and the pools of ``layout``."""
        if layout not in ("paper", "three_pools"):
            raise ConfigurationError(f"layout must be 'paper' or 'three_pools'; got {layout!r}", parameter="layout")
        outer_padding, pools_after = (1, (2, 4, 6, 8)) if layout == "paper" else (0, (2, 4, 6))
        size = self.image_size + 2 * outer_padding
        for _ in pools_after:
            size //= 2
        if size < 1 or (layout == "three_pools" and self.image_size % 8 != 0):
            needed = "at least 14" if layout == "paper" else "a multiple of 8"
            raise ConfigurationError(
                f"SpectrumCNN(layout={layout!r}) pools {len(pools_after)} times before L9; image_size must be "
                f"{needed}, got {self.image_size}",
                parameter="image_size",
            )
        arranged: OrderedDict[str, nn.Module] = OrderedDict()
        for index in range(10):
            arranged[f"L{index}"] = blocks[f"L{index}"]
            if index in pools_after:
                arranged[f"pool{index}"] = nn.AvgPool2d(2)
        first, last = arranged["L0"], arranged["L9"]
        assert (
            isinstance(first, nn.Sequential) and isinstance(last, nn.Sequential) and isinstance(last[0], nn.Sequential)
        )
        for padding in (first[0], last[0][0]):  # the blocks' PaddingLayers
            assert isinstance(padding, PaddingLayer)
            padding.padding = (outer_padding,) * 4
        last[1] = nn.AvgPool2d(size + 2 * outer_padding)  # 4 for a 32x32 image in either layout
        return nn.Sequential(arranged)

    def get_extra_state(self) -> dict[str, str]:
        """The layout travels with the weights (it changes the function, not the parameters)."""
        return {"layout": self.layout}

    def set_extra_state(self, state: dict[str, str]) -> None:
        """Take the layout of the loaded weights, with a warning when it differs from the configured one."""
        layout = state["layout"]
        if layout not in ("paper", "three_pools"):
            raise ConfigurationError(f"the loaded weights name an unknown SpectrumCNN layout {layout!r}")
        if layout != self.layout:
            warnings.warn(
                f"SpectrumCNN: the loaded weights were trained with layout {layout!r}; using it instead of the "
                f"configured {self.layout!r}",
                HFMCAWarning,
                stacklevel=2,
            )
            self.blocks = self._arranged(
                {name: module for name, module in self.blocks.named_children() if not name.startswith("pool")}, layout
            )
            self.layout = "paper" if layout == "paper" else "three_pools"

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Weights without a layout entry (no extra state) are the three-pool network.
        key = prefix + "_extra_state"
        if key not in state_dict and any(name.startswith(prefix + "blocks.") for name in state_dict):
            state_dict[key] = {"layout": "three_pools"}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    @property
    def internal_layers(self) -> list[str]:
        """Module names of the blocks that carry internal costs: ``blocks.L1`` .. ``blocks.L9``."""
        return [f"blocks.L{index}" for index in range(1, 10)]

    def forward(self, images: Tensor) -> Tensor:
        return self.blocks(images).flatten(1)
