"""Heads of the external cost (paper §3, Alg. 1; docs/conventions.md §2)."""

from __future__ import annotations

from torch import Tensor, nn

from hfmca_lightning.errors import check_at_least
from hfmca_lightning.models.layers import NoiseChannels

__all__ = ["ViewProjector", "GridExternalHead"]


class ViewProjector(nn.Module):
    """Per-view projector: ``(N, input_dim)`` backbone features -> ``(N, output_dim)`` in (0, 1).

    Linear -> BN -> ReLU -> Linear -> BN -> sigmoid (the sigmoid output of docs/conventions.md §2; the BN keeps the
    sigmoid out of saturation).

    Args:
        input_dim: the size of the backbone features (the backbone's ``feature_dim``).
        output_dim: the size of the projected features (the external head's ``feature_dim``).
        hidden_dim: the width of the hidden layer, between the two linear layers.

    Raises:
        ConfigurationError: when ``input_dim``, ``output_dim`` or ``hidden_dim`` is not a whole number >= 1.
    """

    def __init__(self, input_dim: int = 512, output_dim: int = 128, hidden_dim: int = 512) -> None:
        super().__init__()
        for name, size in (("input_dim", input_dim), ("output_dim", output_dim), ("hidden_dim", hidden_dim)):
            check_at_least(size, 1, name, "ViewProjector")
        self.input_dim, self.output_dim = input_dim, output_dim
        self.layers = nn.Sequential(
            nn.Linear(input_dim, hidden_dim, bias=False),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, output_dim, bias=False),
            nn.BatchNorm1d(output_dim),
            nn.Sigmoid(),
        )

    def forward(self, features: Tensor) -> Tensor:
        return self.layers(features)


class GridExternalHead(nn.Module):
    """The external head LF: L view features on a ``grid_height x grid_width`` grid -> one feature.

    ``(B, L, K)`` with ``L = grid_height * grid_width`` is laid out as a ``(B, K, gh, gw)`` map, view
    ``l`` at ``(l // gw, l % gw)``; ``noise_channels`` U(0, 1) noise channels are appended; then
    1x1 conv (K -> hidden) + BN + ReLU, ``gh x gw`` conv without padding (hidden -> hidden) + BN + ReLU,
    1x1 conv (hidden -> output) + BN + sigmoid. Output ``(B, output_dim)``.

    Args:
        feature_dim: ``K``, the size of each view's feature (the projector's ``output_dim``, else the backbone's
            ``feature_dim``).
        grid_height: ``gh``, the rows of the view grid.
        grid_width: ``gw``, the columns of the view grid.
        hidden_dim: the channels of the two hidden convolutions.
        noise_channels: how many noise channels to append (the appendix LF table's NoiseChannel, 64 -> 84: 20 by
            default); 0 turns them off.
        output_dim: the size of the output feature; ``None``: ``feature_dim``.

    Raises:
        ConfigurationError: when ``feature_dim``, ``grid_height``, ``grid_width``, ``hidden_dim`` or ``output_dim`` is
            not a whole number >= 1, or ``noise_channels`` not one >= 0.
    """

    def __init__(
        self,
        feature_dim: int = 128,
        grid_height: int = 3,
        grid_width: int = 3,
        hidden_dim: int = 200,
        noise_channels: int = 20,
        output_dim: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("grid_height", grid_height), ("grid_width", grid_width)):
            check_at_least(value, 1, name, "GridExternalHead")  # the head grid: at least 1x1
        check_at_least(feature_dim, 1, "feature_dim", "GridExternalHead")
        check_at_least(hidden_dim, 1, "hidden_dim", "GridExternalHead")
        check_at_least(
            1 if output_dim is None else output_dim, 1, "output_dim", "GridExternalHead"
        )  # None: feature_dim
        check_at_least(noise_channels, 0, "noise_channels", "GridExternalHead")
        self.feature_dim = feature_dim
        self.grid = (grid_height, grid_width)
        self.output_dim = output_dim or feature_dim
        self.layers = nn.Sequential(
            NoiseChannels(noise_channels),
            nn.Conv2d(feature_dim + noise_channels, hidden_dim, 1, bias=False),
            nn.BatchNorm2d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden_dim, hidden_dim, self.grid, bias=False),
            nn.BatchNorm2d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden_dim, self.output_dim, 1, bias=False),
            nn.BatchNorm2d(self.output_dim),
            nn.Sigmoid(),
        )

    @property
    def num_views(self) -> int:
        """``L``: how many views (members) one group must have."""
        return self.grid[0] * self.grid[1]

    def forward(self, view_features: Tensor) -> Tensor:
        """``(B, L, K)`` -> ``(B, output_dim)``."""
        batch, views, features = view_features.shape
        if views != self.num_views or features != self.feature_dim:
            raise ValueError(
                f"GridExternalHead expects (B, {self.num_views}, {self.feature_dim}) view features for its "
                f"{self.grid[0]}x{self.grid[1]} grid; got {tuple(view_features.shape)}"
            )
        grid = view_features.reshape(batch, *self.grid, features).permute(0, 3, 1, 2)
        return self.layers(grid).flatten(1)
