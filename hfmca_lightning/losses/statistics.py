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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hfmca_lightning.losses.window_geometry import WindowGeometry

__all__ = [
    "CorrelationStatistics",
    "group_statistics",
    "feature_map_statistics",
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


def feature_map_statistics(low_map: Tensor, high_map: Tensor, geometry: WindowGeometry) -> CorrelationStatistics:
    """Statistics between a block's input map and output map (internal cost, paper Alg. 2, docs/conventions.md §3).

    Every output position ``q`` is a group whose members are the ``kernel**2`` input positions of its
    window (padding positions are zero members). Equal to :func:`group_statistics` on the unfolded
    windows, but computed without unfolding: window means by average pooling, R1 as a
    coverage-weighted sum over input positions.

    Args:
        low_map: ``(B, K1, H, W)`` block input ``Z_s``.
        high_map: ``(B, K2, H', W')`` block output ``Z_{s+1}``.
        geometry: the block's window ``(kernel, stride, padding)``.
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
    with torch.autocast(device_type=low_map.device.type, enabled=False):
        z = _float64(low_map)
        h = _float64(high_map)
        p = geometry.padding
        window_mean = F.avg_pool2d(F.pad(z, (p, p, p, p)), geometry.kernel, geometry.stride)
        coverage = window_coverage(z.shape[-2:], h.shape[-2:], geometry, device=z.device)
        members = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        weights = coverage.expand(z.shape[0], -1, -1).reshape(-1, 1)
        outputs = h.permute(0, 2, 3, 1).reshape(-1, h.shape[1])
        means = window_mean.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        groups = outputs.shape[0]
        return CorrelationStatistics(
            low_outer_sum=(members * weights).T @ members,
            high_outer_sum=outputs.T @ outputs,
            cross_sum=means.T @ outputs,
            member_count=_count(groups * geometry.kernel**2, z),
            group_count=_count(groups, z),
        )


def regularised_blocks(stats: CorrelationStatistics, reg: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(A, C, J)`` of docs/conventions.md §1: ``A = R1 + reg I``, ``C = R2 + reg I``, ``J = [[A, P], [P^T, C]]``."""
    r1, r2, cross = stats.means()
    eye_low = torch.eye(stats.low_dim, dtype=r1.dtype, device=r1.device)
    eye_high = torch.eye(stats.high_dim, dtype=r2.dtype, device=r2.device)
    a = r1 + reg * eye_low
    c = r2 + reg * eye_high
    joint = torch.cat([torch.cat([a, cross], dim=1), torch.cat([cross.T, c], dim=1)], dim=0)
    return a, c, joint
