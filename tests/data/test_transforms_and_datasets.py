import random
from functools import partial

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from hfmca_lightning.data import MultiCrop, SameClassViews, SimCLRViews, SyntheticShapes, TransformViews
from hfmca_lightning.data.datasets import SeededRandomSampler, SeededViews, cycled_views, same_class_views
from hfmca_lightning.data.sources import ArrayImages
from hfmca_lightning.data.transforms import (
    RandomGaussianBlur,
    ViewAugmentation,
    eval_transform,
    view_transform,
    view_transforms,
)
from hfmca_lightning.errors import ConfigurationError

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def _image() -> torch.Tensor:
    return SyntheticShapes(num_classes=2, train_per_class=1).split(train=True)[0][0]


def test_strength_zero_is_no_distortion():
    image = _image()
    identity = view_transform(
        ViewAugmentation.from_strengths(32, crop_strength=0, color_strength=0, gray_strength=0, horizontal_flip=False),
        MEAN,
        STD,
    )
    plain = eval_transform(32, MEAN, STD)
    for _ in range(3):
        torch.testing.assert_close(identity(image), plain(image))


def test_gray_strength_one_makes_every_view_grey():
    image = _image()
    transform = view_transform(ViewAugmentation.from_strengths(32, gray_strength=1.0, color_strength=0), MEAN, STD)
    for _ in range(5):
        view = transform(image)
        # float32 greyscale: one weighted sum of three channels per pixel, then the normalisation: a few roundings
        torch.testing.assert_close(view[0], view[1], atol=1e-5, rtol=0)
        torch.testing.assert_close(view[1], view[2], atol=1e-5, rtol=0)


def test_crop_strength_maps_to_scale_range():
    default = view_transform(ViewAugmentation.from_strengths(32), MEAN, STD).transforms[1]
    assert default.scale == (0.08, 1.0)
    extreme = view_transform(ViewAugmentation.from_strengths(32, crop_strength=1.0), MEAN, STD).transforms[1]
    assert extreme.scale == pytest.approx((1 / 1024, 1.0))
    half = view_transform(ViewAugmentation.from_strengths(32, crop_strength=0.5), MEAN, STD).transforms[1]
    assert half.scale[0] == pytest.approx(1 - 0.5 * (1 - 1 / 1024))


def test_color_strength_one_doubles_the_default_jitter():
    jitter = (
        view_transform(ViewAugmentation.from_strengths(32, color_strength=1.0), MEAN, STD).transforms[3].transforms[0]
    )
    default = view_transform(ViewAugmentation.from_strengths(32), MEAN, STD).transforms[3].transforms[0]
    assert jitter.brightness == (max(0, 1 - 0.8), 1 + 0.8)
    assert default.brightness == pytest.approx((0.6, 1.4)) and default.hue == pytest.approx((-0.1, 0.1))
    assert jitter.hue == pytest.approx((-0.2, 0.2))


def test_every_view_draws_its_own_crop():
    source = SyntheticShapes(num_classes=2, train_per_class=2)
    transform = view_transform(ViewAugmentation.from_strengths(32, color_strength=0, gray_strength=0), MEAN, STD)
    dataset = SeededViews(source.split(True), partial(cycled_views, [transform], 6))
    (views,), target, index, grids = dataset[(0, 123)]
    assert views.shape == (6, 3, 32, 32) and index == 0 and target == source.split(True).targets[0] and grids is None
    distinct = {tuple(v.flatten()[:50].tolist()) for v in views}
    assert len(distinct) == 6


def test_views_are_a_function_of_the_sample_seed_only():
    transform = view_transform(ViewAugmentation.from_strengths(32), MEAN, STD)
    dataset = SeededViews(
        SyntheticShapes(num_classes=2, train_per_class=2).split(True), partial(cycled_views, [transform], 3)
    )
    (first,), *_ = dataset[(1, 42)]
    torch.manual_seed(999)  # global state must not matter
    (again,), *_ = dataset[(1, 42)]
    (other,), *_ = dataset[(1, 43)]
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_sampler_is_a_permutation_that_depends_on_seed_and_epoch():
    sampler = SeededRandomSampler(10, seed=3)
    first = list(sampler)
    assert sorted(index for index, _ in first) == list(range(10))
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_same_class_members_are_distinct_images_of_one_class():
    images = torch.arange(12, dtype=torch.uint8).reshape(12, 1, 1, 1).expand(12, 4, 4, 3).numpy()
    split = ArrayImages(images, [0, 1, 2] * 4)
    by_class = {c: torch.arange(c, 12, 3) for c in range(3)}
    dataset = SeededViews(split, partial(same_class_views, [lambda image: image[0, 0, 0].clone()] * 4, by_class))
    (members,), target, index, _ = dataset[(4, 5)]
    assert target == 1 and index == 4 and int(members[0]) == 4
    assert len(set(members.tolist())) == 4
    assert all(split.targets[int(m)] == 1 for m in members)


def test_same_class_needs_enough_images_per_class():
    split = ArrayImages(torch.zeros(4, 4, 4, 3, dtype=torch.uint8).numpy(), [0, 0, 1, 1])
    with pytest.raises(ConfigurationError, match="SameClassViews needs at least count=3 images per class") as error:
        SameClassViews(count=3).dataset(split, 4, (MEAN, STD))
    assert error.value.parameter == "views"


def _steps(transform, kind):
    """The steps of one type in a v2 Compose, looking inside RandomApply."""
    found = []
    for step in transform.transforms:
        inner = step.transforms if isinstance(step, v2.RandomApply) else [step]
        found += [(step, s) for s in inner if isinstance(s, kind)]
    return found


def _jitter(transform):
    [(apply, jitter)] = _steps(transform, v2.ColorJitter)
    return apply.p, (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue)


def _lightly_step(transform, name):
    return next(step for step in transform.transforms if type(step).__name__ == name)


@pytest.mark.parametrize("preset", ["simclr", "byol"])
def test_imagenet_augmentations_match_lightlys(preset):
    """SimCLR ImageNet (colour strength 1, blur 0.5) and BYOL's two views (blur 1 / 0.1, solarisation 0 / 0.2)
    have lightly's parameters, view kind by view kind."""
    from lightly.transforms import BYOLView1Transform, BYOLView2Transform, SimCLRTransform

    if preset == "simclr":
        spec = ViewAugmentation.from_strengths(224, color_strength=1.0, blur=0.5)
        theirs = [SimCLRTransform(input_size=224).transforms[0].transform]
    else:
        spec = ViewAugmentation.from_strengths(
            224, color_jitter=[0.4, 0.4, 0.2, 0.1], blur=[1.0, 0.1], solarize=[0.0, 0.2]
        )
        theirs = [BYOLView1Transform(input_size=224).transform, BYOLView2Transform(input_size=224).transform]
    ours = view_transforms(spec, MEAN, STD)
    assert len(ours) == len(theirs)
    for mine, lightly_transform in zip(ours, theirs):
        crop = mine.transforms[1]
        lightly_crop = lightly_transform.transforms[0]
        assert (crop.size, crop.scale, crop.ratio) == (lightly_crop.size, lightly_crop.scale, lightly_crop.ratio)
        lightly_apply = next(
            step
            for step in lightly_transform.transforms
            if isinstance(step, v2.RandomApply) or type(step).__name__ == "RandomApply"
        )
        lightly_jitter = lightly_apply.transforms[0]
        p, ranges = _jitter(mine)
        assert p == pytest.approx(lightly_apply.p)
        expected = (lightly_jitter.brightness, lightly_jitter.contrast, lightly_jitter.saturation, lightly_jitter.hue)
        for got, want in zip(ranges, expected):
            assert tuple(got) == pytest.approx(tuple(want))
        [(_, grey)] = _steps(mine, v2.RandomGrayscale)
        assert grey.p == _lightly_step(lightly_transform, "RandomGrayscale").p
        blur = _lightly_step(lightly_transform, "GaussianBlur")
        found = [step for step in mine.transforms if isinstance(step, RandomGaussianBlur)]
        assert (found[0].p if found else 0.0) == blur.prob
        assert not found or found[0].sigma == pytest.approx(blur.sigmas)
        solarize = next(
            (step for step in lightly_transform.transforms if type(step).__name__ == "RandomSolarization"), None
        )
        mine_solarize = [s for _, s in _steps(mine, v2.RandomSolarize)]
        assert (mine_solarize[0].p if mine_solarize else 0.0) == (solarize.prob if solarize else 0.0)
        assert not mine_solarize or mine_solarize[0].threshold == solarize.threshold


def test_views_cycle_through_the_view_kinds_on_the_cpu_and_on_the_device():
    """Kind 0 blurred, kind 1 solarised, every time: a flat image of 200 stays 200 when blurred and becomes
    255 - 200 = 55 when solarised; views 0, 2, ... are kind 0 and 1, 3, ... kind 1."""
    from hfmca_lightning.data.batched_augment import BatchedViewAugmentation

    spec = ViewAugmentation.from_strengths(
        32,
        crop_strength=0,
        color_strength=0,
        gray_strength=0,
        horizontal_flip=False,
        blur=[1.0, 0.0],
        solarize=[0.0, 1.0],
    )
    flat = torch.full((3, 32, 32), 200, dtype=torch.uint8)
    images = ArrayImages(flat.permute(1, 2, 0)[None].numpy(), [0])
    transforms = view_transforms(spec, (0.0,) * 3, (1.0,) * 3)
    (cpu_views,), *_ = SeededViews(images, partial(cycled_views, transforms, 4))[(0, 123)]
    batched = BatchedViewAugmentation(spec, (0.0,) * 3, (1.0,) * 3)
    device_views = batched.views_from_seeds(flat[None], torch.tensor([123]), num_views=4)[0]
    for views in (cpu_views, device_views):
        means = [float(view.mean()) * 255 for view in views]
        # a flat grey image: blurred it stays 200, solarised 255 - 200; uint8 rounding on the CPU path (+-0.5) and
        # the blur's reflect padding at the crop's border (a fraction of a level): within 1.5 levels
        assert means == pytest.approx([200, 55, 200, 55], abs=1.5)


def test_view_grids_give_the_source_position_of_every_cell_centre():
    """On an image whose pixels hold their own coordinates, each view, sampled at the centre of grid cell (i, j),
    shows the source position that ``grids[i, j]`` names (crops, aspect ratios and flips included)."""
    from hfmca_lightning.data.transforms import ViewAugmentation, ViewWithGrid

    size, cells = 32, 4
    spec = ViewAugmentation.from_strengths(
        size, None, 0.0, 0.0, True, None, 0.0, 0.0
    )  # SimCLR crops and flips, no colour
    transform = ViewWithGrid(spec, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), 0, cells)
    rows, columns = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    image = torch.stack([columns * 8, rows * 8, torch.zeros_like(rows)]).to(
        torch.uint8
    )  # value 8 k at pixel k (centre k + 1/2)
    centres = (torch.arange(cells) + 0.5) / cells * 2 - 1  # cell centres in grid_sample's [-1, 1] coordinates
    sample_at = torch.stack(torch.meshgrid(centres, centres, indexing="xy"), dim=-1)[None]  # [i, j] = (x_j, y_i)
    flips = 0
    for seed in range(20):
        torch.manual_seed(seed)
        view, grid = transform(image)
        assert view.shape == (3, size, size) and grid.shape == (cells, cells, 2)
        seen = (
            torch.nn.functional.grid_sample(view[None, :2].double(), sample_at.double(), align_corners=False)[0]
            * 255
            / 8
            + 0.5
        )
        # positions encoded in pixel values at 8 pixels per level and read back by bilinear sampling: uint8 rounding
        # of the encoding (half a level, 1/16 of a pixel) and the resize's interpolation: within 0.3 pixel
        torch.testing.assert_close(seen.permute(1, 2, 0), grid.double(), atol=0.3, rtol=0)
        flips += bool(grid[0, 0, 0] > grid[0, -1, 0])
    assert 0 < flips < 20


class _RandomReads(ArrayImages):
    """A split whose reading draws from torch's, Python's and numpy's generators (a torchvision data set with a random
    ``transform``, say)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        torch.rand(3), random.random(), np.random.rand()
        return super().__getitem__(index)


@pytest.mark.parametrize(
    "views",
    [
        SimCLRViews(count=3),
        MultiCrop(global_crops=1, local_crops=2),
        TransformViews(lambda image: [v2.RandomResizedCrop(16)(v2.ToImage()(image))]),
    ],
    ids=["simclr", "multi-crop", "transform"],
)
def test_the_generators_are_seeded_after_the_image_is_read(views):
    """A sample's views come from its seed alone, whatever reading its image draws."""
    images, targets = SyntheticShapes(num_classes=2, train_per_class=2).split(True)[0][0], [0]
    array = images.permute(1, 2, 0)[None].numpy()
    plain = views.dataset(ArrayImages(array, targets), 32, (MEAN, STD))[(0, 7)]
    random_reads = views.dataset(_RandomReads(array, targets), 32, (MEAN, STD))[(0, 7)]
    for group, same in zip(plain[0], random_reads[0]):
        assert torch.equal(group, same)
