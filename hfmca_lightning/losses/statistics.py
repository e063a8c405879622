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

from collections.abc import Iterator
from contextlib import contextmanager
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
    "window_coverage",
    "regularised_blocks",
]


@dataclass(frozen=True)
class CorrelationStatistics:
    """Sufficient statistics of one cost, as float64 sums and counts.

    Attributes:
        low_outer_sum: ``(K1, K1)`` sum over members of ``w z z^T`` (``w`` = 1 for groups, the window
            coverage for feature maps).
        high_outer_sum: ``(K2, K2)`` sum over groups of ``h h^T``.
        cross_sum: ``(K1, K2)`` sum over groups of ``(mean_l z_l) h^T``.
        member_count: ``()`` number of members ``M * L`` (padding members included).
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
        """``(R1, R2, P)`` of docs/conventions.md §1: the sums divided by their counts."""
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
    return torch.tensor(float(value), dtype=torch.float64, device=like.device)


def group_statistics(low: Tensor, high: Tensor) -> CorrelationStatistics:
    """Statistics of groups of ``L`` members (the external cost, paper Alg. 1).

    Args:
        low: ``(M, L, K1)`` the L member features of each of M groups.
        high: ``(M, K2)`` one feature per group.
    """
    if low.dim() != 3:
        raise ValueError(
            f"`low` must have shape (M, L, K1) = (groups, members per group, features); got shape "
            f"{tuple(low.shape)}. For a single member per group use low.unsqueeze(1)."
        )
    if high.dim() != 2:
        raise ValueError(
            f"`high` must have shape (M, K2) = (groups, features); got shape {tuple(high.shape)}"
        )
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
    input_size: tuple[int, int], output_size: tuple[int, int], geometry: WindowGeometry, device: torch.device | None = None
) -> Tensor:
    """``(H, W)`` float64 map: how many output windows contain each input position.

    Windows have the block's ``geometry``; positions outside ``[0, H) x [0, W)`` are padding and are
    cropped away (they hold zeros, so they add nothing to R1 but count as members).
    """
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    height, width = input_size
    windows = output_size[0] * output_size[1]
    ones = torch.ones(1, k * k, windows, dtype=torch.float64, device=device)
    padded = F.fold(ones, output_size=(height + 2 * p, width + 2 * p), kernel_size=k, stride=s)
    return padded[0, 0, p : p + height, p : p + width]


StatisticsPrecision = Literal["fast", "float64"]


def feature_map_statistics(
    low_map: Tensor, high_map: Tensor, geometry: WindowGeometry, precision: StatisticsPrecision = "fast"
) -> CorrelationStatistics:
    """Statistics between a block's input map and output map (internal cost, paper Alg. 2, docs/conventions.md §3).

    Every output position ``q`` is a group whose members are the ``kernel**2`` input positions of its
    window (padding positions are zero members). Equal to :func:`group_statistics` on the unfolded
    windows, but computed without unfolding: window means by average pooling, R1 as a coverage-weighted
    sum over input positions.

    ``precision="fast"`` (training): float32 arithmetic, float64 sums. Window means are two banded matrix
    products (:func:`_window_means`). Maps with at least as many positions per image as channels (the costly
    early layers) are multiplied one image at a time in their own ``(B, K, H*W)`` layout (no permuted copies;
    TF32 off on CUDA) and the per-image products summed in float64; small deep-layer maps are multiplied over
    all rows at once after subtracting their means (:func:`_shifted_products`). ``"float64"``: every step in
    float64 with average pooling (analysis, and the reference the fast path is tested against: costs agree
    to 1e-6 and gradients to 1e-5, relative).

    Args:
        low_map: ``(B, K1, H, W)`` block input ``Z_s``.
        high_map: ``(B, K2, H', W')`` block output ``Z_{s+1}``.
        geometry: the block's window ``(kernel, stride, padding)``.
        precision: ``fast`` or ``float64``.
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
    expected = geometry.output_size(low_map.shape[-2:])
    if expected != tuple(high_map.shape[-2:]):
        raise ValueError(
            f"window geometry {geometry} maps a {tuple(low_map.shape[-2:])} input to {expected} "
            f"positions, but the block output is {tuple(high_map.shape[-2:])}: the geometry does not "
            "describe this block (pass the right geometry or check the hooked modules)"
        )
    if precision not in ("fast", "float64"):
        raise ValueError(f"precision must be 'fast' or 'float64'; got {precision!r}")
    dtype = torch.float32 if precision == "fast" else torch.float64
    with torch.autocast(device_type=low_map.device.type, enabled=False), _exact_float32_products():
        z_map = low_map.to(dtype)
        z = z_map.flatten(2)  # (B, K1, H*W): the native layout, a view for NCHW maps
        h = high_map.to(dtype).flatten(2)  # (B, K2, H'*W')
        coverage = window_coverage(low_map.shape[-2:], high_map.shape[-2:], geometry, device=z.device).to(dtype).flatten()
        groups = h.shape[0] * h.shape[2]
        counts = _count(groups * geometry.kernel**2, z), _count(groups, z)
        if precision == "fast" and _fits_per_image_products(z, h):
            rows, columns = _window_band(z_map.shape[-2], geometry, z_map), _window_band(z_map.shape[-1], geometry, z_map)
            h_map = high_map.to(dtype)
            low_outer, high_outer, cross = _LargeMapStatistics.apply(z_map, h_map, coverage, rows, columns)
            return CorrelationStatistics(low_outer, high_outer, cross, *counts)
        if precision == "fast":
            window_mean = _window_means(z_map, geometry).flatten(2)
            low_outer, high_outer = _WeightedGram.apply(z, coverage), _WeightedGram.apply(h, None)
        else:
            p = geometry.padding
            window_mean = F.avg_pool2d(F.pad(z_map, (p, p, p, p)), geometry.kernel, geometry.stride).flatten(2)
            low_outer, high_outer = _summed_products(z * coverage, z), _summed_products(h, h)
        return CorrelationStatistics(low_outer, high_outer, _summed_products(window_mean, h), *counts)


def _window_means(z_map: Tensor, geometry: WindowGeometry) -> Tensor:
    """``(B, K, H', W')``: the mean of every ``kernel x kernel`` window (zero padding counted), as ``R_H Z R_W^T``
    with banded ``(H', H)`` / ``(W', W)`` matrices (:func:`_window_band`). Two batched matrix products: the
    numbers of average pooling as plain GEMMs (on CPUs as fast as oneDNN's depthwise box convolution where
    that is fast, and 2x faster on 32 x 32 maps with 64 channels, where it is not)."""
    rows = _window_band(z_map.shape[-2], geometry, z_map)
    columns = _window_band(z_map.shape[-1], geometry, z_map)
    return torch.matmul(torch.matmul(rows, z_map), columns.T)


def _window_band(size: int, geometry: WindowGeometry, like: Tensor) -> Tensor:
    """``(out, size)`` matrix with ``1 / kernel`` where output position ``o`` 's window covers input position
    ``i`` (``o * stride - padding <= i < o * stride - padding + kernel``); padding positions are zero."""
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    out = (size + 2 * p - k) // s + 1
    start = torch.arange(out, device=like.device)[:, None] * s - p
    position = torch.arange(size, device=like.device)[None, :]
    return ((position >= start) & (position < start + k)).to(like.dtype) / k


def _fits_per_image_products(z: Tensor, h: Tensor) -> bool:
    """Whether every product of a block's statistics is efficient one image at a time: each image's input
    ``z (K1, N)`` and output ``h (K2, N')`` have at least as many positions as channels (the early layers)."""
    return z.shape[2] >= z.shape[1] and h.shape[2] >= max(z.shape[1], h.shape[1])


class _LargeMapStatistics(torch.autograd.Function):
    """``(sum_b Z_b diag(w) Z_b^T, sum_b H_b H_b^T, sum_b M_b H_b^T)`` (float64) of a block's input maps ``Z``,
    output maps ``H`` and window means ``M = R_H Z R_W^T``, for maps with many positions per image.

    Every product per image in the maps' own ``(K, H*W)`` layout, in their dtype, summed in float64. Nothing
    but the two maps is kept for the backward pass (autograd would keep ``Z diag(w)`` and ``M`` too), which
    recomputes the window means and writes each input gradient in one accumulating product,

        dZ_b = (G1 + G1^T) Z_b diag(w) + R_H^T (G3 H_b) R_W,    dH_b = (G2 + G2^T) H_b + G3^T M_b,

    instead of adding up gradients from parts.
    """

    @staticmethod
    def forward(ctx, z_map: Tensor, h_map: Tensor, coverage: Tensor, rows: Tensor, columns: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        z_rows, h_rows = z_map.flatten(2), h_map.flatten(2)
        means = torch.matmul(torch.matmul(rows, z_map), columns.T).flatten(2)
        low = torch.bmm(z_rows * coverage, z_rows.transpose(1, 2)).to(torch.float64).sum(dim=0)
        high = torch.bmm(h_rows, h_rows.transpose(1, 2)).to(torch.float64).sum(dim=0)
        cross = torch.bmm(means, h_rows.transpose(1, 2)).to(torch.float64).sum(dim=0)
        ctx.save_for_backward(z_map, h_map, coverage, rows, columns)
        return low, high, cross

    @staticmethod
    def backward(ctx, grad_low: Tensor | None, grad_high: Tensor | None, grad_cross: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        z_map, h_map, coverage, rows, columns = ctx.saved_tensors
        dtype, (k1, k2) = z_map.dtype, (z_map.shape[1], h_map.shape[1])

        def as_matrix(grad: Tensor | None, size: tuple[int, int], symmetric: bool = False) -> Tensor:
            if grad is None:
                return torch.zeros(size, dtype=dtype, device=z_map.device)
            return (grad + grad.T if symmetric else grad).to(dtype)

        low, high, cross = as_matrix(grad_low, (k1, k1), True), as_matrix(grad_high, (k2, k2), True), as_matrix(grad_cross, (k1, k2))
        batch, (out_height, out_width) = z_map.shape[0], h_map.shape[-2:]
        z_rows, h_rows = z_map.flatten(2), h_map.flatten(2)
        grad_z = grad_h = None
        with _exact_float32_products():
            if ctx.needs_input_grad[0]:
                d_means = torch.matmul(cross, h_rows).view(batch, k1, out_height, out_width)
                grad_z = torch.matmul(torch.matmul(rows.T, d_means), columns)
                grad_z.flatten(2).baddbmm_(low.expand(batch, k1, k1), z_rows * coverage)
            if ctx.needs_input_grad[1]:
                means = torch.matmul(torch.matmul(rows, z_map), columns.T).flatten(2)
                grad_h = torch.bmm(high.expand(batch, k2, k2), h_rows).baddbmm_(cross.T.expand(batch, k2, k1), means).view(h_map.shape)
        return grad_z, grad_h, None, None, None


def _large(x: Tensor) -> bool:
    """Whether a ``(B, K, N)`` map has at least as many positions per image as channels (the early layers)."""
    return x.shape[2] >= x.shape[1]


def _channel_rows(x: Tensor) -> Tensor:
    """``(B, K, N)`` -> ``(K, B * N)``, transposed in one copy (of a small deep-layer map)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _shifted_products(left: Tensor, right: Tensor, weights: Tensor | None = None) -> Tensor:
    """``sum_n w_n l_n r_n^T`` (float64) for rows ``left (K1, n)`` and ``right (K2, n)``, weights ``w (n,)`` or 1.

    Float64 rows: one product. Float32 rows: shifted by their means ``mu``, ``nu`` (any constants would do),
    ``c = l - mu`` and ``d = r - nu``, the product of the shifted rows in float32 and the mean terms in float64,

        sum w l r^T = sum w c d^T + (sum w c) nu^T + mu (sum w d)^T + (sum w) mu nu^T.

    Float32 rounding then scales with the centred moments, which carry the dependence, instead of the
    uncentred ones (large for post-ReLU features): relative gradient errors ~1e-6 instead of ~3e-5 on ResNet
    layer-4 maps, with no float64 copy of the rows (sums of centred rows are small, so float32 sums do).
    """
    if left.dtype == torch.float64:
        return (left if weights is None else left * weights) @ right.T
    left_mean = left.detach().mean(dim=1)
    left_centred = left - left_mean[:, None]
    if right is left:
        right_mean, right_centred = left_mean, left_centred
    else:
        right_mean = right.detach().mean(dim=1)
        right_centred = right - right_mean[:, None]
    weighted = left_centred if weights is None else left_centred * weights
    with _exact_float32_products():
        product = (weighted @ right_centred.T).to(torch.float64)
    total = float(left.shape[1]) if weights is None else weights.sum(dtype=torch.float64)
    # Sums of centred rows are small: float32 sums lose nothing that matters.
    left_sum = weighted.sum(dim=1).to(torch.float64)
    right_sum = (right_centred if weights is None else right_centred * weights).sum(dim=1).to(torch.float64)
    mu, nu = left_mean.to(torch.float64), right_mean.to(torch.float64)
    return product + torch.outer(left_sum, nu) + torch.outer(mu, right_sum) + total * torch.outer(mu, nu)


class _WeightedGram(torch.autograd.Function):
    """``sum_b Z_b diag(w) Z_b^T`` (float64) for ``Z (B, K, N)`` and position weights ``w (N,)`` or none.

    Large maps (at least as many positions per image as channels: the early layers): one float32 product
    per image in the map's own layout, summed in float64. Small deep-layer maps (many channels, few
    positions): one product over all rows of a transposed copy, centred (:func:`_shifted_products`; a plain
    float32 sum over thousands of positions would show in their gradients). The backward pass uses the
    symmetry, ``dZ_b = (G + G^T) Z_b diag(w)``: one product instead of the two autograd would run.
    """

    @staticmethod
    def forward(ctx, z: Tensor, weights: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.shape = z.shape
        if _large(z):
            weighted = z if weights is None else z * weights
            ctx.save_for_backward(weighted)
            return torch.bmm(weighted, z.transpose(1, 2)).to(torch.float64).sum(dim=0)
        rows = _channel_rows(z)
        row_weights = None if weights is None else weights.repeat(z.shape[0])
        ctx.save_for_backward(rows if row_weights is None else rows * row_weights)
        return _shifted_products(rows, rows, row_weights)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (weighted,) = ctx.saved_tensors
        symmetric = (grad + grad.T).to(weighted.dtype)
        with _exact_float32_products():
            if weighted.dim() == 3:  # large map, per image
                return torch.matmul(symmetric, weighted), None
            batch, channels, positions = ctx.shape
            grad_rows = (symmetric @ weighted).reshape(channels, batch, positions)
        return grad_rows.transpose(0, 1).contiguous(), None


def _summed_products(left: Tensor, right: Tensor) -> Tensor:
    """``sum_b left[b] @ right[b]^T`` (float64) for ``(B, K1, N)`` and ``(B, K2, N)`` maps: per image for large
    maps, one centred product over all rows for small ones (as :class:`_WeightedGram`)."""
    if _large(left) and _large(right):
        return torch.bmm(left, right.transpose(1, 2)).to(torch.float64).sum(dim=0)
    return _shifted_products(_channel_rows(left), _channel_rows(right))


@contextmanager
def _exact_float32_products() -> Iterator[None]:
    """Full float32 matrix products on CUDA (no TF32), whatever ``torch.set_float32_matmul_precision`` says."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def regularised_blocks(stats: CorrelationStatistics, reg: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(A, C, J)`` of docs/conventions.md §1: ``A = R1 + reg I``, ``C = R2 + reg I``, ``J = [[A, P], [P^T, C]]``."""
    r1, r2, cross = stats.means()
    eye_low = torch.eye(stats.low_dim, dtype=r1.dtype, device=r1.device)
    eye_high = torch.eye(stats.high_dim, dtype=r2.dtype, device=r2.device)
    a = r1 + reg * eye_low
    c = r2 + reg * eye_high
    joint = torch.cat([torch.cat([a, cross], dim=1), torch.cat([cross.T, c], dim=1)], dim=0)
    return a, c, joint
