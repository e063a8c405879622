"""BatchedViewAugmentation: torchvision's view distribution, drawn per view in whole-batch tensor operations, its
random numbers from each sample's seed (CounterUniforms): distributions are checked over many random seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from torchvision.transforms import RandomResizedCrop

from hfmca_lightning.data import SyntheticShapes, batched_augment
from hfmca_lightning.data.batched_augment import BatchedViewAugmentation, jitter_views, sample_crop_boxes
from hfmca_lightning.data.counter_random import CounterUniforms
from hfmca_lightning.data.transforms import SOLARIZE_THRESHOLD, RandomGaussianBlur, ViewAugmentation, view_transform
from tests.helpers import ks_critical, proportion_tolerance

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
N = 4000
# Tolerances. Distributions: the KS statistic against its critical value at alpha = 1e-4 (ks_critical); fractions of
# N draws within 5 standard deviations (proportion_tolerance). Pixels: float32 operations on values in [0, 1], each
# rounding at most 2^-24; 1e-6 allows a few of them, 1e-5 the dozen of a colour-space round trip whose formulas
# differ from torchvision's (divisions by chroma in HSV). Pixel statistics of two pipelines (per-channel mean and std
# over 800 views): 5 standard errors of their difference, each pipeline's estimated from the spread of its views
# within each image (~0.02 for the means: random crops spread a view's mean by ~0.5 normalised, not the ~0.3 once
# assumed here), plus, against torchvision's views, the bias of its uint8 blends, which truncate after every jitter
# step (0.01-0.03 darker): about 0.15 for the means at 800 views.
TRUNCATION = 0.03


def random_seeds(count: int, seed: int) -> torch.Tensor:
    """``count`` sample seeds as the sampler draws them (uniform in ``[0, 2**62)``), from a generator seeded
    ``seed``."""
    return torch.randint(0, 2**62, (count,), generator=torch.Generator().manual_seed(seed))


def standard_errors(views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard errors of the per-channel pixel mean and std of ``views (images, per image, C, H, W)``, from the
    spread of per-view quantities within each image (the images' own differences, the same in both pipelines, drop
    out): the view's mean for the mean; for the variance (delta method) the view's mean square less ``2 mu`` times
    its mean, and the std's error is the variance's over ``2 std``."""
    count = views.shape[0] * views.shape[1]
    view_means, view_squares = views.mean(dim=(3, 4)), (views**2).mean(dim=(3, 4))  # (images, per image, C)
    mean, std = views.mean(dim=(0, 1, 3, 4)), views.transpose(0, 2).flatten(1).std(dim=1)
    mean_error = (view_means.var(dim=1).mean(dim=0) / count).sqrt()
    variance_error = ((view_squares - 2 * mean * view_means).var(dim=1).mean(dim=0) / count).sqrt()
    return mean_error, variance_error / (2 * std)


def assert_same_pixel_statistics(got: torch.Tensor, expected: torch.Tensor, bias: float) -> None:
    """``got`` and ``expected`` (images, per image, C, H, W) have per-channel pixel means and stds within ``bias``
    plus 5 standard errors of their difference."""
    (got_mean, got_std), (expected_mean, expected_std) = standard_errors(got), standard_errors(expected)
    for statistic, got_error, expected_error in (
        (lambda views: views.flatten(0, 1).mean(dim=(0, 2, 3)), got_mean, expected_mean),
        (lambda views: views.flatten(0, 1).std(dim=(0, 2, 3)), got_std, expected_std),
    ):
        tolerance = bias + 5 * (got_error**2 + expected_error**2).sqrt()
        difference = (statistic(got) - statistic(expected)).abs()
        assert bool((difference <= tolerance).all()), (difference, tolerance)


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic of ``a`` and ``b``, as a fraction of its critical value at
    alpha = 1e-4 for their sizes (``ks_critical``): below 1 when they look drawn from one distribution."""
    grid = np.sort(np.concatenate([a, b]))
    statistic = float(
        np.abs(
            np.searchsorted(np.sort(a), grid, "right") / len(a) - np.searchsorted(np.sort(b), grid, "right") / len(b)
        ).max()
    )
    return statistic / ks_critical(len(a), len(b))


@pytest.mark.parametrize(
    ("size", "scale", "ratio"),
    [
        ((32, 32), (0.08, 1.0), (3 / 4, 4 / 3)),
        ((24, 40), (0.5, 1.0), (3 / 4, 4 / 3)),
        ((32, 32), (0.2, 1.0), (1.0, 1.0)),
    ],
)
def test_crop_boxes_have_the_distribution_of_torchvision(size, scale, ratio):
    torch.manual_seed(0)  # torchvision's draws
    height, width = size
    boxes = sample_crop_boxes(N, height, width, scale, ratio, CounterUniforms(random_seeds(N, 0), 1)).numpy()
    image = torch.zeros(3, height, width)
    cpu = np.array([RandomResizedCrop.get_params(image, list(scale), list(ratio)) for _ in range(N)], dtype=float)
    for column, what in ((2, "height"), (3, "width"), (0, "top"), (1, "left")):
        assert ks_statistic(boxes[:, column], cpu[:, column]) < 1, what
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 0] + boxes[:, 2] <= height).all()
    assert (boxes[:, 1] >= 0).all() and (boxes[:, 1] + boxes[:, 3] <= width).all()
    assert np.array_equal(boxes, np.round(boxes))


def test_crop_boxes_fall_back_to_torchvisions_centre_crop_when_no_try_fits():
    ratio = (10.0, 20.0)  # no box of this aspect fits a 32 x 32 image with area >= 0.5
    boxes = sample_crop_boxes(50, 32, 32, (0.5, 1.0), ratio, uniforms=CounterUniforms(random_seeds(50, 1), 1))
    expected = RandomResizedCrop.get_params(torch.zeros(3, 32, 32), [0.5, 1.0], list(ratio))
    assert boxes.tolist() == [list(map(float, expected))] * 50


def test_crop_and_flip_resample_the_box():
    images = torch.randint(0, 256, (1, 3, 16, 16), dtype=torch.uint8)
    source = images.float() / 255
    whole = torch.tensor([[0.0, 0.0, 16.0, 16.0], [0.0, 0.0, 16.0, 16.0]], dtype=torch.float64)
    grid = batched_augment._crop_grid(whole, torch.tensor([False, True]), 16, 16, 16)
    views = torch.nn.functional.grid_sample(
        source.expand(2, -1, -1, -1), grid, mode="bilinear", padding_mode="border", align_corners=False
    )
    torch.testing.assert_close(views[0], source[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(views[1], source[0].flip(-1), rtol=0, atol=1e-6)
    # an 8 x 8 box at (4, 2) enlarged to 16 x 16 is torchvision's bilinear resized crop (inside the box's border)
    box = torch.tensor([[4.0, 2.0, 8.0, 8.0]], dtype=torch.float64)
    grid = batched_augment._crop_grid(box, torch.tensor([False]), 16, 16, 16)
    view = torch.nn.functional.grid_sample(source, grid, mode="bilinear", padding_mode="border", align_corners=False)[0]
    expected = TF.resized_crop(source[0], 4, 2, 8, 8, [16, 16], antialias=False)
    torch.testing.assert_close(view[:, 1:-1, 1:-1], expected[:, 1:-1, 1:-1], rtol=0, atol=1e-5)


def test_jitter_is_torchvisions_colour_jitter_in_each_views_order():
    torch.manual_seed(2)
    count = 48
    views = torch.rand(count, 3, 8, 8)
    factors = torch.empty(count, 3).uniform_(0.6, 1.4)
    factors[:5] = 1.0  # views the jitter's coin skipped
    hue = torch.empty(count).uniform_(-0.1, 0.1)
    hue[:5] = 0.0
    order = torch.rand(count, 4).argsort(dim=1)
    expected = []
    for view in range(count):
        image = views[view]
        for operation in order[view].tolist():
            if operation == 0:
                image = TF.adjust_brightness(image, float(factors[view, 0]))
            elif operation == 1:
                image = TF.adjust_contrast(image, float(factors[view, 1]))
            elif operation == 2:
                image = TF.adjust_saturation(image, float(factors[view, 2]))
            else:
                image = TF.adjust_hue(image, float(hue[view]))
        expected.append(image)
    got = jitter_views(views, factors, hue, order)
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=1e-5)
    assert torch.equal(got[:5], views[:5])


def test_jitter_parameters_and_order_are_drawn_per_view(monkeypatch):
    """SimCLR's jitter (0.4, 0.4, 0.4, 0.1) with p 0.8: factors uniform in [0.6, 1.4], hue in [-0.1, 0.1], skipped
    views unchanged (factors 1, hue 0), every one of the 24 orders about equally often."""
    seen = {}

    def spy(views, factors, hue_shift, order, select_rows=None):
        seen.update(factors=factors, hue=hue_shift, order=order)
        return views

    monkeypatch.setattr(batched_augment, "jitter_views", spy)
    torch.manual_seed(3)
    augmentation = BatchedViewAugmentation(ViewAugmentation.from_strengths(8), MEAN, STD)
    images = torch.randint(0, 256, (N // 4, 3, 8, 8), dtype=torch.uint8)
    augmentation.views_from_seeds(images, random_seeds(N // 4, 3), num_views=4)
    factors, hue, order = seen["factors"].numpy(), seen["hue"].numpy(), seen["order"]
    applied = factors[:, 0] != 1.0
    assert applied.mean() == pytest.approx(0.8, abs=proportion_tolerance(0.8, len(applied)))
    assert (hue[~applied] == 0).all() and (factors[~applied] == 1).all()
    uniform = np.random.default_rng(0).uniform(0.6, 1.4, N)
    for column in range(3):
        assert ks_statistic(factors[applied, column], uniform) < 1
    assert ks_statistic(hue[applied], np.random.default_rng(1).uniform(-0.1, 0.1, N)) < 1
    counts = np.unique(order.numpy(), axis=0, return_counts=True)[1]
    assert len(counts) == 24 and counts.min() > N / 24 * 0.7


def test_greyscale_blur_and_solarisation_follow_each_views_kind(monkeypatch):
    """BYOL's two view kinds: kind 0 always blurred, never solarised; kind 1 blurred with p 0.1, solarised with p 0.2.
    Sigma is uniform in [0.1, 2]; a blurred view is torchvision's Gaussian blur with the view's sigma;
    solarisation inverts values >= 128/255."""
    spec = ViewAugmentation.from_strengths(
        16,
        crop_strength=0,
        color_strength=0,
        gray_strength=0,
        horizontal_flip=False,
        blur=(1.0, 0.1),
        solarize=(0.0, 0.2),
    )
    augmentation = BatchedViewAugmentation(spec, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    sigmas = []
    blur = batched_augment._gaussian_blur
    monkeypatch.setattr(
        batched_augment,
        "_gaussian_blur",
        lambda views, sigma, kernel: sigmas.append(sigma) or blur(views, sigma, kernel),
    )
    torch.manual_seed(4)
    images = torch.randint(0, 256, (2000, 3, 16, 16), dtype=torch.uint8)
    seeds = random_seeds(2000, 4)
    views = augmentation.views_from_seeds(images, seeds, num_views=2)
    (sigma,) = sigmas
    kind0, kind1 = sigma.view(-1, 2).unbind(dim=1)
    assert (kind0 > 0).all()
    assert (kind1 > 0).float().mean().item() == pytest.approx(0.1, abs=proportion_tolerance(0.1, len(kind1)))
    assert ks_statistic(kind0.numpy(), np.random.default_rng(2).uniform(0.1, 2.0, 2000)) < 1
    source = images.float() / 255
    unblurred = kind1 == 0
    solarised = torch.isclose(
        views[:, 1], torch.where(source >= SOLARIZE_THRESHOLD / 255, 1 - source, source), atol=1e-5
    ).all(dim=(1, 2, 3))
    untouched = torch.isclose(views[:, 1], source, atol=1e-5).all(dim=(1, 2, 3))
    count = int(unblurred.sum())
    assert solarised[unblurred].float().mean().item() == pytest.approx(0.2, abs=proportion_tolerance(0.2, count))
    assert untouched[unblurred].float().mean().item() == pytest.approx(0.8, abs=proportion_tolerance(0.8, count))
    assert not torch.isclose(views[:, 0], 1 - source, atol=1e-5).all(dim=(1, 2, 3)).any()  # kind 0 never solarised
    sigma = torch.tensor([0.7, 1.9])
    blurred = batched_augment._gaussian_blur(source[:2], sigma, spec.blur_kernel)
    for index in range(2):
        expected = TF.gaussian_blur(source[index], [spec.blur_kernel, spec.blur_kernel], [float(sigma[index])] * 2)
        torch.testing.assert_close(blurred[index], expected, rtol=0, atol=1e-5)
    grey_spec = ViewAugmentation.from_strengths(
        8, crop_strength=0, color_strength=0, gray_strength=1.0, horizontal_flip=False
    )
    grey_views = BatchedViewAugmentation(grey_spec, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)).views_from_seeds(
        images[:200, :, :8, :8], seeds[:200], num_views=1
    )[:, 0]
    is_grey = (grey_views[:, 0] == grey_views[:, 1]).all(dim=(1, 2)) & (grey_views[:, 1] == grey_views[:, 2]).all(
        dim=(1, 2)
    )
    assert is_grey.float().mean().item() == pytest.approx(
        grey_spec.gray_p, abs=proportion_tolerance(grey_spec.gray_p, 200)
    )


def test_views_have_the_pixel_statistics_of_the_cpu_views_and_each_its_own_parameters():
    torch.manual_seed(5)  # the CPU views
    images = SyntheticShapes(num_classes=4, train_per_class=1).split(True).images  # (4, 3, 32, 32) uint8
    spec = ViewAugmentation.from_strengths(32)
    cpu_transform = view_transform(spec, MEAN, STD)
    cpu = torch.stack([cpu_transform(image) for image in images for _ in range(200)])
    batched = BatchedViewAugmentation(spec, MEAN, STD).views_from_seeds(images, random_seeds(4, 5), num_views=200)
    assert batched.shape == (4, 200, 3, 32, 32) and batched.dtype == torch.float32
    assert_same_pixel_statistics(batched, cpu.view(4, 200, 3, 32, 32), TRUNCATION)
    flat = batched.flatten(0, 1)
    assert len({tuple(row.tolist()) for row in flat.flatten(1)}) == len(flat)  # every view its own parameters


def test_bad_input_is_one_clear_error():
    augmentation = BatchedViewAugmentation(ViewAugmentation.from_strengths(8), MEAN, STD)
    with pytest.raises(ValueError, match=r"uint8 \(B, C, H, W\)"):
        augmentation.views_from_seeds(torch.rand(2, 3, 8, 8), torch.tensor([1, 2]), num_views=2)
    with pytest.raises(ValueError, match=r"need one seed per image: 2 images, seeds of shape \(3,\)"):
        augmentation.views_from_seeds(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([1, 2, 3]), 2)


def test_views_drawn_from_seeds_of_any_size_have_the_same_distribution():
    """The counter-based numbers of views_from_seeds take every bit of the seed: small seeds, seeds past 2**32 and
    the largest give the views of the sampler's random seeds: the same pixel statistics, every view its own
    parameters."""
    images = SyntheticShapes(num_classes=4, train_per_class=1).split(True).images
    augmentation = BatchedViewAugmentation(ViewAugmentation.from_strengths(32), MEAN, STD)
    drawn = augmentation.views_from_seeds(images, random_seeds(4, 6), num_views=200)
    seeded = augmentation.views_from_seeds(images, torch.tensor([3, 1_000_003, 2**40, 2**62]), num_views=200)
    assert_same_pixel_statistics(seeded, drawn, 0.0)
    flat = seeded.flatten(0, 1)
    assert len({tuple(row.tolist()) for row in flat.flatten(1)}) == len(flat)


def test_selecting_rows_or_all_rows_for_the_hue_gives_the_same_views():
    """The hue shift on the rows that need it (CPUs) or on all rows, selected (devices: no host read) agree."""
    generator = torch.Generator().manual_seed(0)
    views = torch.rand(32, 3, 16, 16, generator=generator)
    factors = 0.6 + 0.8 * torch.rand(32, 3, generator=generator)
    hue_shift = torch.where(torch.rand(32, generator=generator) < 0.5, torch.rand(32, generator=generator) - 0.5, 0.0)
    order = torch.rand(32, 4, generator=generator).argsort(dim=1)
    rows = jitter_views(views, factors, hue_shift, order, select_rows=True)
    selected = jitter_views(views, factors, hue_shift, order, select_rows=False)
    assert not torch.allclose(rows, views, atol=1e-2)  # the jitter changed the views
    torch.testing.assert_close(selected, rows, rtol=0, atol=1e-6)


def test_the_jitter_order_is_a_stable_sort_so_ties_order_alike_on_every_device():
    """Two of a view's four order uniforms can tie in float32; an unstable sort may break the tie differently on CPU
    and CUDA, a stable one (index order) nowhere."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sorts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.stable: list[bool] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket is torch.ops.aten.sort:
                self.stable.append(bool((kwargs or {}).get("stable", False)))
            return func(*args, **(kwargs or {}))

    augmentation = BatchedViewAugmentation(ViewAugmentation.from_strengths(8), MEAN, STD)
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    with Sorts() as sorts:
        augmentation.views_from_seeds(images, random_seeds(2, 0), num_views=2)
    assert sorts.stable == [True]


@pytest.mark.parametrize("size", [16, 32])
def test_the_batched_blur_is_as_strong_as_the_per_image_blur(size):
    """The per-image views blur with PIL (``RandomGaussianBlur``), the batched ones with a Gaussian kernel; a kernel of
    10 % of the side (3 taps at 16 and 32 px) cut sigma 1 and 2 to one pixel either side, and its views kept 15 % to
    97 % more of the images' steps. PIL's blur is three box passes with clamped edges, not a Gaussian: on the same
    images and sigma the mean |horizontal step| of the two agrees within 4 % (measured), held here within 6 %."""
    images = SyntheticShapes(num_classes=10, train_per_class=4, image_size=size).split(True).images
    kernel = ViewAugmentation.from_strengths(size).blur_kernel
    for sigma in (0.5, 1.0, 2.0):
        per_image = torch.stack([RandomGaussianBlur(p=1.0, sigma=(sigma, sigma))(image) for image in images])
        batched = batched_augment._gaussian_blur(images.float() / 255, torch.full((len(images),), sigma), kernel)
        steps = [(views[..., 1:] - views[..., :-1]).abs().mean().item() for views in (per_image.float() / 255, batched)]
        assert steps[1] == pytest.approx(steps[0], rel=0.06), sigma
