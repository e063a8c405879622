"""Statistics of bfloat16 maps on bf16 tensor cores (``precision="bf16"``; docs/conventions.md §3), checked on the CPU:
the same exact products with float32 accumulation. Against float64 statistics of the same bfloat16 maps: costs within
the fast path's 1e-5, gradients within 1e-3 (they are bfloat16, rounded once); with window means rounded to bfloat16
or the gradients of the sums in one bfloat16 part (cheaper, tried first) they were not."""

from __future__ import annotations

import pytest
import torch

from hfmca_lightning.losses import WindowGeometry, cost_from_statistics, feature_map_statistics
from hfmca_lightning.losses.map_statistics import Bfloat16Statistics
from hfmca_lightning.losses.statistics import resolved_precision
from hfmca_lightning.losses.window_pooling import window_coverage
from tests.losses.test_statistics import FAST_COST_TOLERANCE, REALISTIC_BLOCKS, realistic_pair

BF16_GRADIENT_TOLERANCE = 1e-3  # docs/conventions.md §3: relative norm, against float64 of the same bfloat16 maps


def bfloat16_maps(k1, k2, size, geometry, layout=torch.channels_last, batch=18):
    """A realistic block pair as bf16-mixed training makes it: bfloat16 maps, channels-last."""
    low, high = realistic_pair(batch, k1, k2, size, geometry, seed=k1 + size)
    return tuple(x.detach().bfloat16().contiguous(memory_format=layout).requires_grad_() for x in (low, high))


def cost_and_gradients(low, high, geometry, precision, reg=0.1):
    cost = cost_from_statistics(feature_map_statistics(low, high, geometry, precision=precision), reg=reg)
    return float(cost.detach()), torch.autograd.grad(cost, (low, high))


def relative_errors(result, exact):
    (cost, gradients), (exact_cost, exact_gradients) = result, exact
    return abs(cost - exact_cost) / abs(exact_cost), [
        float((got.double() - expected.double()).norm() / expected.double().norm())
        for got, expected in zip(gradients, exact_gradients)
    ]


@REALISTIC_BLOCKS
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format], ids=["channels-last", "plain"])
def test_bf16_costs_and_gradients_meet_their_stated_tolerance(k1, k2, size, geometry, layout):
    """The training setting (reg 0.1, ResNet-shaped post-ReLU maps, bfloat16 as bf16-mixed makes them); measured on a
    2-core x86 CPU: costs up to 8e-7, gradients up to 3e-4."""
    low, high = bfloat16_maps(k1, k2, size, geometry, layout)
    exact = cost_and_gradients(low, high, geometry, "float64")
    result = cost_and_gradients(low, high, geometry, "bf16")
    assert all(g.dtype == torch.bfloat16 for g in result[1])
    assert all(g.is_contiguous(memory_format=layout) for g in result[1])
    cost_error, gradient_errors = relative_errors(result, exact)
    assert cost_error <= FAST_COST_TOLERANCE, cost_error
    assert max(gradient_errors) <= BF16_GRADIENT_TOLERANCE, gradient_errors


def test_bf16_meets_its_tolerance_at_the_batch_auto_takes_it_for():
    """``auto`` takes ``bf16`` where the channels are no more than the batch (K <= B): the deepest block of
    ``cifar10_ss_internal.yaml`` at a batch of 576 views, where each sum has 32x more terms than above."""
    geometry = WindowGeometry(7, 2, 3)
    low, high = bfloat16_maps(256, 512, 8, geometry, batch=576)
    exact = cost_and_gradients(low, high, geometry, "float64")
    cost_error, gradient_errors = relative_errors(cost_and_gradients(low, high, geometry, "bf16"), exact)
    assert cost_error <= FAST_COST_TOLERANCE, cost_error
    assert max(gradient_errors) <= BF16_GRADIENT_TOLERANCE, gradient_errors


def test_the_spectrum_setting_meets_the_same_tolerance():
    """reg 1e-3 and sigmoid maps, where rounding is least masked (the spectrum CNN's L3)."""
    torch.manual_seed(0)
    geometry = WindowGeometry(3, 1, 1)
    low = torch.sigmoid(torch.randn(32, 64, 17, 17))
    means = torch.nn.functional.avg_pool2d(low, 3, 1, 1, count_include_pad=False)
    mixed = torch.einsum("bkhw,kl->blhw", 4 * (means - 0.5), torch.randn(64, 64) / 8)
    high = torch.sigmoid(mixed + 0.5 * torch.randn_like(mixed))
    low, high = (x.bfloat16().contiguous(memory_format=torch.channels_last).requires_grad_() for x in (low, high))
    exact = cost_and_gradients(low, high, geometry, "float64", reg=1e-3)
    cost_error, gradient_errors = relative_errors(cost_and_gradients(low, high, geometry, "bf16", reg=1e-3), exact)
    assert cost_error <= FAST_COST_TOLERANCE, cost_error
    assert max(gradient_errors) <= BF16_GRADIENT_TOLERANCE, gradient_errors


def test_window_means_rounded_to_bfloat16_are_not_precise_enough(monkeypatch):
    """Why the window means are split in two parts: rounded once to bfloat16 (one product fewer), the cross sum moves
    the cost by more than 10x the tolerance at the deepest block and the gradients by more than 5x theirs."""
    from hfmca_lightning.losses import map_statistics

    def rounded_means(means: torch.Tensor, lo: torch.Tensor, hi_twice: torch.Tensor) -> None:  # lo = 0
        hi_twice.copy_(means.unsqueeze(-2).expand_as(hi_twice))
        lo.zero_()

    monkeypatch.setattr(map_statistics, "_split_means_into", rounded_means)
    low, high = bfloat16_maps(256, 512, 8, WindowGeometry(7, 2, 3))
    exact = cost_and_gradients(low, high, WindowGeometry(7, 2, 3), "float64")
    cost_error, gradient_errors = relative_errors(cost_and_gradients(low, high, WindowGeometry(7, 2, 3), "bf16"), exact)
    assert cost_error > 10 * FAST_COST_TOLERANCE, cost_error
    assert max(gradient_errors) > 5 * BF16_GRADIENT_TOLERANCE, gradient_errors


def test_gradients_of_the_sums_in_one_bfloat16_part_are_not_precise_enough(monkeypatch):
    """Why the backward pass splits the gradients of the sums in two parts: with the low parts dropped (one product
    fewer each), the map gradients of the first ResNet block move by more than 3x their tolerance (the two terms of
    ``dZ`` cancel to a fraction of their size)."""
    from hfmca_lightning.losses import map_statistics

    def high_parts_only(x: torch.Tensor) -> torch.Tensor:  # [hi; 0]
        return torch.stack([x.bfloat16(), torch.zeros_like(x, dtype=torch.bfloat16)])

    geometry = WindowGeometry(5, 1, 2)
    low, high = bfloat16_maps(64, 64, 32, geometry)
    exact = cost_and_gradients(low, high, geometry, "float64")
    monkeypatch.setattr(map_statistics, "_split_bfloat16", high_parts_only)
    _, gradient_errors = relative_errors(cost_and_gradients(low, high, geometry, "bf16"), exact)
    assert max(gradient_errors) > 3 * BF16_GRADIENT_TOLERANCE, gradient_errors


@pytest.mark.parametrize("geometry", [WindowGeometry(3, 1, 1), WindowGeometry(3, 2, 1), WindowGeometry(5, 2, 2)])
def test_bf16_statistics_have_the_gradients_of_their_forward(geometry):
    """The written backward pass against autograd of the same forward in float64 (float64 maps, all products exact):
    a sum's gradient in random directions, for every input."""
    torch.manual_seed(0)
    low = torch.rand(3, 6, 7, 7).bfloat16().contiguous(memory_format=torch.channels_last)
    size = geometry.output_size((7, 7))
    high = torch.rand(3, 5, *size).bfloat16().contiguous(memory_format=torch.channels_last)
    low.requires_grad_(), high.requires_grad_()
    coverage = window_coverage((7, 7), size, geometry).flatten().float()
    sums = Bfloat16Statistics.apply(low, high, coverage, geometry)
    reference = feature_map_statistics(low.double(), high.double(), geometry, precision="float64")
    expected_sums = (reference.low_outer_sum, reference.high_outer_sum, reference.cross_sum)
    for got, expected in zip(sums, expected_sums):
        # exact products of bfloat16 numbers; float32 sums of <= 3 x 49 terms in [0, 1): 2 gamma_150 ~ 1.8e-5 of the
        # magnitudes (<= 150)
        torch.testing.assert_close(got, expected, rtol=0, atol=150 * 2e-5)
    directions = [torch.randn_like(total) for total in expected_sums]
    gradients = torch.autograd.grad(sum((d * s).sum() for d, s in zip(directions, sums)), (low, high))
    low64, high64 = (x.detach().double().requires_grad_() for x in (low, high))
    reference = feature_map_statistics(low64, high64, geometry, precision="float64")
    expected_gradients = torch.autograd.grad(
        sum((d * s).sum() for d, s in zip(directions, (reference.low_outer_sum, reference.high_outer_sum,
                                                          reference.cross_sum))),
        (low64, high64),
    )  # fmt: skip
    for got, expected in zip(gradients, expected_gradients):
        # one rounding to bfloat16 (2^-8 of the element), after float32 products of two-part factors (~2^-16 of the
        # largest term, which the elements' cancellation leaves)
        bound = 2**-8 * expected.abs() + 2**-14 * expected.abs().max()
        assert bool(((got.double() - expected).abs() <= bound).all())


def test_auto_takes_bf16_for_bfloat16_maps_on_tensor_core_gpus_and_fast_elsewhere(monkeypatch):
    from hfmca_lightning.losses import block_arithmetic

    geometry = WindowGeometry(5, 1, 2)
    bf16 = torch.rand(64, 16, 8, 8).bfloat16()
    fp32 = torch.rand(64, 16, 8, 8)
    assert resolved_precision(bf16, bf16, geometry) == "fast"  # a CPU
    monkeypatch.setattr(block_arithmetic, "tensor_cores", lambda device: True)
    assert resolved_precision(bf16, bf16, geometry) == "bf16"
    assert resolved_precision(fp32, fp32, geometry) == "fast"  # tf32x3's splits cost more than they save
    wide = torch.rand(8, 16, 8, 8).bfloat16()  # K > B: each position's product larger than the map
    assert resolved_precision(wide, wide, geometry) == "fast"
    assert resolved_precision(bf16, bf16, WindowGeometry(1, 1, 1)) == "fast"  # avg_pool2d cannot take it


def test_bf16_refuses_a_window_avg_pool_cannot_take():
    maps = torch.rand(2, 3, 6, 6), torch.rand(2, 3, 8, 8)
    with pytest.raises(ValueError, match="2 \\* padding <= kernel"):
        feature_map_statistics(*maps, WindowGeometry(1, 1, 1), precision="bf16")


def test_sums_without_gradients_are_the_sums_with_them_and_unused_sums_need_no_gradient():
    """For maps that need no gradient the forward keeps only the window means' parts (no rows for a backward): the
    same sums, bit for bit. And a backward from one sum alone (the others' gradients None) is the float64 gradient
    of that sum."""
    torch.manual_seed(0)
    geometry = WindowGeometry(3, 2, 1)
    low = torch.rand(3, 6, 7, 7).bfloat16().contiguous(memory_format=torch.channels_last).requires_grad_()
    high = torch.rand(3, 5, *geometry.output_size((7, 7))).bfloat16().contiguous(memory_format=torch.channels_last)
    coverage = window_coverage((7, 7), geometry.output_size((7, 7)), geometry).flatten().float()
    with_gradients = Bfloat16Statistics.apply(low, high, coverage, geometry)
    with torch.no_grad():  # maps that need no gradient, as under no_grad: no rows for a backward
        without = Bfloat16Statistics.apply(low.detach(), high, coverage, geometry)
    assert all(torch.equal(a, b) for a, b in zip(with_gradients, without))
    (gradient,) = torch.autograd.grad(with_gradients[2].sum(), low)  # the cross sum alone; high needs none
    low64 = low.detach().double().requires_grad_()
    reference = feature_map_statistics(low64, high.double(), geometry, precision="float64").cross_sum.sum()
    (expected,) = torch.autograd.grad(reference, low64)
    bound = 2**-8 * expected.abs() + 2**-14 * expected.abs().max()  # as test_bf16_statistics_have_the_gradients_...
    assert bool(((gradient.double() - expected).abs() <= bound).all())
