import pytest
import torch

from hfmca_lightning.data import (
    ArrayImages,
    MultiViewDataModule,
    MultiViewDataset,
    SameClassDataset,
    SeededRandomSampler,
    SyntheticShapes,
    view_transform,
)
from hfmca_lightning.data.transforms import ViewAugmentation, eval_transform
from hfmca_lightning.errors import ConfigurationError

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def _image() -> torch.Tensor:
    return SyntheticShapes(num_classes=2, train_per_class=1).split(train=True)[0][0]


def test_strength_zero_is_no_distortion():
    image = _image()
    identity = view_transform(ViewAugmentation.from_strengths(32, crop_strength=0, color_strength=0, gray_strength=0, horizontal_flip=False), MEAN, STD)
    plain = eval_transform(32, MEAN, STD)
    for _ in range(3):
        torch.testing.assert_close(identity(image), plain(image))


def test_gray_strength_one_makes_every_view_grey():
    image = _image()
    transform = view_transform(ViewAugmentation.from_strengths(32, gray_strength=1.0, color_strength=0), MEAN, STD)
    for _ in range(5):
        view = transform(image)
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
    jitter = view_transform(ViewAugmentation.from_strengths(32, color_strength=1.0), MEAN, STD).transforms[3].transforms[0]
    default = view_transform(ViewAugmentation.from_strengths(32), MEAN, STD).transforms[3].transforms[0]
    assert jitter.brightness == (max(0, 1 - 0.8), 1 + 0.8)
    assert default.brightness == pytest.approx((0.6, 1.4)) and default.hue == pytest.approx((-0.1, 0.1))
    assert jitter.hue == pytest.approx((-0.2, 0.2))


@pytest.mark.parametrize("knob", ["crop_strength", "color_strength", "gray_strength"])
def test_strength_outside_unit_interval_is_rejected(knob):
    with pytest.raises(ConfigurationError, match=f"{knob} must be in") as error:
        MultiViewDataModule(SyntheticShapes(), **{knob: 1.5})
    assert error.value.parameter == knob


def test_every_view_draws_its_own_crop():
    source = SyntheticShapes(num_classes=2, train_per_class=2)
    dataset = MultiViewDataset(source.split(True), view_transform(ViewAugmentation.from_strengths(32, color_strength=0, gray_strength=0), MEAN, STD), num_views=6)
    views, _ = dataset[(0, 123)]
    assert views.shape == (6, 3, 32, 32)
    distinct = {tuple(v.flatten()[:50].tolist()) for v in views}
    assert len(distinct) == 6


def test_views_are_a_function_of_the_sample_seed_only():
    dataset = MultiViewDataset(SyntheticShapes(num_classes=2, train_per_class=2).split(True), view_transform(ViewAugmentation.from_strengths(32), MEAN, STD), 3)
    first, _ = dataset[(1, 42)]
    torch.manual_seed(999)  # global state must not matter
    again, _ = dataset[(1, 42)]
    other, _ = dataset[(1, 43)]
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
    dataset = SameClassDataset(split, lambda image: image[0, 0, 0].clone(), num_views=4)
    members, target = dataset[(4, 5)]
    assert target == 1 and int(members[0]) == 4
    assert len(set(members.tolist())) == 4
    assert all(split.targets[int(m)] == 1 for m in members)


def test_same_class_needs_enough_images_per_class():
    split = ArrayImages(torch.zeros(4, 4, 4, 3, dtype=torch.uint8).numpy(), [0, 0, 1, 1])
    with pytest.raises(ValueError, match="needs at least num_views=3 images per class"):
        SameClassDataset(split, lambda x: x, num_views=3)


@pytest.mark.parametrize("mode", ["views", "same_class"])
def test_datamodule_batches(mode):
    datamodule = MultiViewDataModule(SyntheticShapes(num_classes=3, train_per_class=6, test_per_class=2), mode=mode, num_views=4, batch_size=5, eval_batch_size=7, num_workers=0)
    datamodule.setup("fit")
    views, targets = next(iter(datamodule.train_dataloader()))
    assert views.shape == (5, 4, 3, 32, 32) and views.dtype == torch.float32 and targets.shape == (5,)
    bank, queries = datamodule.val_dataloader()
    images, bank_targets = next(iter(bank))
    assert images.shape == (7, 3, 32, 32)
    assert len(bank.dataset) == 18 and len(queries.dataset) == 6
    assert datamodule.num_classes == 3


def test_datamodule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode must be"):
        MultiViewDataModule(SyntheticShapes(), mode="pairs")
    with pytest.raises(ConfigurationError, match="num_views must be >= 1") as error:
        MultiViewDataModule(SyntheticShapes(), num_views=0)
    assert error.value.parameter == "num_views"
