import numpy as np
import pytest
import torch

from hfmca_lightning.losses import (
    CorrelationStatistics,
    WindowGeometry,
    feature_map_statistics,
    group_statistics,
    window_coverage,
)
from tests.helpers import FLOAT32_UNIT, gamma, reference_group_moments, reference_unfold_windows


def _assert_moments(stats: CorrelationStatistics, reference: tuple[np.ndarray, ...]) -> None:
    """Moments of features in [0, 1) (non-negative terms, moments <= 1) summed over at most a few thousand members in
    float64, in two orders: they differ by at most 2 gamma_n ~ n 2.2e-16 < 1e-12 relative (n <= 4,000)."""
    for got, expected in zip(stats.means(), reference):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_group_statistics_match_loops():
    torch.manual_seed(0)
    low, high = torch.rand(7, 5, 4), torch.rand(7, 3)
    stats = group_statistics(low, high)
    assert stats.low_outer_sum.dtype == torch.float64
    assert float(stats.member_count) == 35 and float(stats.group_count) == 7
    _assert_moments(stats, reference_group_moments(low, high))


def test_statistics_add_like_concatenated_batches():
    torch.manual_seed(1)
    low, high = torch.randn(10, 3, 4), torch.randn(10, 5)
    combined = group_statistics(low[:4], high[:4]) + group_statistics(low[4:], high[4:])
    # float64 sums of 30 standard-normal products in two orders: 2 gamma_30 ~ 1.3e-14 of the terms' magnitudes (~1)
    for got, expected in zip(combined.means(), group_statistics(low, high).means()):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


GEOMETRIES = [
    WindowGeometry(1, 1, 0),
    WindowGeometry(3, 1, 1),
    WindowGeometry(3, 1, 0),
    WindowGeometry(3, 2, 1),
    WindowGeometry(4, 2, 1),
    WindowGeometry(4, 1, 0),
    WindowGeometry(4, 4, 0),
    WindowGeometry(1, 2, 0),
    WindowGeometry(5, 2, 2),
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("size", [(7, 7), (8, 6)])
def test_feature_map_statistics_equal_unfolded_windows(geometry: WindowGeometry, size: tuple[int, int]):
    torch.manual_seed(2)
    low_map = torch.rand(2, 3, *size)
    high_map = torch.rand(2, 4, *geometry.output_size(size))
    stats = feature_map_statistics(low_map, high_map, geometry, precision="float64")
    members, highs, real = reference_unfold_windows(
        low_map, high_map, geometry.kernel, geometry.stride, geometry.padding
    )
    assert float(stats.group_count) == members.shape[0]
    assert float(stats.member_count) == members.shape[0] * members.shape[1]
    _assert_moments(stats, reference_group_moments(members, highs, real))


def test_window_coverage_weighs_each_position_by_the_windows_that_contain_it():
    # 5x5 input, 3x3 windows, stride 1, padding 1: a corner lies in the corner window (4 members), two edge windows
    # (6) and one inner window (9): weight 9 (1/4 + 2/6 + 1/9) = 6.25; the centre in nine windows of 9: weight 9
    coverage = window_coverage((5, 5), (5, 5), WindowGeometry(3, 1, 1))
    assert coverage[0, 0] == pytest.approx(6.25, rel=1e-15) and coverage[2, 2] == pytest.approx(9, rel=1e-15)
    # the weights sum to kernel**2 per window: R1 averages each window's member mean over the windows
    assert float(coverage.sum()) == pytest.approx(9 * 25, rel=1e-14)
    # L9 of the spectrum CNN: a 2x2 map padded to 4x4, one 4x4 window of the 4 positions: weight 16 / 4 each
    torch.testing.assert_close(
        window_coverage((2, 2), (1, 1), WindowGeometry(4, 1, 1)), torch.full((2, 2), 4.0, dtype=torch.float64)
    )
    # Stride 2 kernel 1: only every other position is ever seen.
    coverage = window_coverage((4, 4), (2, 2), WindowGeometry(1, 2, 0))
    assert coverage.sum() == 4 and coverage[0, 0] == 1 and coverage[1, 1] == 0


def test_feature_map_statistics_keep_gradients():
    low_map = torch.rand(1, 2, 4, 4, requires_grad=True)
    high_map = torch.rand(1, 3, 4, 4, requires_grad=True)
    stats = feature_map_statistics(low_map, high_map, WindowGeometry(3, 1, 1))
    (stats.low_outer_sum.sum() + stats.cross_sum.sum()).backward()
    assert low_map.grad is not None and high_map.grad is not None
    assert low_map.grad.abs().sum() > 0 and high_map.grad.abs().sum() > 0


def test_statistics_are_float64_under_bf16_autocast():
    low, high = torch.rand(4, 3, 8).bfloat16(), torch.rand(4, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stats = group_statistics(low, high)
    assert stats.low_outer_sum.dtype == torch.float64
    expected = group_statistics(low.double(), high.double())
    torch.testing.assert_close(stats.cross_sum, expected.cross_sum, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("low", "high", "message"),
    [
        (torch.rand(4, 8), torch.rand(4, 8), r"shape \(M, L, K1\)"),
        (torch.rand(4, 3, 8), torch.rand(4, 2, 8), r"shape \(M, K2\)"),
        (torch.rand(4, 3, 8), torch.rand(5, 8), "same groups"),
    ],
)
def test_group_statistics_reject_malformed_shapes(low, high, message):
    with pytest.raises(ValueError, match=message):
        group_statistics(low, high)


def test_feature_map_statistics_reject_empty_maps():
    for low, high in (
        (torch.rand(0, 2, 8, 8), torch.rand(0, 2, 8, 8)),
        (torch.rand(1, 0, 8, 8), torch.rand(1, 2, 8, 8)),
    ):
        with pytest.raises(ValueError, match="at least one map with channels and positions"):
            feature_map_statistics(low, high, WindowGeometry(3, 1, 1))


def test_feature_map_statistics_reject_a_geometry_that_does_not_fit():
    with pytest.raises(ValueError, match="does not describe this block"):
        feature_map_statistics(torch.rand(1, 2, 8, 8), torch.rand(1, 2, 8, 8), WindowGeometry(3, 2, 1))


# ResNet-18's BasicBlock shapes (channels in, channels out, map side, window) and the spectrum CNN's first block.
REALISTIC_BLOCKS = pytest.mark.parametrize(
    ("k1", "k2", "size", "geometry"),
    [
        (64, 64, 32, WindowGeometry(5, 1, 2)),
        (64, 128, 32, WindowGeometry(7, 2, 3)),
        (128, 256, 16, WindowGeometry(7, 2, 3)),
        (256, 512, 8, WindowGeometry(7, 2, 3)),
        (64, 64, 34, WindowGeometry(3, 1, 1)),
    ],
    ids=["layer1 block", "layer2 stride-2 block", "layer3 stride-2 block", "layer4 stride-2 block", "spectrum block"],
)


def realistic_pair(
    batch: int, k1: int, k2: int, size: int, geometry: WindowGeometry, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ResNet-like block input (post-ReLU) and a sigmoid output map, correlated through a 1x1 mixing."""
    torch.manual_seed(seed)
    low = torch.relu(torch.randn(batch, k1, size, size))
    mixed = torch.nn.functional.avg_pool2d(
        low, geometry.kernel, geometry.stride, geometry.padding, count_include_pad=False
    )
    high = torch.sigmoid(
        torch.einsum("bkhw,kl->blhw", mixed, torch.randn(k1, k2) / k1**0.5)
        + 0.3 * torch.randn(batch, k2, *mixed.shape[-2:])
    )
    return low.requires_grad_(), high.contiguous().requires_grad_()  # (einsum leaves its output channels-last)


FAST_COST_TOLERANCE = 1e-5  # docs/conventions.md §3: the fast path's stated agreement with float64, relative
FAST_GRADIENT_TOLERANCE = 5e-5


def _fast_against_float64(low: torch.Tensor, high: torch.Tensor, geometry: WindowGeometry, reg: float) -> None:
    """The stated guarantee, not a rounding bound: cost and gradients of the fast path against the float64 path."""
    from hfmca_lightning.losses import cost_from_statistics

    results = {}
    for precision in ("float64", "fast"):
        cost = cost_from_statistics(feature_map_statistics(low, high, geometry, precision=precision), reg=reg)
        results[precision] = (cost.item(), *torch.autograd.grad(cost, (low, high)))
    exact, fast = results["float64"], results["fast"]
    assert abs(fast[0] - exact[0]) <= FAST_COST_TOLERANCE * abs(exact[0])
    for got, expected in zip(fast[1:], exact[1:]):
        assert float((got.double() - expected.double()).norm() / expected.double().norm()) <= FAST_GRADIENT_TOLERANCE


@REALISTIC_BLOCKS
@pytest.mark.parametrize(
    "layout", [torch.contiguous_format, torch.channels_last], ids=["plain maps", "channels-last maps"]
)
def test_fast_statistics_agree_with_float64_on_realistic_maps(k1, k2, size, geometry, layout):
    """The training setting (lambda = 0.1, ResNet-shaped post-ReLU maps): float32 products summed in float64, deep maps
    centred, channels-last maps on their rows."""
    low, high = (
        x.detach().contiguous(memory_format=layout).requires_grad_()
        for x in realistic_pair(18, k1, k2, size, geometry, seed=k1 + size)
    )
    _fast_against_float64(low, high, geometry, reg=0.1)


@pytest.mark.parametrize(
    ("size", "geometry"),
    [
        (34, WindowGeometry(3, 1, 1)),
        (17, WindowGeometry(3, 1, 1)),
        (4, WindowGeometry(3, 1, 1)),
        (2, WindowGeometry(4, 1, 1)),
    ],
    ids=["L1", "L3", "L7", "L9"],
)
@pytest.mark.parametrize(
    "layout", [torch.contiguous_format, torch.channels_last], ids=["plain maps", "channels-last maps"]
)
def test_fast_statistics_agree_with_float64_at_the_spectrum_setting(size, geometry, layout):
    """The spectrum-analysis setting (lambda = 1e-3, the spectrum CNN's sigmoid maps of 64 channels, batch 32), where
    the regularisation no longer masks the float32 rounding of near-0.5 sigmoid values: the same stated tolerance."""
    torch.manual_seed(size)
    low = torch.sigmoid(torch.randn(32, 64, size, size))
    means = torch.nn.functional.avg_pool2d(
        low, geometry.kernel, geometry.stride, geometry.padding, count_include_pad=False
    )
    mixed = torch.einsum("bkhw,kl->blhw", 4 * (means - 0.5), torch.randn(64, 64) / 8)
    high = torch.sigmoid(mixed + 0.5 * torch.randn_like(mixed)).contiguous()
    low, high = (x.contiguous(memory_format=layout).requires_grad_() for x in (low, high))
    _fast_against_float64(low, high, geometry, reg=1e-3)


@pytest.mark.parametrize(
    "layout", [torch.contiguous_format, torch.channels_last], ids=["plain maps", "channels-last maps"]
)
def test_fast_statistics_make_no_copy_of_a_large_map(layout):
    """The fast path uses a float32 map as it is, plain or channels-last: no op of it copies the map into another
    layout or dtype (the float64 path makes several); deep layers (few positions, many channels) may copy their
    small maps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__ in ("clone.default", "_to_copy.default", "constant_pad_nd.default"):
                self.sizes.append(out.numel())
            return out

    geometry = WindowGeometry(5, 1, 2)
    low, high = (x.contiguous(memory_format=layout) for x in realistic_pair(4, 16, 16, 32, geometry, seed=0))
    map_size = low[0].numel()
    with Copies() as fast:
        feature_map_statistics(low.detach(), high.detach(), geometry, precision="fast")
    with Copies() as exact:
        feature_map_statistics(low.detach(), high.detach(), geometry, precision="float64")
    assert max(exact.sizes) >= low.numel()
    assert not fast.sizes or max(fast.sizes) < map_size, fast.sizes


@pytest.mark.parametrize(
    "layout", [torch.contiguous_format, torch.channels_last], ids=["plain maps", "channels-last maps"]
)
def test_chunks_of_images_give_the_sums_and_gradients_of_one_chunk(layout, monkeypatch):
    """On CPUs the early blocks' statistics run over chunks of images (32 MiB; a large batch has several): with
    chunks of two images and an odd batch (a short last chunk) the sums and gradients are those of one chunk, up to
    the order of float32 summation.

    Tolerance: chunking changes which rows a float32 product sums (at most 1,024 rows per block, plus 25 window
    members), so the two results differ by at most ``2 gamma_n`` (n = 1,100) times the sum of the terms' magnitudes.
    That sum is computed in float64 with the magnitudes of every input (the maps are non-negative; the weights
    taken as ``|w|``), times 3 for the window means' shift by a constant no larger than the largest mean."""
    from hfmca_lightning.losses import map_statistics

    geometry = WindowGeometry(5, 1, 2)
    low, high = (x.detach().contiguous(memory_format=layout) for x in realistic_pair(5, 8, 8, 16, geometry, seed=3))
    assert bool((low >= 0).all()) and bool((high >= 0).all())
    weights = [torch.randn(8, 8, dtype=torch.float64) for _ in range(3)]

    def sums_and_gradients(weights, precision="fast", dtype=torch.float32) -> list[torch.Tensor]:
        z, h = low.to(dtype).clone().requires_grad_(), high.to(dtype).clone().requires_grad_()
        stats = feature_map_statistics(z, h, geometry, precision=precision)
        sums = (stats.low_outer_sum, stats.high_outer_sum, stats.cross_sum)
        sum((s * w).sum() for s, w in zip(sums, weights)).backward()
        return [*(s.detach() for s in sums), z.grad.double(), h.grad.double()]

    whole = sums_and_gradients(weights)
    magnitudes = sums_and_gradients([w.abs() for w in weights], "float64", torch.float64)
    monkeypatch.setattr(map_statistics, "_CPU_CHUNK_BYTES", 2 * low[0].numel() * 4)
    assert len(map_statistics._image_chunks(5, low)) == 3
    bound = 2 * gamma(1_100, FLOAT32_UNIT) * 3
    for got, expected, magnitude in zip(sums_and_gradients(weights), whole, magnitudes):
        assert bool(((got - expected).abs() <= bound * magnitude).all())


def test_centred_float32_products_keep_the_precision_a_plain_float32_product_loses():
    """Deep maps are multiplied over thousands of positions at once: with a large common mean (post-ReLU
    features) a plain float32 sum loses digits that the dependence needs; shifting by the means first and
    adding the mean terms in float64 keeps every sum within float32 rounding of the centred moments."""
    from hfmca_lightning.losses.block_arithmetic import BlockArithmetic
    from hfmca_lightning.losses.map_statistics import CentredRowStatistics, float64_statistics
    from hfmca_lightning.losses.window_pooling import window_band

    torch.manual_seed(0)
    geometry = WindowGeometry(3, 1, 1)
    z = 50.0 + torch.randn(512, 64, 4, 4)
    h = 50.0 + 0.5 * z[:, :32] + torch.randn(512, 32, 4, 4)
    coverage = window_coverage((4, 4), (4, 4), geometry)
    rows = window_band(4, geometry, z)
    windows = BlockArithmetic(geometry, rows, rows, "banded")
    shifted = CentredRowStatistics.apply(z, h, coverage.float().flatten(), windows)
    exact = float64_statistics(z.double(), h.double(), coverage, geometry)
    plain = float64_statistics(z, h, coverage.float(), geometry)  # the same sums in float32

    # the scale of the dependence: the moments of the maps centred by their channel means
    def centred(x):
        return (x - x.mean((0, 2), keepdim=True)).double()

    means = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(z, (1, 1, 1, 1)), 3, 1).flatten(2)
    zc, hc, mc = centred(z.flatten(2)), centred(h.flatten(2)), centred(means)
    scales = (
        torch.einsum("bkn,bln->kl", zc * coverage.flatten(), zc),
        torch.einsum("bkn,bln->kl", hc, hc),
        torch.einsum("bkn,bln->kl", mc, hc),
    )
    errors = [
        float((got - expected).abs().max() / scale.abs().max()) for got, expected, scale in zip(shifted, exact, scales)
    ]
    lost = [
        float((got.double() - expected).abs().max() / scale.abs().max())
        for got, expected, scale in zip(plain, exact, scales)
    ]
    assert all(got.dtype == torch.float64 for got in shifted)
    # Both are float32 products over the same 8,192 rows, so their rounding errors scale with the magnitudes of the
    # summed terms: about 50^2 for the plain sums of squares against about 1 once centred. Measured ratios are
    # ~1,000 (low) and ~4,000 (high); the bound asks for 100.
    assert errors[0] < lost[0] / 100 and errors[1] < lost[1] / 100, (errors, lost)
    # The cross sum's window means keep a larger spread once centred (the zero padding of a 4 x 4 map makes the
    # border windows' means 4/9 to 6/9 of the interior's), so centring gains less there (measured ~2.4x).
    assert errors[2] < lost[2] / 2, (errors, lost)


@pytest.mark.parametrize("pooling", ["banded", "avg_pool"])
@pytest.mark.parametrize("path", ["per image", "centred rows", "channels last"])
@pytest.mark.parametrize("geometry", [WindowGeometry(3, 1, 1), WindowGeometry(3, 2, 1), WindowGeometry(5, 2, 2)])
def test_map_statistics_have_the_gradients_of_their_forward(geometry, path, pooling):
    """The fast path writes its own backward pass (one accumulating product per map, from the kept window
    means or shifted rows): numerical gradients of all three sums agree with it in float64, for the per-image
    products (early layers), the centred products over all rows (deep layers) and the products on the rows
    of channels-last maps, with window means from banded products (CPUs) and from ``avg_pool2d`` and its
    backward (GPUs)."""
    from hfmca_lightning.losses.block_arithmetic import BlockArithmetic
    from hfmca_lightning.losses.map_statistics import (
        CentredRowStatistics,
        ChannelsLastStatistics,
        PerImageStatistics,
        is_per_image,
    )
    from hfmca_lightning.losses.window_pooling import window_band

    torch.manual_seed(0)
    channels = (40, 50) if path == "centred rows" else (2, 3)
    layout = torch.channels_last if path == "channels last" else torch.contiguous_format
    low = torch.rand(2, channels[0], 6, 6, dtype=torch.float64).contiguous(memory_format=layout).requires_grad_()
    size = geometry.output_size((6, 6))
    high = torch.rand(2, channels[1], *size, dtype=torch.float64).contiguous(memory_format=layout).requires_grad_()
    assert is_per_image(high) == (path != "centred rows")
    coverage = window_coverage((6, 6), size, geometry).flatten()
    windows = BlockArithmetic(geometry, window_band(6, geometry, low), window_band(6, geometry, low), pooling)
    statistics = {
        "per image": PerImageStatistics,
        "centred rows": CentredRowStatistics,
        "channels last": ChannelsLastStatistics,
    }[path]
    # gradcheck over the 3,000 inputs of the deep case is slow: one random direction per output there
    assert torch.autograd.gradcheck(
        lambda z, h: statistics.apply(z, h, coverage, windows), (low, high), fast_mode=path == "centred rows"
    )
    # and its forward is the reference statistics
    stats = CorrelationStatistics(*statistics.apply(low, high, coverage, windows), torch.tensor(1.0), torch.tensor(1.0))
    reference = feature_map_statistics(low, high, geometry, precision="float64")
    for got, expected in zip(
        (stats.low_outer_sum, stats.high_outer_sum, stats.cross_sum),
        (reference.low_outer_sum, reference.high_outer_sum, reference.cross_sum),
    ):
        # float64 sums of products of rand maps (non-negative, <= 1) over 2 x 36 positions, by other formulas
        # (centred rows, per image): 2 gamma_n of the magnitudes, n <= 72 x 25: ~4e-13
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_cached_window_constants_first_made_under_inference_mode_serve_training():
    """A block's coverage and band matrices are made once per shape and device and cached; made first under
    inference mode (Lightning's validation), they still serve a training pass that saves them for backward."""
    geometry = WindowGeometry(kernel=3, stride=1, padding=1)
    size = (5, 7)  # a shape no other test uses, so the cache starts empty for it
    with torch.inference_mode():
        feature_map_statistics(torch.rand(2, 3, *size), torch.rand(2, 4, *size), geometry)
    low = torch.rand(2, 3, *size, requires_grad=True)
    stats = feature_map_statistics(low, torch.rand(2, 4, *size), geometry)
    (stats.cross_sum.sum() + stats.low_outer_sum.sum()).backward()
    assert low.grad is not None and bool(low.grad.abs().sum() > 0)


def test_float32_products_set_tf32_for_cuda_work_only(monkeypatch):
    """TF32 is switched off (``fast``) or on (``tf32``), and restored, for CUDA work; work on other devices never asks
    the CUDA driver (``torch.cuda.is_available()`` retries the driver on each call on a GPU-less machine, ~1 ms in a
    step)."""
    from hfmca_lightning.losses.block_arithmetic import float32_products

    def no_driver_calls() -> bool:
        raise AssertionError("the CPU path asked the CUDA driver")

    monkeypatch.setattr(torch.cuda, "is_available", no_driver_calls)
    z_map = torch.rand(3, 4, 6, 6, requires_grad=True)
    h_map = torch.rand(3, 5, 6, 6, requires_grad=True)
    for precision in ("fast", "tf32x3"):
        stats = feature_map_statistics(z_map, h_map, WindowGeometry(3, 1, 1), precision=precision)
        sum(s.sum() for s in (stats.low_outer_sum, stats.high_outer_sum, stats.cross_sum)).backward()

    # Users set TF32 with torch.set_float32_matmul_precision or, on torch >= 2.9, the new fp32_precision flags; a
    # read of the legacy allow_tf32 then raises where the two APIs disagree (the global flag "tf32", the matmul flag
    # "none"), so the statistics must use the new flag wherever it exists.
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")

    def tf32_on() -> bool:
        return matmul.fp32_precision == "tf32" if new_api else matmul.allow_tf32

    def global_tf32_flag() -> None:
        torch.backends.fp32_precision = "tf32"
        matmul.fp32_precision = "none"

    user_settings = [lambda: torch.set_float32_matmul_precision("high")]
    user_settings.append(lambda: torch.set_float32_matmul_precision("highest"))
    if new_api:
        user_settings.append(global_tf32_flag)
    saved = (torch.get_float32_matmul_precision(), getattr(torch.backends, "fp32_precision", None))
    try:
        for set_by_user in user_settings:
            set_by_user()
            user_setting = tf32_on()
            with float32_products(torch.device("cpu"), tf32=not user_setting):
                assert tf32_on() == user_setting
            with float32_products(torch.device("cuda")):
                assert not tf32_on()
                if set_by_user is not global_tf32_flag:  # the legacy flag agrees (TunableOp reads it)
                    assert not matmul.allow_tf32
            with float32_products(torch.device("cuda"), tf32=True):
                assert tf32_on()
                if set_by_user is not global_tf32_flag:
                    assert matmul.allow_tf32
            assert tf32_on() == user_setting
    finally:
        if saved[1] is not None:
            torch.backends.fp32_precision = saved[1]
        torch.set_float32_matmul_precision(saved[0])


@pytest.mark.parametrize(
    ("k1", "k2", "size", "geometry"),
    [
        (16, 16, 32, WindowGeometry(5, 1, 2)),
        (16, 32, 16, WindowGeometry(7, 2, 3)),
        (64, 128, 4, WindowGeometry(3, 1, 1)),
    ],
    ids=["per-image block", "stride-2 block", "deep block (centred rows)"],
)
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["plain", "channels-last"])
def test_window_means_by_avg_pool_equal_the_banded_products(k1, k2, size, geometry, layout):
    """GPUs take window means by ``avg_pool2d`` (and its backward for the adjoint), CPUs by banded products: the sums
    and the maps' gradients of both agree in float32 on every path.

    Tolerance: only the window means differ (a sum of at most ``kernel**2`` members then a division, against
    products with ``1 / n`` weights): ``gamma_{k^2 + 1}`` of the means' magnitudes each; the products that follow
    are the same float32 operations on inputs that differ by that, plus their own rounding in either order,
    ``2 gamma_n`` (n <= 1,100 rows per block): in all ``(2 gamma_{k^2+1} + 2 gamma_n)`` of the terms' magnitudes,
    which the sums of magnitudes below bound."""
    low, high = (
        x.detach().contiguous(memory_format=layout).requires_grad_()
        for x in realistic_pair(6, k1, k2, size, geometry, seed=size)
    )
    results = {}
    for pooling in ("banded", "avg_pool"):
        stats = feature_map_statistics(low, high, geometry, window_pooling=pooling)
        sums = (stats.low_outer_sum, stats.high_outer_sum, stats.cross_sum)
        torch.manual_seed(1)
        weights = [torch.randn_like(total) for total in sums]  # a fixed direction for the gradients
        objective = sum((w * total).sum() for w, total in zip(weights, sums))
        results[pooling] = ([total.detach() for total in sums], torch.autograd.grad(objective, (low, high)))
    absolute = [x.detach().abs().double().requires_grad_() for x in (low, high)]
    magnitudes = feature_map_statistics(*absolute, geometry, precision="float64")
    magnitude_sums = (magnitudes.low_outer_sum, magnitudes.high_outer_sum, magnitudes.cross_sum)
    epsilon = 2 * gamma(geometry.kernel**2 + 1, FLOAT32_UNIT) + 2 * gamma(1_100, FLOAT32_UNIT)
    for banded, pooled, magnitude in zip(results["banded"][0], results["avg_pool"][0], magnitude_sums):
        assert bool(((banded - pooled).abs() <= epsilon * magnitude).all())
    # Gradients: the backward pass's products are linear in the weights with the maps as coefficients, so the same
    # pass on the magnitudes (float64) bounds each element's terms; the adjoint pooling adds its own gamma_{k^2+1}.
    gradient_magnitudes = torch.autograd.grad(
        sum((w.abs().double() * total).sum() for w, total in zip(weights, magnitude_sums)), absolute
    )
    for banded, pooled, magnitude in zip(results["banded"][1], results["avg_pool"][1], gradient_magnitudes):
        assert bool(((banded - pooled).abs() <= 2 * epsilon * magnitude).all())


def test_banded_window_means_are_unbiased_in_float32():
    """Rounded, the weights 1/n of a window do not sum to 1 (3 fl(1/3) = 1 + 3e-8), which scales every window mean
    alike; the trivial eigenvalue near 1 amplifies that bias. Each window's float32 weights sum to exactly 1, and on
    post-ReLU maps with a large common mean at a small regulariser the banded float32 cost stays within the fast
    path's stated 1e-5 of float64 (with the biased weights: 1.8e-5; the float32 sums alone: a few 1e-6)."""
    from hfmca_lightning.losses import cost_from_statistics
    from hfmca_lightning.losses.window_pooling import window_band

    for geometry in (WindowGeometry(3, 1, 1), WindowGeometry(7, 2, 3), WindowGeometry(5, 1, 2)):
        band = window_band(16, geometry, torch.empty(0))
        assert bool((band.double().sum(dim=1) == 1).all())
    torch.manual_seed(0)
    geometry = WindowGeometry(3, 1, 1)
    z = torch.relu(torch.randn(32, 64, 16, 16, dtype=torch.float64) + 5.0)
    weights = torch.randn(64, 64, 3, 3, dtype=torch.float64) / (64 * 3)
    h = torch.relu(torch.nn.functional.conv2d(z, weights, padding=1) + 5.0) + 0.1 * torch.rand(32, 64, 16, 16)
    z, h = z.float(), h.float()
    exact = feature_map_statistics(z.double(), h.double(), geometry, precision="float64")
    exact_cost = float(cost_from_statistics(exact, reg=1e-3))
    banded = feature_map_statistics(z, h, geometry, precision="fast", window_pooling="banded")
    assert abs(float(cost_from_statistics(banded, reg=1e-3)) / exact_cost - 1) < 1e-5
