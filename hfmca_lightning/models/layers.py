"""Small reusable layers of HFMCA networks (paper appendix tables)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hfmca_lightning.errors import check_at_least
from hfmca_lightning.losses.window_geometry import WindowGeometry

__all__ = ["NoiseChannels", "PaddingLayer"]


class PaddingLayer(nn.ZeroPad2d):
    """Zero padding at the start of a block (paper appendix "Padding Layer").

    The internal cost's windows are read through it (:func:`~hfmca_lightning.losses.window_geometry`: ``(1, 1,
    padding)``); the padded positions are no members of them, only the input map's positions are
    (docs/conventions.md §3).

    Args:
        padding: the zero rows and columns added on each side of the map; 0 leaves it as it is.

    Raises:
        ConfigurationError: when ``padding`` is not a whole number >= 0.
    """

    def __init__(self, padding: int = 1) -> None:
        check_at_least(padding, 0, "padding")
        super().__init__(padding)


class NoiseChannels(nn.Module):
    """Concatenate ``num_channels`` channels of U(0, 1) noise to a ``(B, C, H, W)`` map (paper appendix).

    The paper adds such channels at the start of every block; it "significantly stabilizes the learning dynamics
    of eigenvalues". Noise is drawn in train and eval mode alike (it is part of the function the block computes).
    Pointwise, so its window geometry is the identity. Output ``(B, C + num_channels, H, W)``.

    Args:
        num_channels: how many noise channels to append: the paper's 20 by default; 0 returns the input as it is.

    Raises:
        ConfigurationError: when ``num_channels`` is not a whole number >= 0.
    """

    window_geometry = WindowGeometry.identity()

    def __init__(self, num_channels: int = 20) -> None:
        super().__init__()
        check_at_least(num_channels, 0, "num_channels")
        self.num_channels = num_channels

    def extra_repr(self) -> str:
        return f"num_channels={self.num_channels}"

    def forward(self, x: Tensor) -> Tensor:
        if self.num_channels == 0:
            return x
        noise = torch.rand(x.shape[0], self.num_channels, *x.shape[2:], dtype=x.dtype, device=x.device)
        return torch.cat([x, noise], dim=1)
