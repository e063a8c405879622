"""Window means by ``avg_pool2d`` and their adjoint, against autograd of the definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hfmca_lightning.losses import WindowGeometry, feature_map_statistics
from hfmca_lightning.losses.block_arithmetic import BlockArithmetic, avg_pool_means, avg_pool_means_adjoint
from hfmca_lightning.losses.window_pooling import window_constants

GEOMETRIES = [WindowGeometry(3, 1, 0), WindowGeometry(3, 1, 1), WindowGeometry(5, 1, 2), WindowGeometry(7, 2, 3)]
LAYOUTS = pytest.mark.parametrize(
    "layout", [torch.channels_last, torch.contiguous_format], ids=["channels-last", "plain"]
)


class AvgPoolBackwardCalls(TorchDispatchMode):
    """The paddings of every ``avg_pool2d_backward`` that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.paddings: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket == torch.ops.aten.avg_pool2d_backward:
            self.paddings.append(list(args[4]))
        return func(*args, **(kwargs or {}))


@LAYOUTS
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_the_adjoint_is_autograds_transpose_of_the_window_means(geometry, layout):
    """``<means(Z), D> = <Z, adjoint(D)>`` for every ``D``: the adjoint equals autograd's vector-Jacobian product of
    ``avg_pool2d`` with ``count_include_pad=False`` (float64: agreement to rounding), in the layout of ``D``."""
    torch.manual_seed(0)
    maps = torch.randn(3, 5, 11, 11, dtype=torch.float64).contiguous(memory_format=layout).requires_grad_()
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    means = F.avg_pool2d(maps, k, s, p, count_include_pad=False)
    d_means = torch.randn_like(means).contiguous(memory_format=layout)
    (expected,) = torch.autograd.grad(means, maps, d_means)
    adjoint = avg_pool_means_adjoint(d_means, (11, 11), geometry)
    torch.testing.assert_close(adjoint, expected, rtol=0, atol=1e-14)
    channel_stride, row_stride, column_stride = adjoint.stride()[1:]  # a crop of a map in the layout of ``D``
    assert (channel_stride == 1) if layout == torch.channels_last else (column_stride == 1 and row_stride > 1)
    torch.testing.assert_close(avg_pool_means(maps, geometry), means, rtol=0, atol=0)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_pooled_rows_into_out_are_the_means_and_adjoint_of_the_maps(geometry):
    """Channels-last maps as ``(B * H * W, K)`` rows: the window means and the adjoint written into ``out`` rows."""
    torch.manual_seed(1)
    size, channels, images = (11, 11), 4, 2
    output_size = geometry.output_size(size)
    _, _, rows, columns = window_constants(size, output_size, geometry, torch.device("cpu"))
    windows = BlockArithmetic(geometry, rows, columns, "avg_pool")
    maps = torch.randn(images, channels, *size).contiguous(memory_format=torch.channels_last)
    maps_rows = maps.permute(0, 2, 3, 1).reshape(-1, channels)
    means_rows = windows.pooled_rows(
        maps_rows, images, size, out=torch.empty(images * output_size[0] * output_size[1], channels)
    )
    means = avg_pool_means(maps, geometry)
    torch.testing.assert_close(means_rows, means.permute(0, 2, 3, 1).reshape(-1, channels), rtol=0, atol=0)
    out = torch.empty_like(maps_rows)
    back = windows.pooled_rows(means_rows, images, output_size, out=out, adjoint=True)
    assert back is out
    expected = avg_pool_means_adjoint(means, size, geometry).permute(0, 2, 3, 1).reshape(-1, channels)
    torch.testing.assert_close(back, expected, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fast"])
def test_no_padded_avg_pool_backward_runs_in_a_training_backward_pass(precision):
    """With padding, CUDA's channels-last ``avg_pool2d_backward`` put gradients in the wrong windows
    (pytorch/pytorch#188344; measured on one H200 with torch 2.11): the statistics' backward passes call it without
    padding, on the zero-padded map. ``window_pooling="avg_pool"`` runs here the GPU's pooling on the CPU."""
    geometry = WindowGeometry(5, 1, 2)
    torch.manual_seed(2)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    low, high = (
        torch.rand(6, k, 8, 8).to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_() for k in (4, 5)
    )
    statistics = feature_map_statistics(low, high, geometry, precision=precision, window_pooling="avg_pool")
    sums = (statistics.low_outer_sum, statistics.high_outer_sum, statistics.cross_sum)
    total = sum((value * torch.randn_like(value)).sum() for value in sums)
    with AvgPoolBackwardCalls() as calls:
        torch.autograd.grad(total, (low, high))
    assert calls.paddings and all(padding == [0, 0] for padding in calls.paddings)
