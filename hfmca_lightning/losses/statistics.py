"""Second-moment statistics behind the HFMCA cost (paper Prop. 2; docs/conventions.md §1, §3).

Every cost compares two hierarchical levels: ``low`` members and the ``high`` feature of the group
they belong to. The cost only needs three uncentered second moments,

    R1 = mean over all members of z z^T          (K1, K1)
    R2 = mean over groups of h h^T                (K2, K2)
    P  = mean over groups of (mean_l z_l) h^T     (K1, K2)

which are kept here as *sums plus counts* so that statistics from several devices or batches combine
by addition (``CorrelationStatistics.__add__``, :func:`all_reduce_statistics`). All sums are float64,
computed outside autocast, whatever the dtype of the features; the products of feature maps are float64 too, except
in the ``fast`` and ``bf16`` precisions, which multiply in float32 or bfloat16 and sum the products in float64
(:func:`feature_map_statistics`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from hfmca_lightning.losses import block_arithmetic
from hfmca_lightning.losses.block_arithmetic import BlockArithmetic, is_channels_last
from hfmca_lightning.losses.map_statistics import (
    Bfloat16Statistics,
    CentredRowStatistics,
    ChannelsLastStatistics,
    PerImageStatistics,
    float64_statistics,
    is_per_image,
)
from hfmca_lightning.losses.window_geometry import WindowGeometry
from hfmca_lightning.losses.window_pooling import (
    WindowPooling,
    fits_avg_pool,
    pooling_for,
    window_constants,
    window_coverage,
)

__all__ = [
    "CorrelationStatistics",
    "group_statistics",
    "feature_map_statistics",
    "StatisticsPrecision",
    "STATISTICS_PRECISIONS",
    "resolved_precision",
    "WindowPooling",
    "window_coverage",
    "regularised_blocks",
    "marginal_blocks",
    "joint_matrix",
]


@dataclass(frozen=True)
class CorrelationStatistics:
    """Sufficient statistics of one cost, as float64 sums and counts.

    Statistics of disjoint sets of groups add up (``a + b``); :meth:`means` gives ``(R1, R2, P)``.

    Args:
        low_outer_sum: ``(K1, K1)`` sum over members of ``w z z^T`` (``w`` = 1 for groups, the window
            coverage for feature maps).
        high_outer_sum: ``(K2, K2)`` sum over groups of ``h h^T``.
        cross_sum: ``(K1, K2)`` sum over groups of ``(mean_l z_l) h^T``.
        member_count: ``()`` ``M * L``: for feature maps ``L = kernel**2`` (the coverage weights make R1 the mean of
            each window's member mean when a window covers fewer positions).
        group_count: ``()`` number of groups ``M``.
    """

    low_outer_sum: Tensor
    high_outer_sum: Tensor
    cross_sum: Tensor
    member_count: Tensor
    group_count: Tensor

    @property
    def low_dim(self) -> int:
        return self.low_outer_sum.shape[0]

    @property
    def high_dim(self) -> int:
        return self.high_outer_sum.shape[0]

    def means(self) -> tuple[Tensor, Tensor, Tensor]:
        """The second moments of docs/conventions.md §1: the sums divided by their counts.

        Returns:
            ``(R1 (K1, K1), R2 (K2, K2), P (K1, K2))``.
        """
        return (
            self.low_outer_sum / self.member_count,
            self.high_outer_sum / self.group_count,
            self.cross_sum / self.group_count,
        )

    def __add__(self, other: CorrelationStatistics) -> CorrelationStatistics:
        """Statistics of the union of two disjoint sets of groups."""
        if (self.low_dim, self.high_dim) != (other.low_dim, other.high_dim):
            raise ValueError(
                f"cannot add statistics of dimensions (K1={self.low_dim}, K2={self.high_dim}) and "
                f"(K1={other.low_dim}, K2={other.high_dim})"
            )
        return CorrelationStatistics(
            self.low_outer_sum + other.low_outer_sum,
            self.high_outer_sum + other.high_outer_sum,
            self.cross_sum + other.cross_sum,
            self.member_count + other.member_count,
            self.group_count + other.group_count,
        )

    def detach(self) -> CorrelationStatistics:
        """These statistics without their autograd history.

        Returns:
            The same sums and counts, detached.
        """
        return CorrelationStatistics(
            self.low_outer_sum.detach(),
            self.high_outer_sum.detach(),
            self.cross_sum.detach(),
            self.member_count.detach(),
            self.group_count.detach(),
        )


def _float64(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float64)


def _count(value: int, like: Tensor) -> Tensor:
    """``value`` as a 0-dim float64 tensor on ``like``'s device, made once per value and device: on GPUs each new one is
    a kernel launch, two per cost pair and step (nothing writes to a count; statistics add into new tensors)."""
    return _counts(float(value), like.device)


@functools.lru_cache(maxsize=1024)
def _counts(value: float, device: torch.device) -> Tensor:
    with torch.inference_mode(False):  # usable in training even if first made under inference mode
        # torch.full, not torch.tensor: a host-to-device copy of a Python number waits for the GPU's queue.
        return torch.full((), value, dtype=torch.float64, device=device)


def group_statistics(low: Tensor, high: Tensor) -> CorrelationStatistics:
    """Statistics of groups of ``L`` members (the external cost, paper Alg. 1).

    Sums ``z z^T`` over all ``M * L`` members, ``h h^T`` over the ``M`` groups and ``(mean_l z_l) h^T`` over the
    groups, in float64 outside autocast, whatever the dtype of the features.

    Args:
        low: ``(M, L, K1)`` the L member features of each of M groups.
        high: ``(M, K2)`` one feature per group.

    Returns:
        The statistics, with ``member_count = M * L`` and ``group_count = M``; differentiable.

    Raises:
        ValueError: when ``low`` is not ``(M, L, K1)`` or ``high`` not ``(M, K2)`` with the same ``M``, or there are
            no groups or no members.

    Example::

        stats = group_statistics(torch.randn(64, 9, 32), torch.randn(64, 16))
        r1, r2, p = stats.means()  # (32, 32), (16, 16), (32, 16)
    """
    if low.dim() != 3:
        raise ValueError(
            f"`low` must have shape (M, L, K1) = (groups, members per group, features); got shape "
            f"{tuple(low.shape)}. For a single member per group use low.unsqueeze(1)."
        )
    if high.dim() != 2:
        raise ValueError(f"`high` must have shape (M, K2) = (groups, features); got shape {tuple(high.shape)}")
    if low.shape[0] != high.shape[0]:
        raise ValueError(
            f"`low` and `high` must describe the same groups: low has M={low.shape[0]} groups "
            f"(shape {tuple(low.shape)}), high has M={high.shape[0]} (shape {tuple(high.shape)})"
        )
    if low.shape[0] == 0 or low.shape[1] == 0:
        raise ValueError(f"need at least one group with one member; got low of shape {tuple(low.shape)}")
    with torch.autocast(device_type=low.device.type, enabled=False):
        z = _float64(low)
        h = _float64(high)
        members = z.reshape(-1, z.shape[-1])
        return CorrelationStatistics(
            low_outer_sum=members.T @ members,
            high_outer_sum=h.T @ h,
            cross_sum=z.mean(dim=1).T @ h,
            member_count=_count(members.shape[0], z),
            group_count=_count(h.shape[0], z),
        )


StatisticsPrecision = Literal["auto", "fast", "tf32x3", "bf16", "float64"]


STATISTICS_PRECISIONS = ("auto", "fast", "tf32x3", "bf16", "float64")


def resolved_precision(low_map: Tensor, high_map: Tensor, geometry: WindowGeometry) -> StatisticsPrecision:
    """What ``precision="auto"`` runs for these maps: ``bf16`` for bfloat16 maps (bf16-mixed training) on GPUs with
    bf16 tensor cores (compute capability 8.0 and later), when each position's product is no larger than the map
    (``K <= B``) and the window fits ``avg_pool2d``; ``fast`` otherwise (float32 maps, CPUs, older GPUs: the roofline
    predicts ``tf32x3`` slower than ``fast`` on every GPU it models, its splits being passes over the maps;
    docs/benchmarks/roofline.md)."""
    bfloat16 = low_map.dtype == torch.bfloat16 and high_map.dtype == torch.bfloat16
    small = max(low_map.shape[1], high_map.shape[1]) <= low_map.shape[0]
    if bfloat16 and small and fits_avg_pool(geometry) and block_arithmetic.tensor_cores(low_map.device):
        return "bf16"
    return "fast"


def feature_map_statistics(
    low_map: Tensor,
    high_map: Tensor,
    geometry: WindowGeometry,
    precision: StatisticsPrecision = "fast",
    window_pooling: WindowPooling | None = None,
) -> CorrelationStatistics:
    """Statistics between a block's input map and output map (internal cost, paper Alg. 2, docs/conventions.md §3).

    Every output position ``q`` is a group whose members are the input positions its window covers: the
    ``kernel**2`` positions of the window, less those that lie in the padding (docs/conventions.md §3). Equal to
    :func:`group_statistics` on the unfolded windows where no window reaches the padding, but computed without
    unfolding: window means by average pooling over the covered positions, R1 as a :func:`window_coverage`-weighted
    sum over input positions (each window's member mean, averaged over windows).

    ``precision="fast"`` (training): float32 arithmetic (TF32 off on CUDA), float64 sums. ``"tf32x3"``: the same, with
    each float32 product as three TF32 products of split factors on CUDA's tensor cores (exact float32 elsewhere),
    within the fast path's stated tolerance (docs/conventions.md §3; a single TF32 product is not).
    Window means are banded matrix products on CPUs and ``avg_pool2d`` on GPUs (``window_pooling`` overrides: equal
    up to float32 rounding, tested). Blocks whose outputs have at least as many positions per
    image as channels (the costly early layers) are multiplied one image at a time in their own ``(B, K, H*W)``
    layout, in chunks on CPUs, and the per-image products summed in float64 (:class:`PerImageStatistics`),
    or, for channels-last maps, on their ``(B*H*W, K)`` rows as they lie (:class:`ChannelsLastStatistics`);
    small deep-layer maps of either layout are multiplied over all rows at once after subtracting their means
    (:class:`CentredRowStatistics`). Each path is one autograd node with its own backward pass.
    ``"bf16"``: bfloat16 maps (float32 maps are rounded to bfloat16 first) on bf16 tensor cores, every product exact
    and accumulated in float32 per position, window means in two bfloat16 parts, gradients in bfloat16
    (:class:`Bfloat16Statistics`; its own stated tolerance, docs/conventions.md §3). ``"auto"``: ``bf16`` or ``fast``
    by the device and the maps (:func:`resolved_precision`).
    ``"float64"``: every step in float64 with average pooling (analysis, and the reference the fast path is
    tested against: costs agree to 1e-5 and gradients to 5e-5, relative, docs/conventions.md §3).

    Args:
        low_map: ``(B, K1, H, W)`` block input ``Z_s``.
        high_map: ``(B, K2, H', W')`` block output ``Z_{s+1}``.
        geometry: the block's window ``(kernel, stride, padding)``.
        precision: ``auto``, ``fast``, ``tf32x3``, ``bf16`` or ``float64``.
        window_pooling: ``banded`` or ``avg_pool`` for ``fast`` and ``tf32x3``; default by the maps' device
            (``bf16`` and ``float64`` always take ``avg_pool2d``).

    Returns:
        The statistics of the ``B * H' * W'`` groups, with ``member_count = B * H' * W' * kernel**2``;
        differentiable.

    Raises:
        ValueError: when the maps are not ``(B, K, H, W)`` of the same batch, are empty, ``geometry`` does not map
            the input's ``(H, W)`` to the output's ``(H', W')``, or ``precision`` / ``window_pooling`` is unknown.

    Example::

        block = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        low_map = torch.randn(8, 16, 32, 32)
        stats = feature_map_statistics(low_map, block(low_map), window_geometry(block))
        cost = cost_from_statistics(stats, reg=0.1)
    """
    if low_map.dim() != 4 or high_map.dim() != 4:
        raise ValueError(
            "feature maps must have shape (B, K, H, W); got low_map "
            f"{tuple(low_map.shape)} and high_map {tuple(high_map.shape)}"
        )
    if low_map.shape[0] != high_map.shape[0]:
        raise ValueError(
            f"feature maps must come from the same batch: low_map has B={low_map.shape[0]}, "
            f"high_map has B={high_map.shape[0]}"
        )
    if low_map.shape[0] == 0 or low_map[0].numel() == 0 or high_map[0].numel() == 0:
        raise ValueError(
            f"need at least one map with channels and positions; got low_map {tuple(low_map.shape)} and "
            f"high_map {tuple(high_map.shape)}"
        )
    expected = geometry.output_size(low_map.shape[-2:])
    if expected != tuple(high_map.shape[-2:]):
        raise ValueError(
            f"window geometry {geometry} maps a {tuple(low_map.shape[-2:])} input to {expected} "
            f"positions, but the block output is {tuple(high_map.shape[-2:])}: the geometry does not "
            "describe this block (pass the right geometry or check the hooked modules)"
        )
    if precision not in STATISTICS_PRECISIONS:
        raise ValueError(f"precision must be one of {STATISTICS_PRECISIONS}; got {precision!r}")
    if window_pooling not in (None, "banded", "avg_pool"):
        raise ValueError(f"window_pooling must be 'banded', 'avg_pool' or None; got {window_pooling!r}")
    if precision == "auto":
        precision = resolved_precision(low_map, high_map, geometry)
    if precision == "bf16" and not fits_avg_pool(geometry):
        raise ValueError(
            f"precision 'bf16' takes window means by avg_pool2d, which needs 2 * padding <= kernel; the window "
            f"{geometry} does not: use precision 'fast' or 'auto' for this block"
        )
    coverage, coverage32, rows, columns = window_constants(
        tuple(low_map.shape[-2:]), tuple(high_map.shape[-2:]), geometry, low_map.device
    )
    groups = high_map.shape[0] * high_map.shape[2] * high_map.shape[3]
    counts = _count(groups * geometry.kernel**2, low_map), _count(groups, low_map)
    with torch.autocast(device_type=low_map.device.type, enabled=False):
        if precision == "float64":
            return CorrelationStatistics(
                *float64_statistics(_float64(low_map), _float64(high_map), coverage, geometry), *counts
            )
        if precision == "bf16":
            z_map, h_map = low_map.to(torch.bfloat16), high_map.to(torch.bfloat16)
            low_sum, high_sum, cross_sum = Bfloat16Statistics.apply(z_map, h_map, coverage32, geometry)
            return CorrelationStatistics(low_sum, high_sum, cross_sum, *counts)
        z_map, h_map = low_map.to(torch.float32), high_map.to(torch.float32)
        statistics: type[torch.autograd.Function]
        if not is_per_image(h_map):
            statistics = CentredRowStatistics  # copies maps of any layout into its rows
        elif is_channels_last(z_map):  # HFMCAModule(channels_last=True): products on the maps' rows as they lie
            statistics, h_map = ChannelsLastStatistics, h_map.contiguous(memory_format=torch.channels_last)
        else:
            statistics, z_map, h_map = PerImageStatistics, z_map.contiguous(), h_map.contiguous()
        windows = BlockArithmetic(
            geometry,
            rows,
            columns,
            window_pooling or pooling_for(z_map.device, geometry),
            split=precision == "tf32x3" and block_arithmetic.tensor_cores(z_map.device),
        )
        with windows.products(z_map.device):  # the forward passes; each backward pass sets it itself
            low_sum, high_sum, cross_sum = statistics.apply(z_map, h_map, coverage32, windows)
        return CorrelationStatistics(low_sum, high_sum, cross_sum, *counts)


def marginal_blocks(stats: CorrelationStatistics, reg: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(A, C, P)`` of docs/conventions.md §1: ``A = R1 + reg I``, ``C = R2 + reg I`` and ``P``, each from its sum
    in one pass."""
    a = stats.low_outer_sum / stats.member_count
    a.diagonal().add_(reg)
    c = stats.high_outer_sum / stats.group_count
    c.diagonal().add_(reg)
    return a, c, stats.cross_sum / stats.group_count


def joint_matrix(a: Tensor, c: Tensor, cross: Tensor) -> Tensor:
    """``J = [[A, P], [P^T, C]]``."""
    return torch.cat([torch.cat([a, cross], dim=1), torch.cat([cross.T, c], dim=1)], dim=0)


def regularised_blocks(stats: CorrelationStatistics, reg: float) -> tuple[Tensor, Tensor, Tensor]:
    """The regularised matrices of docs/conventions.md §1: ``A = R1 + reg I``, ``C = R2 + reg I`` and the joint
    ``J = [[A, P], [P^T, C]]``.

    Args:
        stats: the statistics of one cost.
        reg: added to the diagonals of ``A`` and ``C``.

    Returns:
        ``(A (K1, K1), C (K2, K2), J (K1 + K2, K1 + K2))``.
    """
    a, c, cross = marginal_blocks(stats, reg)
    return a, c, joint_matrix(a, c, cross)
