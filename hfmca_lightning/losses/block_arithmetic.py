"""How a block's float32 statistics arithmetic runs: window means (banded products or ``avg_pool2d``) and matrix
products (exact float32, or three TF32 tensor-core products of split factors) (docs/conventions.md §3)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hfmca_lightning.losses.window_geometry import WindowGeometry
from hfmca_lightning.losses.window_pooling import WindowPooling, window_reciprocal_sizes

__all__ = ["BlockArithmetic", "float32_products", "is_channels_last", "split_tf32", "tensor_cores"]


@dataclass(frozen=True, eq=False)
class BlockArithmetic:
    """How a block's float32 arithmetic runs: its window means (:meth:`means`, the adjoint :meth:`means_adjoint`, the
    same on the rows of channels-last maps) and its matrix products (:meth:`mm`, :meth:`add_mm_`). A constant of one
    statistics call, kept by its autograd node for the backward pass.

    ``pooling``: ``banded`` (products with the band matrices ``rows (H', H)`` and ``columns (W', W)`` of
    :func:`window_band`; on CPUs several times faster than pooling) or ``avg_pool`` (``avg_pool2d`` over the covered
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
        return float32_products(device, tf32=self.split)

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
        """:func:`split_tf32`, of one matrix only where ``x`` repeats it over a batch (``expand``), so that a matrix
        shared by all images is split once, not copied per image."""
        if x.dim() == 3 and x.stride(0) == 0:
            hi, lo = split_tf32(x[0])
            return hi.expand_as(x), lo.expand_as(x)
        return split_tf32(x)

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
        pooled = avg_pool_means(z_map, self.geometry)
        return pooled if out is None else out.copy_(pooled)

    def means_adjoint(self, d_means: Tensor, input_size: tuple[int, int], out: Tensor | None = None) -> Tensor:
        """The adjoint of :meth:`means`: ``(..., H', W')`` -> ``(..., H, W)``."""
        if self.pooling == "banded":
            return _window_means(d_means, self.rows.T, self.columns.T, self, out)
        adjoint = avg_pool_means_adjoint(d_means, input_size, self.geometry)
        if out is None:
            return adjoint.contiguous(memory_format=_layout(d_means))
        return out.copy_(adjoint)

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
            pooled_size = (self.rows.shape[1], self.columns.shape[1])
            pooled = avg_pool_means_adjoint(maps, pooled_size, self.geometry)
        else:
            pooled_size = (self.rows.shape[0], self.columns.shape[0])
            pooled = avg_pool_means(maps, self.geometry)
        if out is None:
            return pooled.permute(0, 2, 3, 1).reshape(-1, channels)
        out.view(images, *pooled_size, channels).permute(0, 3, 1, 2).copy_(pooled)
        return out


def avg_pool_means(maps: Tensor, geometry: WindowGeometry) -> Tensor:
    """``(B, K, H', W')`` window means of ``(B, K, H, W)`` maps over the positions each window covers
    (``avg_pool2d`` without the padding; needs :func:`~hfmca_lightning.losses.window_pooling.fits_avg_pool`)."""
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    return F.avg_pool2d(maps, k, s, p, count_include_pad=False)


def avg_pool_means_adjoint(d_means: Tensor, input_size: tuple[int, int], geometry: WindowGeometry) -> Tensor:
    """The adjoint of :func:`avg_pool_means`: ``(B, K, H', W')`` -> ``(B, K, H, W)``, in the layout of ``d_means``
    (with padding, a cropped view).

    With padding, the adjoint of sum pooling on the zero-padded map, cropped, of ``d_means`` weighted by each window's
    ``1 / |W_q|``: ``avg_pool2d_backward`` without padding, since with padding CUDA's channels-last kernel put the
    gradients in the wrong windows (pytorch/pytorch#188344; on one H200, torch 2.11: the bf16 statistics' backward
    pass 74 % off float64, its forward exact)."""
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    height, width = input_size
    layout = _layout(d_means)
    if p:
        d_means = d_means * window_reciprocal_sizes(input_size, geometry, d_means.device, d_means.dtype)
    # only its shape and strides are read: made in place, not copied into its layout
    like = torch.empty(
        (*d_means.shape[:-2], height + 2 * p, width + 2 * p),
        dtype=d_means.dtype,
        device=d_means.device,
        memory_format=layout,
    )
    adjoint = torch.ops.aten.avg_pool2d_backward(d_means, like, [k, k], [s, s], [0, 0], False, True, 1 if p else None)
    return adjoint[..., p : p + height, p : p + width] if p else adjoint


def _layout(maps: Tensor) -> torch.memory_format:
    return torch.channels_last if is_channels_last(maps) else torch.contiguous_format


def split_tf32(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)`` with ``hi`` = ``x`` (float32) rounded to TF32's 10-bit mantissa (to nearest, ties to even) and
    ``lo = x - hi`` (exact: at most 13 significant bits); a TF32 product then rounds ``lo`` by at most ``2^-21 |x|``."""
    bits = x.view(torch.int32)
    hi = ((bits + 0x0FFF + ((bits >> 13) & 1)) & -0x2000).view(torch.float32)
    return hi, x - hi


def tensor_cores(device: torch.device) -> bool:
    """Whether float32 products on ``device`` may run on TF32 tensor cores (CUDA GPUs of compute capability 8.0 and
    later; the split needs them to pay, and is three exact products anywhere else)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def _window_means(
    z_map: Tensor, rows: Tensor, columns: Tensor, windows: BlockArithmetic, out: Tensor | None = None
) -> Tensor:
    """``(..., H', W')``: the mean of every window over the positions it covers, ``R_H Z R_W^T`` with the banded
    ``(H', H)`` / ``(W', W)`` matrices of :func:`window_band`: the numbers of average pooling as matrix
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
    windows: BlockArithmetic,
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


def is_channels_last(x: Tensor) -> bool:
    """Whether a ``(B, K, H, W)`` map lies channels-last in memory (and not also as a plain contiguous map, as
    maps of one position or one channel do)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


@contextmanager
def float32_products(device: torch.device, tf32: bool = False) -> Iterator[None]:
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
