"""A block's windows as constants of its shapes: the coverage weights of R1 and the band matrices of window means
(docs/conventions.md §3), made once per shape and device."""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor

from hfmca_lightning.losses.window_geometry import WindowGeometry

__all__ = ["WindowPooling", "fits_avg_pool", "pooling_for", "window_band", "window_constants", "window_coverage"]


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


WindowPooling = Literal["banded", "avg_pool"]


def pooling_for(device: torch.device, geometry: WindowGeometry) -> WindowPooling:
    """``avg_pool`` on GPUs (where ``avg_pool2d`` takes the padding as given), ``banded`` on CPUs."""
    return "avg_pool" if device.type == "cuda" and fits_avg_pool(geometry) else "banded"


def fits_avg_pool(geometry: WindowGeometry) -> bool:
    """Whether ``avg_pool2d`` takes this window's padding (at most half the kernel)."""
    return 2 * geometry.padding <= geometry.kernel


@functools.lru_cache(maxsize=128)
def window_constants(
    input_size: tuple[int, int], output_size: tuple[int, int], geometry: WindowGeometry, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A block's constants, made once per shape and device (on GPUs each is a few kernel launches per step,
    and the internal step is launch-bound there): float64 coverage ``(H, W)``, float32 coverage ``(H*W,)``,
    and the float32 band matrices of :func:`window_band` for rows and columns. Never written to."""
    with torch.inference_mode(False):  # usable in training even if first made under inference mode
        like = torch.empty(0, dtype=torch.float32, device=device)
        coverage = window_coverage(input_size, output_size, geometry, device=device)
        return (
            coverage,
            coverage.to(torch.float32).flatten(),
            window_band(input_size[0], geometry, like),
            window_band(input_size[1], geometry, like),
        )


@functools.lru_cache(maxsize=128)
def window_reciprocal_sizes(
    input_size: tuple[int, int], geometry: WindowGeometry, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """``(H', W')``: ``1 / |W_q|`` of each window, ``|W_q|`` the number of input positions it covers (the divisor of
    ``avg_pool2d`` with ``count_include_pad=False``), made once per shape, device and dtype. Never written to."""
    with torch.inference_mode(False):  # usable in training even if first made under inference mode
        rows, columns = (_real_members(size, geometry, device).sum(dim=1) for size in input_size)
        return torch.outer(rows, columns).reciprocal().to(dtype)


def window_band(size: int, geometry: WindowGeometry, like: Tensor) -> Tensor:
    """``(out, size)`` matrix with ``1 / n_o`` where output position ``o`` 's window covers input position ``i``,
    ``n_o`` the number of input positions it covers (``kernel`` inside, fewer at a padded border), zero elsewhere: the
    window means' row (or column) factor, since ``|W_q| = n_row * n_column``.

    Rounded, the ``n_o`` weights would not sum to 1 (float32: ``3 fl(1/3) = 1 + 3e-8``) and scale every window
    mean alike, a bias that the trivial eigenvalue near 1 amplifies; so each window's last member takes what its
    others leave of 1, and every row sums to exactly 1."""
    members = _real_members(size, geometry, like.device)
    band = (members / members.sum(dim=1, keepdim=True)).to(like.dtype)
    last = members.shape[1] - 1 - members.flip(1).argmax(dim=1)  # each window's last member
    windows = torch.arange(band.shape[0], device=band.device)
    band[windows, last] = 0
    band[windows, last] = (1 - band.to(torch.float64).sum(dim=1)).to(like.dtype)  # exact: near 1 / n
    return band
