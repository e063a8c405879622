"""The three sums of a block's statistics as autograd functions with their own backward passes, one per map shape
and layout (docs/conventions.md §3): :class:`PerImageStatistics` (early layers), :class:`CentredRowStatistics` (deep
layers), :class:`ChannelsLastStatistics` (channels-last maps), :class:`Bfloat16Statistics` (bfloat16 maps on bf16
tensor cores), and :func:`float64_statistics`, the reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hfmca_lightning.losses.block_arithmetic import (
    BlockArithmetic,
    avg_pool_means,
    avg_pool_means_adjoint,
    float32_products,
    is_channels_last,
)
from hfmca_lightning.losses.window_geometry import WindowGeometry

__all__ = [
    "Bfloat16Statistics",
    "CentredRowStatistics",
    "ChannelsLastStatistics",
    "PerImageStatistics",
    "float64_statistics",
    "is_per_image",
]


def float64_statistics(
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


def _row_block_product(left: Tensor, right: Tensor, image_rows: int, windows: BlockArithmetic) -> Tensor:
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


def is_per_image(h_map: Tensor) -> bool:
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


def _symmetric_product(left: Tensor, right: Tensor, windows: BlockArithmetic) -> Tensor:
    """``left @ right^T`` (float64, summed over a leading batch dimension if any) for a symmetric result
    (``left = right diag(w)``), made exactly symmetric, as one product (products of half the rows save a quarter
    of the arithmetic but run slower at these shapes)."""
    product = windows.mm(left, right.transpose(-1, -2))
    product = product.sum(dim=0, dtype=torch.float64) if product.dim() == 3 else product.to(torch.float64)
    return (product + product.T) / 2


def _per_image_products(
    z_map: Tensor, h_map: Tensor, coverage: Tensor, windows: BlockArithmetic
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
    if is_channels_last(x):
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


class PerImageStatistics(torch.autograd.Function):
    """``(sum_b Z_b diag(w) Z_b^T, sum_b H_b H_b^T, sum_b M_b H_b^T)`` (float64) of a block's float32 input maps
    ``Z``, output maps ``H`` and window means ``M = R_H Z R_W^T``, for early layers (:func:`is_per_image`).

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
        ctx, z_map: Tensor, h_map: Tensor, coverage: Tensor, windows: BlockArithmetic
    ) -> tuple[Tensor, Tensor, Tensor]:
        sums, means, shift, weighted = _per_image_products(z_map, h_map, coverage, windows)
        ctx.save_for_backward(weighted, h_map, means, shift)
        ctx.low_shape, ctx.windows = z_map.shape, windows
        return sums

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        weighted, h_map, means, shift = ctx.saved_tensors
        windows: BlockArithmetic = ctx.windows
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


class CentredRowStatistics(torch.autograd.Function):
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
        ctx, z_map: Tensor, h_map: Tensor, coverage: Tensor, windows: BlockArithmetic
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
            torch.channels_last if is_channels_last(x) else torch.contiguous_format for x in (z_map, h_map)
        )
        return (
            _shifted(low, weighted_sum, z_mean, weighted_sum, z_mean, coverage_total),
            _shifted(high, h_sum, h_mean, h_sum, h_mean, groups),
            _shifted(cross, m_sum, m_mean, h_sum, h_mean, groups),
        )

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        weighted, h_rows, m_rows, z_mean, h_mean, m_mean, coverage = ctx.saved_tensors
        windows: BlockArithmetic = ctx.windows
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


class ChannelsLastStatistics(torch.autograd.Function):
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
        ctx, z_map: Tensor, h_map: Tensor, coverage: Tensor, windows: BlockArithmetic
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
        windows: BlockArithmetic = ctx.windows
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


# torch.mm / bmm / addmm / baddbmm(..., out_dtype=): bf16 in, float32 out (torch >= 2.8)
_OUT_DTYPE_PRODUCTS = all(
    hasattr(operation, "dtype") for operation in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm,
                                                  torch.ops.aten.baddbmm)
)  # fmt: skip
# addmm(C, A, B, out_dtype=float32) with a float32 accumulator C and bf16 factors (torch >= 2.10; before, C had to
# be of the factors' dtype)
_FLOAT32_ACCUMULATOR = _OUT_DTYPE_PRODUCTS and tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 10)


def float32_product(left: Tensor, right: Tensor, accumulator: Tensor | None = None) -> Tensor:
    """``accumulator + left @ right`` of bfloat16 matrices (2-D, or batched 3-D), accumulated and returned in
    float32: one bf16 tensor-core product on CUDA (products of bfloat16 numbers are exact in float32), a 2-D one
    accumulated into the float32 ``accumulator`` in place (out of place, CUDA first copies the accumulator into a
    new result); the same exact products in float32 elsewhere (CPUs have no bf16 product with a float32 result)."""
    if left.device.type == "cuda" and _OUT_DTYPE_PRODUCTS:
        batched = left.dim() == 3
        if accumulator is not None and not batched and _FLOAT32_ACCUMULATOR:
            return torch.addmm(accumulator, left, right, out_dtype=torch.float32, out=accumulator)
        product = (torch.bmm if batched else torch.mm)(left, right, out_dtype=torch.float32)
        return product if accumulator is None else accumulator.add_(product)
    with float32_products(left.device):
        product = torch.matmul(left.float(), right.float())
        return product if accumulator is None else product.add_(accumulator)


def _split_bfloat16(x: Tensor) -> Tensor:
    """``[hi; lo]`` ``(2, *x.shape)``: ``x`` rounded to bfloat16 and the rounded rest, ``hi + lo`` within
    ``2^-16 |x|``, side by side in one tensor."""
    parts = torch.empty((2, *x.shape), dtype=torch.bfloat16, device=x.device)
    parts[0].copy_(x)
    torch.sub(x, parts[0], out=parts[1])  # exact in float64, rounded once into the bfloat16 part
    return parts


def _split_product(left: Tensor, right: tuple[Tensor, Tensor], accumulator: Tensor | None = None) -> Tensor:
    """``accumulator + left @ (hi + lo)`` in float32 from the bfloat16 parts of ``right``: two exact products."""
    hi, lo = right
    return float32_product(left, lo, float32_product(left, hi, accumulator))


def _position_major(map_: Tensor) -> Tensor:
    """``(P, B, K)``: a channels-last ``(B, K, H, W)`` map as the ``(B, K)`` matrix of each of its ``P = H * W``
    positions (a view)."""
    batch, channels = map_.shape[:2]
    return map_.permute(0, 2, 3, 1).reshape(batch, -1, channels).transpose(0, 1)


def _rows(map_: Tensor) -> Tensor:
    """``(B * H * W, K)`` rows of a channels-last map (a view)."""
    return map_.permute(0, 2, 3, 1).reshape(-1, map_.shape[1])


def _as_map(rows_: Tensor, shape: torch.Size) -> Tensor:
    """The channels-last ``(B, K, H, W)`` map whose rows are ``rows_`` ``(B * H * W, K)`` (a view)."""
    batch, channels, height, width = shape
    return rows_.view(batch, height, width, channels).permute(0, 3, 1, 2)


def _gradient_parts(
    grads: Sequence[Tensor | None], dims: tuple[int, int], like: Tensor
) -> tuple[tuple[Tensor, Tensor], Tensor, Tensor]:
    """The bfloat16 right factors of the backward pass from the float64 gradients of the three sums (zeros for
    None), split in one pass (:func:`_split_bfloat16`): ``(hi, lo)`` of ``G1 + G1^T``; ``[G3_hi; G3_hi; G2_hi; G2_lo;
    G3_lo]`` ``(3 K1 + 2 K2, K2)`` with ``G2`` here ``G2 + G2^T``, the factor of ``dH`` for the rows of
    :func:`_backward_rows` (the end of the split's high half and the start of its low half, so no copy); and
    ``[G3_hi^T; G3_lo^T]`` ``(2 K2, K1)``, that of the pooled part of ``dZ``."""
    k1, k2 = dims
    low, high, cross = (
        like.new_zeros(size, dtype=torch.float64) if grad is None else grad + grad.mT if symmetric else grad
        for grad, size, symmetric in zip(grads, ((k1, k1), (k2, k2), (k1, k2)), (True, True, False))
    )
    blocks = (high, cross, low, cross, cross, high)
    parts = _split_bfloat16(torch.cat([block.reshape(-1) for block in blocks]))  # (2, n): [hi; lo]
    total, low_start = parts.shape[1], high.numel() + cross.numel()
    hi, lo = (part[low_start : low_start + low.numel()].view(k1, k1) for part in parts)
    high_factor = parts.flatten()[total - 2 * cross.numel() - high.numel() : total + low_start].view(-1, k2)
    cross_hi, cross_lo = (part[high.numel() : low_start].view(k1, k2) for part in parts)
    return (hi, lo), high_factor, torch.cat([cross_hi, cross_lo], dim=1).T


def _split_means_into(means: Tensor, lo: Tensor, hi_twice: Tensor) -> None:
    """Float32 window-mean rows ``(..., K1)`` as two bfloat16 parts: the rounded means into both ``hi_twice[..., 0,
    :]`` and ``hi_twice[..., 1, :]``, the rounded rest into ``lo`` (``hi + lo`` within ``2^-16 |M|``)."""
    hi_twice.copy_(means.unsqueeze(-2).expand_as(hi_twice))
    torch.sub(means, hi_twice[..., 0, :], out=lo)  # exact in float32, rounded once into the bfloat16 part


def _backward_rows(h_map: Tensor, means: Tensor, backward: bool = True) -> Tensor:
    """``(B, H', W', 3 K1 + 2 K2)`` bfloat16: each output position's row ``[m_lo | m_hi | h | h | m_hi]``, the two
    bfloat16 parts of its float32 window means ``(B, K1, H', W')`` (:func:`_split_means_into`) and its row of the
    channels-last output map ``(B, K2, H', W')`` twice, so that the backward pass takes each of its products with
    every part it needs as one product along K; ``[m_lo | m_hi]`` is also the forward pass's factor of the cross
    sum, and all there is without a ``backward`` to come."""
    m_rows, h_rows = means.permute(0, 2, 3, 1), h_map.permute(0, 2, 3, 1)  # channels-last: views
    k1, k2 = m_rows.shape[-1], h_rows.shape[-1]
    width = 3 * k1 + 2 * k2 if backward else 2 * k1
    rows_ = torch.empty((*h_rows.shape[:-1], width), dtype=torch.bfloat16, device=h_map.device)
    if not backward:
        _split_means_into(m_rows, rows_[..., :k1], rows_[..., k1:].unsqueeze(-2))
        return rows_
    # both m_hi columns as one (..., 2, K1) view, K1 + 2 K2 columns apart
    hi_twice = rows_.as_strided((*rows_.shape[:-1], 2, k1), (*rows_.stride()[:-1], k1 + 2 * k2, 1), k1)
    _split_means_into(m_rows, rows_[..., :k1], hi_twice)
    h_twice = rows_[..., 2 * k1 : 2 * k1 + 2 * k2].unflatten(-1, (2, k2))
    h_twice.copy_(h_rows.unsqueeze(-2).expand(*h_rows.shape[:-1], 2, k2))
    return rows_


class Bfloat16Statistics(torch.autograd.Function):
    """The three sums of bfloat16 maps on bf16 tensor cores (``precision="bf16"``; docs/conventions.md §3).

    The maps are used channels-last as they lie (plain maps are copied once). Each sum is one batched product over
    the maps' positions, every position's ``(B, K)`` rows multiplied by themselves, ``T_p = Z_p^T Z_p`` in float32
    (the products of bfloat16 numbers are exact; float32 accumulation over the ``B`` images), then summed over the
    positions in float64, ``R1`` with the coverage weights of the positions:

        S1 = sum_p w_p Z_p^T Z_p,    S2 = sum_q H_q^T H_q,    S3 = sum_q M_q^T H_q,

    with the window means ``M = avg_pool2d(Z)`` taken in float32 and split into two bfloat16 parts, ``M = hi + lo``
    within ``2^-16 |M|``, laid side by side so that one product takes both (the cost's dependence lives in the low
    bits of the cross sum: window means rounded to bfloat16 moved the costs by ~1e-4 and the gradients by ~1e-2).
    Backward, with every product exact and accumulated in float32 (the float64 gradients of the sums split into two
    bfloat16 parts likewise: the two terms of ``dZ`` cancel to a fraction of their size), and one rounding of each
    result to bfloat16 (the gradients of bfloat16 maps are bfloat16):

        dZ = w * (Z (G1 + G1^T)) + avg_pool2d_backward(H G3^T),    dH = H (G2 + G2^T) + M G3,

    ``dH`` and ``H G3^T`` each one product along K of the rows the forward pass lays out for them
    (:func:`_backward_rows`: each output row twice between the two parts of its window means), the product of the two
    low parts of ``M G3`` (``2^-16`` of the term) left out. Keeps the input map (which autograd keeps anyway) and
    those rows.
    """

    @staticmethod
    def forward(
        ctx, z_map: Tensor, h_map: Tensor, coverage: Tensor, geometry: WindowGeometry
    ) -> tuple[Tensor, Tensor, Tensor]:
        layouts = tuple(torch.channels_last if is_channels_last(x) else torch.contiguous_format for x in (z_map, h_map))
        z_map = z_map.contiguous(memory_format=torch.channels_last)
        h_map = h_map.contiguous(memory_format=torch.channels_last)
        rows_ = _backward_rows(h_map, avg_pool_means(z_map.float(), geometry), any(ctx.needs_input_grad[:2]))
        z, h = _position_major(z_map), _position_major(h_map)
        m = rows_[..., : 2 * z_map.shape[1]].flatten(1, 2).transpose(0, 1)  # (P2, B, 2 K1): [m_lo | m_hi]
        low = (float32_product(z.mT, z) * coverage[:, None, None]).sum(dim=0, dtype=torch.float64)
        high = float32_product(h.mT, h).sum(dim=0, dtype=torch.float64)
        cross = float32_product(m.mT, h).unflatten(1, (2, -1)).sum(dim=(0, 1), dtype=torch.float64)
        ctx.save_for_backward(z_map, rows_, coverage)
        ctx.geometry, ctx.layouts, ctx.high = geometry, layouts, (h_map.shape, h_map.dtype)
        return low, high, cross

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        z_map, rows_, coverage = ctx.saved_tensors
        geometry: WindowGeometry = ctx.geometry
        (h_shape, h_dtype), k1 = ctx.high, z_map.shape[1]
        low, high_factor, pooled_factor = _gradient_parts(grads, (k1, h_shape[1]), z_map)
        z, rows_ = _rows(z_map), rows_.flatten(0, 2)
        grad_z = grad_h = None
        if ctx.needs_input_grad[0]:
            pooled_shape = torch.Size((z_map.shape[0], k1, *h_shape[-2:]))
            pooled = _as_map(float32_product(rows_[:, 2 * k1 : -k1], pooled_factor), pooled_shape)  # [h | h]: H G3^T
            adjoint = avg_pool_means_adjoint(pooled, z_map.shape[-2:], geometry)
            weighted = _as_map(_split_product(z, low), z_map.shape)
            grad_z = torch.empty(z_map.shape, dtype=z_map.dtype, device=z_map.device, memory_format=ctx.layouts[0])
            torch.addcmul(adjoint, weighted, coverage.view(1, 1, *z_map.shape[-2:]), out=grad_z)  # rounded once
        if ctx.needs_input_grad[1]:
            grad_h = _as_map(float32_product(rows_, high_factor), h_shape).to(h_dtype, memory_format=ctx.layouts[1])
        return grad_z, grad_h, None, None
