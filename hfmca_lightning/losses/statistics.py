"""Second-moment statistics behind the HFMCA cost (paper Prop. 2; docs/conventions.md §1, §3).

Every cost compares two hierarchical levels: ``low`` members and the ``high`` feature of the group
they belong to. The cost only needs three uncentered second moments,

    R1 = mean over all members of z z^T          (K1, K1)
    R2 = mean over groups of h h^T                (K2, K2)
    P  = mean over groups of (mean_l z_l) h^T     (K1, K2)

which are kept here as *sums plus counts* so that statistics from several devices or batches combine
by addition (``CorrelationStatistics.__add__``, :func:`all_reduce_statistics`). All sums are float64,
computed outside autocast, whatever the dtype of the features.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from hfmca_lightning.losses.window_geometry import WindowGeometry

__all__ = [
    "CorrelationStatistics",
    "group_statistics",
    "feature_map_statistics",
    "StatisticsPrecision",
    "STATISTICS_PRECISIONS",
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
    # torch.full, not torch.tensor: a host-to-device copy of a Python number waits for the GPU's queue.
    return torch.full((), float(value), dtype=torch.float64, device=like.device)


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


def window_coverage(
    input_size: tuple[int, int],
    output_size: tuple[int, int],
    geometry: WindowGeometry,
    device: torch.device | None = None,
) -> Tensor:
    """The weight of each input position in R1: ``kernel**2 * sum_q 1 / |W_q|`` over the output windows ``W_q``
    that contain it.

    Windows have the block's ``geometry``; their members are the positions of the input map they cover
    (``|W_q|`` of them: ``kernel**2`` inside, fewer where the window reaches over the border, whose padding
    positions are no members; docs/conventions.md §3). With ``kernel**2`` members counted per group, R1 is then the
    mean over groups of each window's own member mean of ``z z^T``. Without padding the weight is the number of
    windows that contain the position.

    Args:
        input_size: ``(H, W)`` of the block's input map.
        output_size: ``(H', W')`` of the block's output map.
        geometry: the block's window ``(kernel, stride, padding)``.
        device: where the map is made (default: the CPU).

    Returns:
        ``(H, W)`` float64 map of weights.

    Raises:
        ValueError: when ``geometry`` does not map ``input_size`` to ``output_size``.
    """
    k = geometry.kernel
    height, width = input_size
    rows = _real_members(height, geometry, device)
    columns = _real_members(width, geometry, device)
    if (rows.shape[0], columns.shape[0]) != tuple(output_size):
        raise ValueError(
            f"window geometry {geometry} maps a {tuple(input_size)} input to "
            f"{(rows.shape[0], columns.shape[0])} positions, not {tuple(output_size)}"
        )
    inverse_sizes = 1.0 / (rows.sum(dim=1)[:, None] * columns.sum(dim=1)[None, :])  # (H', W'): 1 / |W_q|
    return k * k * (rows.T @ inverse_sizes @ columns)


def _real_members(size: int, geometry: WindowGeometry, device: torch.device | None) -> Tensor:
    """``(out, size)`` float64 0/1 matrix: which input positions ``i`` output position ``o`` 's window covers
    (``o * stride - padding <= i < o * stride - padding + kernel``); padding positions are none."""
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    out = (size + 2 * p - k) // s + 1
    start = torch.arange(out, device=device)[:, None] * s - p
    position = torch.arange(size, device=device)[None, :]
    return ((position >= start) & (position < start + k)).to(torch.float64)


StatisticsPrecision = Literal["fast", "tf32x3", "float64"]
STATISTICS_PRECISIONS = ("fast", "tf32x3", "float64")
WindowPooling = Literal["banded", "avg_pool"]


@dataclass(frozen=True, eq=False)
class _Windows:
    """How a block's float32 arithmetic runs: its window means (:meth:`means`, the adjoint :meth:`means_adjoint`, the
    same on the rows of channels-last maps) and its matrix products (:meth:`mm`, :meth:`add_mm_`). A constant of one
    statistics call, kept by its autograd node for the backward pass.

    ``pooling``: ``banded`` (products with the band matrices ``rows (H', H)`` and ``columns (W', W)`` of
    :func:`_window_band`; on CPUs several times faster than pooling) or ``avg_pool`` (``avg_pool2d`` over the covered
    positions and its backward: no arithmetic on the zeros of the bands, the faster on GPUs). ``split``: every float32
    product as three TF32 tensor-core products of split factors, ``x = hi + lo`` with ``hi`` rounded to TF32,
    ``x y = hi_x hi_y + hi_x lo_y + lo_x hi_y`` (float32 accumulation): each product within ``5 * 2^-22`` of its
    factors' magnitudes, against ``2^-24`` exact and ``2^-10`` for a single TF32 product (docs/conventions.md §3).
    Without ``split``, float32 products are exact (TF32 off).
    """

    geometry: WindowGeometry
    rows: Tensor
    columns: Tensor
    pooling: WindowPooling
    split: bool = False

    def products(self, device: torch.device) -> AbstractContextManager[None]:
        return _float32_products(device, tf32=self.split)

    def mm(self, a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
        """``torch.matmul(a, b)`` (into ``out``)."""
        if not self.split:
            return torch.matmul(a, b, out=out)
        (a_hi, a_lo), (b_hi, b_lo) = self._split(a), self._split(b)
        result = torch.matmul(a_hi, b_hi, out=out)
        return self._add(self._add(result, a_hi, b_lo), a_lo, b_hi)

    def add_mm_(self, accumulator: Tensor, a: Tensor, b: Tensor) -> Tensor:
        """``accumulator += a @ b`` in place (2-D, or 3-D batches of equal size)."""
        if not self.split:
            return self._add(accumulator, a, b)
        (a_hi, a_lo), (b_hi, b_lo) = self._split(a), self._split(b)
        return self._add(self._add(self._add(accumulator, a_hi, b_hi), a_hi, b_lo), a_lo, b_hi)

    @staticmethod
    def _split(x: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`_split_tf32`, of one matrix only where ``x`` repeats it over a batch (``expand``), so that a matrix
        shared by all images is split once, not copied per image."""
        if x.dim() == 3 and x.stride(0) == 0:
            hi, lo = _split_tf32(x[0])
            return hi.expand_as(x), lo.expand_as(x)
        return _split_tf32(x)

    @staticmethod
    def _add(accumulator: Tensor, a: Tensor, b: Tensor) -> Tensor:
        if accumulator.dim() == 3 and a.dim() == 3 and b.dim() == 3:
            return accumulator.baddbmm_(a, b)
        if accumulator.dim() == 2 and a.dim() == 2 and b.dim() == 2:
            return accumulator.addmm_(a, b)
        if accumulator.dim() == 1 and a.dim() == 2 and b.dim() == 1:
            return accumulator.addmv_(a, b)
        return accumulator.add_(torch.matmul(a, b))

    def means(self, z_map: Tensor, out: Tensor | None = None) -> Tensor:
        """``(..., H', W')`` window means of ``(..., H, W)`` maps (4-D for ``avg_pool``)."""
        if self.pooling == "banded":
            return _window_means(z_map, self.rows, self.columns, self, out)
        k, s, p = self.geometry.kernel, self.geometry.stride, self.geometry.padding
        pooled = F.avg_pool2d(z_map, k, s, p, count_include_pad=False)
        return pooled if out is None else out.copy_(pooled)

    def means_adjoint(self, d_means: Tensor, input_size: tuple[int, int], out: Tensor | None = None) -> Tensor:
        """The adjoint of :meth:`means`: ``(..., H', W')`` -> ``(..., H, W)``."""
        if self.pooling == "banded":
            return _window_means(d_means, self.rows.T, self.columns.T, self, out)
        k, s, p = self.geometry.kernel, self.geometry.stride, self.geometry.padding
        shape = (*d_means.shape[:-2], *input_size)
        like = torch.empty(shape, dtype=d_means.dtype, device=d_means.device).contiguous(
            memory_format=torch.channels_last if _channels_last(d_means) else torch.contiguous_format
        )
        adjoint = torch.ops.aten.avg_pool2d_backward(d_means, like, [k, k], [s, s], [p, p], False, False, None)
        return adjoint if out is None else out.copy_(adjoint)

    def pooled_rows(
        self, rows_: Tensor, images: int, size: tuple[int, int], out: Tensor | None = None, adjoint: bool = False
    ) -> Tensor:
        """:meth:`means` (or, with ``adjoint``, :meth:`means_adjoint`) of channels-last maps given as
        ``(images * H * W, K)`` rows: ``(images * H' * W', K)`` (``size`` is ``(H, W)`` of the rows given)."""
        if self.pooling == "banded":
            rows, columns = (self.rows.T, self.columns.T) if adjoint else (self.rows, self.columns)
            return _pooled_rows(rows_, rows, columns, images, size, self, out)
        channels = rows_.shape[1]
        maps = rows_.view(images, *size, channels).permute(0, 3, 1, 2)  # channels-last (B, K, H, W), no copy
        if adjoint:
            pooled = self.means_adjoint(maps, (self.rows.shape[1], self.columns.shape[1]))
        else:
            pooled = self.means(maps)
        flat = pooled.permute(0, 2, 3, 1).reshape(-1, channels)
        return flat if out is None else out.copy_(flat)


def _split_tf32(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)`` with ``hi`` = ``x`` (float32) rounded to TF32's 10-bit mantissa (to nearest, ties to even) and
    ``lo = x - hi`` (exact: at most 13 significant bits); a TF32 product then rounds ``lo`` by at most ``2^-21 |x|``."""
    bits = x.view(torch.int32)
    hi = ((bits + 0x0FFF + ((bits >> 13) & 1)) & -0x2000).view(torch.float32)
    return hi, x - hi


def _tensor_cores(device: torch.device) -> bool:
    """Whether float32 products on ``device`` may run on TF32 tensor cores (CUDA GPUs of compute capability 8.0 and
    later; the split needs them to pay, and is three exact products anywhere else)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def _pooling_for(device: torch.device, geometry: WindowGeometry) -> WindowPooling:
    """``avg_pool`` on GPUs (where ``avg_pool2d`` takes the padding as given), ``banded`` on CPUs."""
    fits = 2 * geometry.padding <= geometry.kernel
    return "avg_pool" if device.type == "cuda" and fits else "banded"


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
    layout, in chunks on CPUs, and the per-image products summed in float64 (:class:`_PerImageStatistics`),
    or, for channels-last maps, on their ``(B*H*W, K)`` rows as they lie (:class:`_ChannelsLastStatistics`);
    small deep-layer maps of either layout are multiplied over all rows at once after subtracting their means
    (:class:`_CentredRowStatistics`). Each path is one autograd node with its own backward pass.
    ``"float64"``: every step in float64 with average pooling (analysis, and the reference the fast path is
    tested against: costs agree to 1e-5 and gradients to 5e-5, relative, docs/conventions.md §3).

    Args:
        low_map: ``(B, K1, H, W)`` block input ``Z_s``.
        high_map: ``(B, K2, H', W')`` block output ``Z_{s+1}``.
        geometry: the block's window ``(kernel, stride, padding)``.
        precision: ``fast``, ``tf32x3`` or ``float64``.
        window_pooling: ``banded`` or ``avg_pool``; default by the maps' device.

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
    coverage, coverage32, rows, columns = _window_constants(
        tuple(low_map.shape[-2:]), tuple(high_map.shape[-2:]), geometry, low_map.device
    )
    groups = high_map.shape[0] * high_map.shape[2] * high_map.shape[3]
    counts = _count(groups * geometry.kernel**2, low_map), _count(groups, low_map)
    with torch.autocast(device_type=low_map.device.type, enabled=False):
        if precision == "float64":
            return CorrelationStatistics(
                *_float64_statistics(_float64(low_map), _float64(high_map), coverage, geometry), *counts
            )
        z_map, h_map = low_map.to(torch.float32), high_map.to(torch.float32)
        statistics: type[torch.autograd.Function]
        if not _per_image(h_map):
            statistics = _CentredRowStatistics  # copies maps of any layout into its rows
        elif _channels_last(z_map):  # HFMCAModule(channels_last=True): products on the maps' rows as they lie
            statistics, h_map = _ChannelsLastStatistics, h_map.contiguous(memory_format=torch.channels_last)
        else:
            statistics, z_map, h_map = _PerImageStatistics, z_map.contiguous(), h_map.contiguous()
        windows = _Windows(
            geometry,
            rows,
            columns,
            window_pooling or _pooling_for(z_map.device, geometry),
            split=precision == "tf32x3" and _tensor_cores(z_map.device),
        )
        with windows.products(z_map.device):  # the forward passes; each backward pass sets it itself
            low_sum, high_sum, cross_sum = statistics.apply(z_map, h_map, coverage32, windows)
        return CorrelationStatistics(low_sum, high_sum, cross_sum, *counts)


def _float64_statistics(
    z_map: Tensor, h_map: Tensor, coverage: Tensor, geometry: WindowGeometry
) -> tuple[Tensor, Tensor, Tensor]:
    """The three sums in float64 by the definitions, with sum pooling over the zero-padded map divided by each window's
    number of covered positions, and plain autograd (the reference)."""
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    sums = F.avg_pool2d(F.pad(z_map, (p, p, p, p)), k, s, divisor_override=1)
    covered = F.avg_pool2d(F.pad(torch.ones_like(z_map[:1, :1]), (p, p, p, p)), k, s, divisor_override=1)
    means = (sums / covered).flatten(2)
    z, h = z_map.flatten(2), h_map.flatten(2)

    def summed(left: Tensor, right: Tensor) -> Tensor:
        return torch.bmm(left, right.transpose(1, 2)).sum(dim=0)

    return summed(z * coverage.flatten(), z), summed(h, h), summed(means, h)


def _window_means(z_map: Tensor, rows: Tensor, columns: Tensor, windows: _Windows, out: Tensor | None = None) -> Tensor:
    """``(..., H', W')``: the mean of every window over the positions it covers, ``R_H Z R_W^T`` with the banded
    ``(H', H)`` / ``(W', W)`` matrices of :func:`_window_band`: the numbers of average pooling as matrix
    products (on CPUs several times faster than ``avg_pool2d``). Two products per image for large maps; for
    maps of at most 64 positions one product with the Kronecker matrix ``R_H (x) R_W`` over all images
    (instead of thousands of tiny ones)."""
    if max(rows.shape) * max(columns.shape) <= 64:
        pooled = windows.mm(z_map.flatten(-2), torch.kron(rows, columns).T)
        pooled = pooled.view(*z_map.shape[:-2], rows.shape[0], columns.shape[0])
        return pooled if out is None else out.copy_(pooled)
    return windows.mm(windows.mm(rows, z_map), columns.T, out=out)


def _pooled_rows(
    rows_: Tensor,
    rows: Tensor,
    columns: Tensor,
    images: int,
    size: tuple[int, int],
    windows: _Windows,
    out: Tensor | None = None,
) -> Tensor:
    """:func:`_window_means` of channels-last maps given as ``(images * H * W, K)`` rows: ``(images * H' * W', K)``,
    one product along the height with ``(W * K)``-long rows, one along the width with ``K``-long rows."""
    (height, width), channels = size, rows_.shape[1]
    along_height = windows.mm(rows, rows_.view(images, height, width * channels))  # (images, H', W * K)
    along_height = along_height.view(images * rows.shape[0], width, channels)
    if out is not None:
        out = out.view(images * rows.shape[0], columns.shape[0], channels)
    return windows.mm(columns, along_height, out=out).view(-1, channels)


def _row_block_product(left: Tensor, right: Tensor, image_rows: int, windows: _Windows) -> Tensor:
    """``left^T right`` (float64) of ``(R, K)`` rows of whole images (``image_rows`` each): a float32 product per
    block of whole images of about 1,024 rows (the per-image products' precision), summed in float64."""
    block = image_rows * max(1, 1024 // image_rows)
    whole = left.shape[0] // block * block
    total = left.new_zeros(left.shape[1], right.shape[1], dtype=torch.float64)
    if whole:
        blocks = windows.mm(
            left[:whole].view(-1, block, left.shape[1]).transpose(1, 2), right[:whole].view(-1, block, right.shape[1])
        )
        total += blocks.sum(dim=0, dtype=torch.float64)
    if whole < left.shape[0]:
        total += windows.mm(left[whole:].T, right[whole:]).to(torch.float64)
    return total


@functools.lru_cache(maxsize=128)
def _window_constants(
    input_size: tuple[int, int], output_size: tuple[int, int], geometry: WindowGeometry, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A block's constants, made once per shape and device (on GPUs each is a few kernel launches per step,
    and the internal step is launch-bound there): float64 coverage ``(H, W)``, float32 coverage ``(H*W,)``,
    and the float32 band matrices of :func:`_window_band` for rows and columns. Never written to."""
    with torch.inference_mode(False):  # usable in training even if first made under inference mode
        like = torch.empty(0, dtype=torch.float32, device=device)
        coverage = window_coverage(input_size, output_size, geometry, device=device)
        return (
            coverage,
            coverage.to(torch.float32).flatten(),
            _window_band(input_size[0], geometry, like),
            _window_band(input_size[1], geometry, like),
        )


def _window_band(size: int, geometry: WindowGeometry, like: Tensor) -> Tensor:
    """``(out, size)`` matrix with ``1 / n_o`` where output position ``o`` 's window covers input position ``i``,
    ``n_o`` the number of input positions it covers (``kernel`` inside, fewer at a padded border), zero elsewhere: the
    window means' row (or column) factor, since ``|W_q| = n_row * n_column``."""
    members = _real_members(size, geometry, like.device)
    return (members / members.sum(dim=1, keepdim=True)).to(like.dtype)


def _per_image(h_map: Tensor) -> bool:
    """Whether a block's statistics are cheaper one image at a time than over centred rows: when each image's
    output map ``(K2, H', W')`` has at least as many positions as channels (the early layers; the measured split
    is in docs/benchmarks/cpu.md)."""
    return h_map.shape[2] * h_map.shape[3] >= h_map.shape[1]


_CPU_CHUNK_BYTES = 32 << 20


def _image_chunks(batch: int, map_: Tensor) -> list[slice]:
    """Slices of the batch for image-by-image work on ``map_``: the whole batch on GPUs; on CPUs chunks of about
    32 MiB, which bound the temporaries (weighted maps, half-pooled maps) of large batches (smaller chunks were
    slower: docs/benchmarks/cpu.md)."""
    if map_.device.type != "cpu":
        return [slice(0, batch)]
    per_image = max(1, map_[0].numel() * map_.element_size())
    step = max(1, _CPU_CHUNK_BYTES // per_image)
    return [slice(start, min(start + step, batch)) for start in range(0, batch, step)]


def _weighted(rows_: Tensor, coverage: Tensor, out: Tensor | None = None) -> Tensor:
    """``(..., N)`` rows times the ``(N,)`` coverage (into ``out``, of the same shape, if given), multiplied as one
    ``(-1, N)`` matrix of contiguous rows (a broadcast over a 3-D tensor runs half as fast on CPUs)."""
    size = coverage.shape[0]
    product = torch.mul(rows_.reshape(-1, size), coverage, out=None if out is None else out.view(-1, size))
    return product.view(rows_.shape)


def _symmetric_product(left: Tensor, right: Tensor, windows: _Windows) -> Tensor:
    """``left @ right^T`` (float64, summed over a leading batch dimension if any) for a symmetric result
    (``left = right diag(w)``), made exactly symmetric, as one product (products of half the rows save a quarter
    of the arithmetic but run slower at these shapes)."""
    product = windows.mm(left, right.transpose(-1, -2))
    product = product.sum(dim=0, dtype=torch.float64) if product.dim() == 3 else product.to(torch.float64)
    return (product + product.T) / 2


def _per_image_products(
    z_map: Tensor, h_map: Tensor, coverage: Tensor, windows: _Windows
) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor, Tensor, Tensor]:
    """The three sums as one float32 product per image in the maps' own ``(B, K, N)`` layout, summed in float64
    over chunks of images (:func:`_image_chunks`); the window means ``(B, K1, H', W')`` shifted by ``mu``,
    ``mu (K1,)`` (the first image's mean window mean per channel, :func:`_shifted_cross`) and the weighted
    maps ``Z diag(w)`` ``(B, K1, N)``."""
    batch, low_dim, high_dim = z_map.shape[0], z_map.shape[1], h_map.shape[1]
    means, weighted = z_map.new_empty(batch, low_dim, *h_map.shape[-2:]), torch.empty_like(z_map).flatten(2)
    sums = [
        z_map.new_zeros(size, dtype=torch.float64)
        for size in ((low_dim, low_dim), (high_dim, high_dim), (low_dim, high_dim))
    ]
    shift, high_sum = None, z_map.new_zeros(high_dim, dtype=torch.float64)
    for chunk in _image_chunks(batch, z_map):
        z, h = z_map[chunk].flatten(2), h_map[chunk].flatten(2)
        chunk_means = windows.means(z_map[chunk], out=means[chunk]).flatten(2)
        shift = chunk_means[0].mean(dim=1) if shift is None else shift
        chunk_means.sub_(shift[:, None])
        _weighted(z, coverage, out=weighted[chunk])
        sums[0] += _symmetric_product(weighted[chunk], z, windows)
        sums[1] += _symmetric_product(h, h, windows)
        sums[2] += windows.mm(chunk_means, h.transpose(1, 2)).sum(dim=0, dtype=torch.float64)
        high_sum += h.sum(dim=2).to(torch.float64).sum(dim=0)
    assert shift is not None
    return (sums[0], sums[1], _shifted_cross(sums[2], shift, high_sum)), means, shift, weighted


def _shifted_cross(product: Tensor, shift: Tensor, high_sum: Tensor) -> Tensor:
    """``sum M H^T = sum (M - mu 1^T) H^T + mu (sum H 1)^T``: the cross sum from the product of window means shifted
    by a constant ``mu`` (float32) and the float64 mean term. Window means of post-ReLU maps share a large
    common part; taking it out before the float32 product keeps about 10x more of the digits the gradients
    need."""
    return product + torch.outer(shift.to(torch.float64), high_sum)


def _centred_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(K, B, N)`` rows of a ``(B, K, H, W)`` map shifted by their means, and the means in float64: one
    transposing copy (of the ``(B * N, K)`` matrix for channels-last maps, faster than the general copy), then
    contiguous reductions and an in-place shift."""
    batch, channels = x.shape[:2]
    if _channels_last(x):
        rows = x.permute(0, 2, 3, 1).reshape(-1, channels).t().contiguous().view(channels, batch, -1)
    else:
        rows = x.new_empty(channels, batch, x.shape[2] * x.shape[3]).copy_(
            x.flatten(2).transpose(0, 1)
        )  # always a copy
    mean = rows.mean(dim=(1, 2))
    return rows.sub_(mean[:, None, None]), mean.to(torch.float64)


def _shifted(
    product: Tensor, left_sum: Tensor, left_mean: Tensor, right_sum: Tensor, right_mean: Tensor, total: Tensor | float
) -> Tensor:
    """``sum w l r^T`` from the product of shifted rows ``sum w c d^T`` and the mean terms,
    ``+ (sum w c) nu^T + mu (sum w d)^T + (sum w) mu nu^T``, as one rank-2 update in float64."""
    left = torch.stack([left_sum + total * left_mean, left_mean], dim=1)
    right = torch.stack([right_mean, right_sum], dim=1)
    return torch.addmm(product, left, right.T)


def _gradient_matrices(
    grads: Sequence[Tensor | None], dims: tuple[int, int], like: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(G1 + G1^T, G2 + G2^T, G3)`` in the maps' dtype from the gradients of the three sums (zeros for None)."""
    k1, k2 = dims
    sizes, matrices = ((k1, k1), (k2, k2), (k1, k2)), []
    for grad, size, symmetric in zip(grads, sizes, (True, True, False)):
        if grad is None:
            matrices.append(like.new_zeros(size))
        else:
            matrices.append((grad + grad.T if symmetric else grad).to(like.dtype))
    return matrices[0], matrices[1], matrices[2]


class _PerImageStatistics(torch.autograd.Function):
    """``(sum_b Z_b diag(w) Z_b^T, sum_b H_b H_b^T, sum_b M_b H_b^T)`` (float64) of a block's float32 input maps
    ``Z``, output maps ``H`` and window means ``M = R_H Z R_W^T``, for early layers (:func:`_per_image`).

    Forward (:func:`_per_image_products`): one product per image in the maps' own layout, summed in float64,
    the cross sum's from shifted window means (:func:`_shifted_cross`). Backward, in the same layout, one
    accumulating product per map instead of gradients added up from parts,

        dZ_b = (G1 + G1^T) Z_b diag(w) + R_H^T (G3 H_b) R_W,
        dH_b = (G2 + G2^T) H_b + G3^T (M_b - mu 1^T) + G3^T mu 1^T,

    (sums over channels only: float32 needs no shift there). It keeps the weighted input maps ``Z diag(w)``, the
    output maps and the shifted window means (recomputing the weighted maps or the means would cost an
    early-layer block 5-10 % of its statistics' time on CPUs, where these passes are bound by memory traffic).
    """

    @staticmethod
    def forward(
        ctx, z_map: Tensor, h_map: Tensor, coverage: Tensor, windows: _Windows
    ) -> tuple[Tensor, Tensor, Tensor]:
        sums, means, shift, weighted = _per_image_products(z_map, h_map, coverage, windows)
        ctx.save_for_backward(weighted, h_map, means, shift)
        ctx.low_shape, ctx.windows = z_map.shape, windows
        return sums

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        weighted, h_map, means, shift = ctx.saved_tensors
        windows: _Windows = ctx.windows
        (batch, k1), k2 = ctx.low_shape[:2], h_map.shape[1]
        low, high, cross = _gradient_matrices(grads, (k1, k2), weighted)
        grad_z = weighted.new_empty(ctx.low_shape) if ctx.needs_input_grad[0] else None
        grad_h = torch.empty_like(h_map) if ctx.needs_input_grad[1] else None
        with windows.products(weighted.device):
            for chunk in _image_chunks(batch, weighted):
                h, size = h_map[chunk].flatten(2), h_map[chunk].shape[0]
                if grad_z is not None:
                    d_means = windows.mm(cross, h).view(size, k1, *h_map.shape[-2:])
                    windows.means_adjoint(d_means, ctx.low_shape[-2:], out=grad_z[chunk])
                    windows.add_mm_(grad_z[chunk].flatten(2), low.expand(size, k1, k1), weighted[chunk])
                if grad_h is not None:
                    shift_term = windows.mm(cross.T, shift)[None, :, None].expand(size, k2, h.shape[2])
                    gradient = grad_h[chunk].flatten(2).copy_(shift_term)
                    windows.add_mm_(gradient, high.expand(size, k2, k2), h)
                    windows.add_mm_(gradient, cross.T.expand(size, k2, k1), means[chunk].flatten(2))
        return grad_z, grad_h, None, None


class _CentredRowStatistics(torch.autograd.Function):
    """The same three sums for small deep-layer maps (many channels, few positions per image), over all
    ``B * N`` rows at once, each row shifted by its channel's mean first.

    With ``c = l - mu`` and ``d = r - nu`` (any constants would do; the means make them small),

        sum_n w_n l_n r_n^T = sum w c d^T + (sum w c) nu^T + mu (sum w d)^T + (sum w) mu nu^T,

    the product of the shifted rows in float32, the mean terms in float64. Float32 rounding then scales with
    the centred moments, which carry the dependence, instead of the uncentred ones (large for post-ReLU
    features): a plain float32 product over thousands of rows loses digits that the gradients show.

    The window means are pooled from the shifted rows, already in the rows' layout (no transposing copy of
    the means), and shifted by their own means. Forward and backward work on the ``(K, B, N)`` rows (one
    transposing copy of each map in, one of each gradient out), so every product is one large matrix
    product; the backward adds the mean terms as rank-1 updates,
    ``dZ = (G1 + G1^T) (C + mu 1^T) diag(w) + R^T(G3 (D + nu 1^T))`` and so on. Kept for it: the shifted rows
    of the three maps (small) and their means.
    """

    @staticmethod
    def forward(
        ctx, z_map: Tensor, h_map: Tensor, coverage: Tensor, windows: _Windows
    ) -> tuple[Tensor, Tensor, Tensor]:
        (batch, k1), height, width = z_map.shape[:2], *z_map.shape[-2:]
        z_rows, z_mean = _centred_rows(z_map)
        h_rows, h_mean = _centred_rows(h_map)
        # Window means from the shifted rows in their (K1, B, H, W) layout, M = pool(C) + mu pool(1), then
        # shifted by their own means.
        pooled_ones = windows.means(z_map.new_ones(1, 1, height, width)).flatten()
        m_rows = windows.means(z_rows.view(k1, batch, height, width)).view(k1, batch, -1)
        m_rows.add_(z_mean.to(z_rows.dtype)[:, None, None] * (pooled_ones - pooled_ones.mean()))
        pooled_mean = m_rows.mean(dim=(1, 2))
        m_rows.sub_(pooled_mean[:, None, None])
        m_mean = pooled_mean.to(torch.float64) + z_mean * pooled_ones.to(torch.float64).mean()
        weighted = _weighted(z_rows, coverage)
        low = _symmetric_product(weighted.flatten(1), z_rows.flatten(1), windows)
        high = _symmetric_product(h_rows.flatten(1), h_rows.flatten(1), windows)
        cross = windows.mm(m_rows.flatten(1), h_rows.flatten(1).T).to(torch.float64)
        # Sums of shifted rows are small: float32 sums lose nothing that matters (a float64 sum would first
        # copy the rows to float64).
        weighted_sum, h_sum, m_sum = (rows_.sum(dim=(1, 2)).to(torch.float64) for rows_ in (weighted, h_rows, m_rows))
        coverage_total, groups = batch * coverage.sum(dtype=torch.float64), float(h_rows.shape[1] * h_rows.shape[2])
        ctx.save_for_backward(weighted, h_rows, m_rows, z_mean, h_mean, m_mean, coverage)
        ctx.shapes, ctx.windows = (z_map.shape, h_map.shape), windows
        ctx.layouts = tuple(
            torch.channels_last if _channels_last(x) else torch.contiguous_format for x in (z_map, h_map)
        )
        return (
            _shifted(low, weighted_sum, z_mean, weighted_sum, z_mean, coverage_total),
            _shifted(high, h_sum, h_mean, h_sum, h_mean, groups),
            _shifted(cross, m_sum, m_mean, h_sum, h_mean, groups),
        )

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        weighted, h_rows, m_rows, z_mean, h_mean, m_mean, coverage = ctx.saved_tensors
        windows: _Windows = ctx.windows
        z_shape, h_shape = ctx.shapes
        z_layout, h_layout = ctx.layouts
        (k1, batch), k2 = weighted.shape[:2], h_rows.shape[0]
        low, high, cross = _gradient_matrices(grads, (k1, k2), weighted)
        z_mean, h_mean, m_mean = z_mean.to(weighted.dtype), h_mean.to(weighted.dtype), m_mean.to(weighted.dtype)
        grad_z = grad_h = None
        with windows.products(weighted.device):
            if ctx.needs_input_grad[0]:
                # R^T (G3 (D + nu 1^T)) + G1 (C diag(w) + mu w^T), in the (K1, B, N) rows
                d_means = windows.mm(cross, h_rows.flatten(1)).add_(windows.mm(cross, h_mean)[:, None])
                d_means = d_means.view(k1, batch, *h_shape[-2:])
                rows_grad = windows.means_adjoint(d_means, z_shape[-2:]).view(k1, batch, -1)
                windows.add_mm_(rows_grad.flatten(1), low, weighted.flatten(1))
                rows_grad.add_(windows.mm(low, z_mean)[:, None, None] * coverage)
                grad_z = _maps_from_rows(rows_grad, z_shape, z_layout)
            if ctx.needs_input_grad[1]:
                rows_grad = windows.add_mm_(windows.mm(high, h_rows.flatten(1)), cross.T, m_rows.flatten(1))
                rows_grad.add_((windows.mm(high, h_mean) + windows.mm(cross.T, m_mean))[:, None])
                grad_h = _maps_from_rows(rows_grad, h_shape, h_layout)
        return grad_z, grad_h, None, None


def _maps_from_rows(rows_: Tensor, shape: torch.Size, layout: torch.memory_format) -> Tensor:
    """``(B, K, H, W)`` maps in ``layout`` (the layout of the maps the gradient is for: autograd adds gradients
    of one layout several times faster than of two) from their ``(K, B, ...)`` rows, in one copy."""
    maps = torch.empty(shape, dtype=rows_.dtype, device=rows_.device, memory_format=layout)
    return maps.copy_(rows_.view(shape[1], shape[0], *shape[2:]).transpose(0, 1))


class _ChannelsLastStatistics(torch.autograd.Function):
    """The same three sums for channels-last maps, which are ``(B * H * W, K)`` matrices of rows in memory: every
    product is taken on those rows as they lie (the other paths would first copy each map into their layout).

    Forward, in chunks of images (:func:`_image_chunks`): window means pooled along the rows
    (:func:`_pooled_rows`) and shifted (:func:`_shifted_cross`), and the coverage-weighted rows ``Z diag(w)``,
    both kept for the backward; the sums as float32 products over blocks of whole images of about 1,024 rows
    (:func:`_row_block_product`), summed in float64. Backward, one product per term over all rows of a
    chunk, the gradients again channels-last:

        dZ = diag(w) Z (G1 + G1^T) + R^T (H G3^T),    dH = H (G2 + G2^T) + (M - 1 mu^T) G3 + 1 mu^T G3.
    """

    @staticmethod
    def forward(
        ctx, z_map: Tensor, h_map: Tensor, coverage: Tensor, windows: _Windows
    ) -> tuple[Tensor, Tensor, Tensor]:
        (batch, k1, height, width), (k2, out_height, out_width) = z_map.shape, h_map.shape[1:]
        positions, out_positions = height * width, out_height * out_width
        z = z_map.permute(0, 2, 3, 1).reshape(batch * positions, k1)  # views of channels-last maps
        h = h_map.permute(0, 2, 3, 1).reshape(batch * out_positions, k2)
        means, weighted = z.new_empty(batch * out_positions, k1), torch.empty_like(z)
        sums = [z.new_zeros(size, dtype=torch.float64) for size in ((k1, k1), (k2, k2), (k1, k2))]
        shift, high_sum = None, z.new_zeros(k2, dtype=torch.float64)
        for chunk in _image_chunks(batch, z_map):
            inputs, outputs = (
                slice(chunk.start * positions, chunk.stop * positions),
                slice(chunk.start * out_positions, chunk.stop * out_positions),
            )
            images = chunk.stop - chunk.start
            chunk_means = windows.pooled_rows(z[inputs], images, (height, width), out=means[outputs])
            shift = chunk_means[:out_positions].mean(dim=0) if shift is None else shift
            chunk_means.sub_(shift)
            torch.mul(
                z[inputs].view(images, positions, k1),
                coverage[:, None],
                out=weighted[inputs].view(images, positions, k1),
            )
            sums[0] += _row_block_product(weighted[inputs], z[inputs], positions, windows)
            sums[1] += _row_block_product(h[outputs], h[outputs], out_positions, windows)
            sums[2] += _row_block_product(chunk_means, h[outputs], out_positions, windows)
            high_sum += h[outputs].view(images, out_positions, k2).sum(dim=1).to(torch.float64).sum(dim=0)
        assert shift is not None
        ctx.save_for_backward(weighted, h, means, shift)
        ctx.shapes, ctx.windows = (z_map.shape, h_map.shape), windows
        return sums[0], sums[1], _shifted_cross(sums[2], shift, high_sum)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        weighted, h, means, shift = ctx.saved_tensors
        windows: _Windows = ctx.windows
        (batch, k1, height, width), (_, k2, out_height, out_width) = ctx.shapes
        positions, out_positions = height * width, out_height * out_width
        low, high, cross = _gradient_matrices(grads, (k1, k2), weighted)
        grad_z = torch.empty_like(weighted) if ctx.needs_input_grad[0] else None
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[1] else None
        with windows.products(weighted.device):
            for chunk in _image_chunks(batch, weighted.view(batch, -1)):
                inputs, outputs = (
                    slice(chunk.start * positions, chunk.stop * positions),
                    slice(chunk.start * out_positions, chunk.stop * out_positions),
                )
                if grad_z is not None:  # the adjoint pooling of H G3^T, then the low term added in place
                    windows.pooled_rows(
                        windows.mm(h[outputs], cross.T),
                        chunk.stop - chunk.start,
                        (out_height, out_width),
                        out=grad_z[inputs],
                        adjoint=True,
                    )
                    windows.add_mm_(grad_z[inputs], weighted[inputs], low)
                if grad_h is not None:
                    gradient = windows.mm(h[outputs], high, out=grad_h[outputs])
                    windows.add_mm_(gradient, means[outputs], cross).add_(windows.mm(shift, cross))
        as_maps = [
            None if grad is None else grad.view(batch, size[2], size[3], size[1]).permute(0, 3, 1, 2)
            for grad, size in ((grad_z, ctx.shapes[0]), (grad_h, ctx.shapes[1]))
        ]
        return as_maps[0], as_maps[1], None, None


def _channels_last(x: Tensor) -> bool:
    """Whether a ``(B, K, H, W)`` map lies channels-last in memory (and not also as a plain contiguous map, as
    maps of one position or one channel do)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


@contextmanager
def _float32_products(device: torch.device, tf32: bool = False) -> Iterator[None]:
    """Float32 matrix products on CUDA exact (no TF32) or, with ``tf32``, on the tensor cores, whatever
    ``torch.set_float32_matmul_precision`` says, for work on ``device``. Decided by the device, not by
    ``torch.cuda.is_available()``, which on a machine with a CUDA build of torch and no GPU asks the driver again at
    every call."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):  # torch < 2.9: the legacy flag only
        saved_flag = matmul.allow_tf32
        matmul.allow_tf32 = tf32
        try:
            yield
        finally:
            matmul.allow_tf32 = saved_flag
        return
    # torch >= 2.9 has a legacy and a new setting, and raises where code reads one that disagrees with the other
    # (TunableOp reads the legacy one): set_float32_matmul_precision sets both; where the user's own settings already
    # disagree (the legacy getter raises), only the new flag, which the products read, is set.
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    saved = matmul.fp32_precision
    if legacy is not None:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
    else:
        matmul.fp32_precision = "tf32" if tf32 else "ieee"
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        matmul.fp32_precision = saved


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
