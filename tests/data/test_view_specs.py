"""View specs (hfmca_lightning/data/view_specs.py): what the views of a sample are. Every setting checked in one line
when the spec is made, each spec's view count, multi-crop groups checked on their crop boxes, crop grids, and user
and lightly transforms counted on the first sample and seeded from each sample's seed."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch

from hfmca_lightning.data import (
    MultiCrop,
    MultiViewDataModule,
    SameClassViews,
    SimCLRViews,
    SingleView,
    SyntheticShapes,
    TransformViews,
)
from hfmca_lightning.data.sources import ArrayImages
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning


def data(views: Any = None, batch_size: int = 4, workers: int = 0, **options: Any) -> MultiViewDataModule:
    source = options.pop("source", SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2))
    return MultiViewDataModule(source, views=views, batch_size=batch_size, num_workers=workers, **options)


@pytest.mark.parametrize(
    ("make", "message", "parameter"),
    [
        (lambda: SimCLRViews(count=0), "SimCLRViews: count must be >= 1; got 0", "count"),
        # before: accepted, then range() failed deep inside a worker
        (lambda: SimCLRViews(count=2.5), "SimCLRViews: count must be a whole number >= 1; got 2.5", "count"),
        (lambda: SameClassViews(count=0), "SameClassViews: count must be >= 1; got 0", "count"),
        (lambda: SimCLRViews(grids=-1), "grids must be >= 0", "grids"),
        (lambda: MultiCrop(2, 6, local_scale=(0.3, 0.1)), "local_scale is .smallest, largest.", "local_scale"),
        (lambda: MultiCrop(global_crops=-1), "MultiCrop: global_crops must be >= 0; got -1", "global_crops"),
        (lambda: MultiCrop(0, 0), "MultiCrop needs at least one crop", "global_crops"),
        (lambda: MultiCrop(local_size=0), "local_size must be >= 1; got 0", "local_size"),
        (lambda: TransformViews(object()), "TransformViews needs a callable", "transform"),
        (
            lambda: SimCLRViews(color_strength=0.5, color_jitter=[0.4, 0.4, 0.2, 0.1]),
            r"color_jitter \[0.4, 0.4, 0.2, 0.1\] replaces the jitter of color_strength \(0.5\): set one of them",
            "color_jitter",
        ),
        (
            lambda: MultiCrop(color_strength=0.5, color_jitter=[0.4, 0.4, 0.2, 0.1]),
            r"color_jitter \[0.4, 0.4, 0.2, 0.1\] replaces the jitter of color_strength",
            "color_jitter",
        ),
        (lambda: SingleView(blur=1.5), "blur is a probability in", "blur"),
        # before: SimCLRViews cycled three view kinds (blur a, b, a, a, b, a), MultiCrop each list on its own
        (
            lambda: SimCLRViews(6, blur=[1.0, 0.1], solarize=[0, 0.1, 0.2]),
            "blur gives 2 view kinds and solarize 3",
            "solarize",
        ),
        # before: torchvision's traceback at the first view (hue 0.9), or NaN views / no jitter on the batched drawer
        (lambda: SimCLRViews(color_jitter=[0, 0, 0, 0.9]), r"hue at most 0.5; got \[0, 0, 0, 0.9\]", "color_jitter"),
        (lambda: SimCLRViews(color_jitter=[float("inf"), 0, 0, 0]), "finite and >= 0", "color_jitter"),
        (lambda: SimCLRViews(color_jitter=[float("nan"), 0, 0, 0]), "finite and >= 0", "color_jitter"),
        (lambda: MultiCrop(global_scale=(0.1, 0.5, 1.0)), r"got \(0.1, 0.5, 1.0\)", "global_scale"),
    ],
    ids=[
        "count",
        "fractional count",
        "same-class count",
        "grids",
        "multi-crop scale",
        "multi-crop negative count",
        "multi-crop no crop",
        "multi-crop size",
        "not callable",
        "color_jitter with color_strength",
        "multi-crop color_jitter with color_strength",
        "blur probability",
        "blur and solarize lengths",
        *("hue above 0.5", "infinite jitter", "NaN jitter", "three scale values"),
    ],
)
def test_a_setting_out_of_range_is_one_line_when_the_spec_is_made(make, message, parameter):
    # the parameter is the spec's own argument: the command line names it data.init_args.views.init_args.<it>
    with pytest.raises(ConfigurationError, match=message) as error:
        make()
    assert "\n" not in str(error.value) and error.value.parameter == parameter


@pytest.mark.parametrize(
    ("spec", "knob"),
    [
        (spec, knob)
        for spec in (SimCLRViews, SingleView, SameClassViews, MultiCrop)
        for knob in ("crop_strength", "color_strength", "gray_strength")
        if not (spec is MultiCrop and knob == "crop_strength")  # its crops come from its scales
    ],
)
def test_strength_outside_unit_interval_is_rejected(spec, knob):
    with pytest.raises(ConfigurationError, match=f"{knob} must be in") as error:
        spec(**{knob: 1.5})
    assert error.value.parameter == knob


def test_settings_a_spec_cannot_use_are_not_its_parameters():
    """What the old data module refused to combine cannot be said any more: MultiCrop's crops come from its scales
    (no crop_strength), a user's transform owns all its settings, a single view has no count."""

    def parameters(spec: type) -> set[str]:
        return set(inspect.signature(spec.__init__).parameters) - {"self"}

    assert "crop_strength" not in parameters(MultiCrop)
    assert parameters(TransformViews) == {"transform"}
    assert "count" not in parameters(SingleView) and "grids" not in parameters(SameClassViews)


def test_each_spec_says_its_view_count():
    """The count is the spec's: SimCLRViews' and SameClassViews' count, one for SingleView, the crops of MultiCrop, and
    for a user's transform what it returns for the first sample (None until the data module's setup counts it). The
    data module's default is two SimCLR views."""
    assert SimCLRViews(count=9).num_views == 9 and not SimCLRViews().single_view
    assert SameClassViews(count=3).num_views == 3
    assert SingleView().num_views == 1 and SingleView().single_view
    assert MultiCrop(2, 6).num_views == 8 and MultiCrop(global_crops=0, local_crops=3).num_views == 3
    default = data()
    assert isinstance(default.views, SimCLRViews) and default.num_views == 2 and not default.single_view
    module = data(TransformViews(lambda image: [torch.zeros(3, 8, 8)] * 3))
    assert module.num_views is None
    module.setup()
    assert module.num_views == 3


def test_multi_crop_groups_default_to_the_sources_size_and_half_of_it():
    crops = MultiCrop(2, 6)
    assert crops.groups(32) == [(2, 32, (0.14, 1.0)), (6, 16, (0.05, 0.14))]
    assert MultiCrop(0, 3, local_size=8).groups(32) == [(3, 8, (0.05, 0.14))]  # empty groups left out
    assert MultiCrop(2, 0, global_size=24).groups(32) == [(2, 24, (0.14, 1.0))]


def test_global_and_local_crops_of_one_size_stay_two_groups():
    """Groups were the runs of views of equal shape: with equal sizes the stacked batch held one (B, 4, ...) tensor,
    and ``(global_views, local_views), targets = batch`` split the samples instead."""
    module = data(MultiCrop(2, 2, global_size=16, local_size=16), source=SyntheticShapes(3, 8, 2, image_size=16))
    (global_views, local_views), targets = next(iter(module.train_dataloader()))
    assert global_views.shape == local_views.shape == (4, 2, 3, 16, 16) and targets.shape == (4,)


def test_multi_crop_groups_have_their_sizes_and_crop_scales():
    """On an image whose pixels hold their own coordinates (no colour changes, no flips), each crop's corners give
    its box: every global crop covers 14-100 % of the image at 32 px, every local one 5-14 % at 16 px."""
    size = 64
    rows, columns = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    image = torch.stack([columns * 4, rows * 4, torch.zeros_like(rows)]).to(torch.uint8)  # 4 levels per pixel

    class Coordinates(SyntheticShapes):
        def split(self, train: bool):
            return ArrayImages(image.permute(1, 2, 0)[None].expand(16, -1, -1, -1).numpy().copy(), [0] * 16)

    source = Coordinates(num_classes=2, train_per_class=8, image_size=size)
    crops = MultiCrop(2, 6, global_size=32, local_size=16, color_strength=0.0, gray_strength=0.0, horizontal_flip=False)
    module = data(crops, batch_size=16, source=source)
    module.setup()
    (global_views, local_views), _ = next(iter(module.train_dataloader()))
    assert global_views.shape == (16, 2, 3, 32, 32) and local_views.shape == (16, 6, 3, 16, 16)
    for views, (low, high) in ((global_views, (0.14, 1.0)), (local_views, (0.05, 0.14))):
        pixels = views.flatten(0, 1)[:, :2] * source.std[0] + source.mean[0]  # undo the normalisation
        coordinates = pixels * 255 / 4  # pixel positions (bilinear resampling: within about a pixel)
        width = coordinates[:, 0, :, -1].mean(1) - coordinates[:, 0, :, 0].mean(1)
        height = coordinates[:, 1, -1, :].mean(1) - coordinates[:, 1, 0, :].mean(1)
        # the first and last samples sit half an output pixel inside the box: w (1 - 1/S)
        output = views.shape[-1]
        area = (width / (1 - 1 / output)) * (height / (1 - 1 / output)) / size**2
        slack = 4 * size / size**2  # a pixel of rounding on each side
        assert bool((area >= low - slack).all()) and bool((area <= high + slack).all()), (area.min(), area.max())


def test_multi_crop_trains_hfmca_with_all_crops_in_one_external_cost():
    """HFMCA on 2 global + 2 local crops: the external cost groups the four views' features whatever their size,
    and the backbone's internal statistics add up over both groups' passes."""
    from hfmca_lightning.losses.hfmca_cost import HFMCACost
    from hfmca_lightning.methods import HFMCAModule, InternalCosts
    from hfmca_lightning.models import GridExternalHead, SmallConvNet, ViewProjector

    module = data(MultiCrop(2, 2))
    module.setup()
    (global_views, local_views), _ = next(iter(module.train_dataloader()))
    torch.manual_seed(0)
    model = HFMCAModule(
        SmallConvNet(width=8, num_stages=2),
        projector=ViewProjector(16, 8, 16),
        external_head=GridExternalHead(8, 2, 2, 8, noise_channels=0),
        external_cost=HFMCACost(name="external"),
        internal_costs=InternalCosts(["features.0"]),
    )
    collected = model.collect([global_views, local_views])
    assert collected.features.shape == (4 * 4, 16)
    stats = collected.statistics["internal/features.0"]
    alone = []
    for group in (global_views, local_views):
        with model.internal_costs.record() as recording:
            model.embed(group.flatten(0, 1))
        alone.append(recording.statistics["internal/features.0"])
    assert float(stats.group_count) == float(alone[0].group_count) + float(alone[1].group_count)
    # the same forward passes (BatchNorm in training mode sees each group alone in both)
    torch.testing.assert_close(stats.cross_sum, alone[0].cross_sum + alone[1].cross_sum)
    objective = model.objective(collected)
    assert torch.isfinite(objective.total)


def test_view_grids_come_with_the_views_in_training_batches():
    module = data(
        SimCLRViews(count=3, grids=2), source=SyntheticShapes(num_classes=2, train_per_class=4, image_size=16)
    )
    views, targets, grids = next(iter(module.train_dataloader()))
    assert views.shape == (4, 3, 3, 16, 16) and targets.shape == (4,) and grids.shape == (4, 3, 2, 2, 2)
    assert float(grids.min()) >= 0 and float(grids.max()) <= 16


def test_a_user_transform_is_seeded_from_each_sample_and_grouped_by_view_size():
    """A callable that draws from torch, Python's random and numpy: the same views for the same seed with 0 and 2
    workers; views of two sizes form two groups; a plain callable given as ``views`` is wrapped in TransformViews."""
    import random

    import numpy as np

    class ThreeGenerators:
        def __call__(self, image):
            from torchvision.transforms.functional import pil_to_tensor

            base = pil_to_tensor(image).float() / 255
            noise = torch.rand(()) + random.random() + float(np.random.rand())
            large = [base + noise + view for view in range(2)]
            small = [base[:, :16, :16] - noise - view for view in range(3)]
            return large + small

    serial = next(iter(data(TransformViews(ThreeGenerators())).train_dataloader()))
    wrapped = data(ThreeGenerators(), workers=2)
    assert isinstance(wrapped.views, TransformViews)
    parallel = next(iter(wrapped.train_dataloader()))
    (large, small), targets = serial
    assert large.shape == (4, 2, 3, 32, 32) and small.shape == (4, 3, 3, 16, 16)
    torch.testing.assert_close(parallel, serial, rtol=0, atol=0)
    other_seed = next(iter(data(TransformViews(ThreeGenerators()), seed=1).train_dataloader()))
    assert not torch.equal(other_seed[0][0], large)


def test_a_user_transform_leaves_the_callers_generators_as_they_were():
    """Seeding a sample's views does not touch the generators of the process that draws them."""
    import random

    import numpy as np

    module = data(lambda image: [torch.rand(3, 8, 8), torch.full((3, 8, 8), random.random() + np.random.rand())])
    module.setup()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    module.train_dataset()[(0, 123)]  # (a DataLoader draws its base seed from torch's generator)
    after = (torch.rand(()), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    assert after == (torch.rand(()), random.random(), np.random.rand())


def test_a_transform_that_gives_no_list_of_views_is_one_line():
    module = data(lambda image: torch.zeros(3, 8, 8))
    with pytest.raises(
        ConfigurationError, match=r"TransformViews: <lambda> must return a list of \(C, H, W\) view tensors; got"
    ):
        module.setup()


@pytest.mark.parametrize(
    ("view", "shape"), [(torch.zeros(1, 16, 16), "(1, 16, 16)"), (torch.zeros(1, 3, 16, 16), "(1, 3, 16, 16)")]
)
def test_a_transform_whose_views_are_not_rgb_images_is_one_line_before_training(view, shape):
    """Greyscale views failed in the backbone's first convolution at the first step, batched ones in the module's
    shape check; both were drawn without a word when the data module was set up."""
    module = data(lambda image: [view, view])
    with pytest.raises(
        ConfigurationError,
        match=rf"^TransformViews: the views of the first image have shape {re.escape(shape)}; give \(3, H, W\) RGB",
    ):
        module.setup()


def test_a_transform_whose_views_differ_between_images_is_one_line_not_a_cut_batch():
    """Two 16-px views, plus two 8-px ones for some images: stacking would keep the first group only."""

    def sometimes_local(image):
        extra = [torch.zeros(3, 8, 8)] * 2 if torch.rand(()) < 0.5 else []
        return [torch.zeros(3, 16, 16)] * 2 + extra

    loader = data(sometimes_local, batch_size=8, seed=0).train_dataloader()  # the first batch holds both kinds
    with pytest.raises(ConfigurationError, match=r"the images of one batch got different views \(view groups "):
        next(iter(loader))


def test_lightlys_simclr_transform_gives_the_same_views_with_0_and_2_workers():
    from lightly.transforms import SimCLRTransform

    def views(workers: int) -> Any:
        transform = SimCLRTransform(input_size=32, gaussian_blur=0.5, cj_prob=0.8)
        return next(iter(data(TransformViews(transform), workers=workers).train_dataloader()))

    serial, parallel = views(0), views(2)
    assert serial[0].shape == (4, 2, 3, 32, 32)
    torch.testing.assert_close(parallel, serial, rtol=0, atol=0)


def test_lightlys_transforms_are_counted_and_grouped_on_the_first_sample():
    """lightly's transforms given as ``views``: SimCLR's two views and DINO's 2 global + 3 local crops, counted when
    the data module is set up; DINO's crops form one group per size, global first."""
    from lightly.transforms import DINOTransform, SimCLRTransform

    simclr = data(SimCLRTransform(input_size=32))
    assert isinstance(simclr.views, TransformViews) and simclr.num_views is None
    simclr.setup()
    assert simclr.num_views == 2
    dino = data(DINOTransform(global_crop_size=32, local_crop_size=16, n_local_views=3))
    dino.setup()
    assert dino.num_views == 5
    (global_crops, local_crops), targets = next(iter(dino.train_dataloader()))
    assert global_crops.shape == (4, 2, 3, 32, 32) and local_crops.shape == (4, 3, 3, 16, 16)


def test_a_transform_whose_views_are_larger_than_the_sources_images_is_a_warning():
    """lightly's ``SimCLRTransform()`` makes 224-px views: on 32-px images that trains at 224 px while kNN and probes
    read 32-px images (with the source's normalisation), without a word before; views of the source's size or smaller
    (patches, local crops) are what a transform is for, without a warning."""
    from lightly.transforms import SimCLRTransform

    with pytest.warns(HFMCAWarning, match="makes 224x224 views of the source's 32-px images.*input_size=32"):
        data(SimCLRTransform()).setup("fit")
    data(SimCLRTransform(input_size=32)).setup("fit")  # HFMCAWarning is an error here
    data(TransformViews(lambda image: [torch.zeros(3, 8, 8)] * 3)).setup("fit")


def test_multicrop_crops_larger_than_the_images_warn_and_local_crops_larger_than_global_are_one_line():
    """Both were drawn without a word; a transform's views larger than the images already warned."""
    with pytest.warns(HFMCAWarning, match=r"^MultiCrop makes 64-px crops of the source's 32-px images.*at most 32$"):
        data(MultiCrop(global_crops=2, local_crops=0, global_size=64)).setup("fit")
    with pytest.raises(
        ConfigurationError, match=r"^MultiCrop: the local crops \(48 px\) are larger than the global ones \(32 px\)"
    ):
        data(MultiCrop(global_crops=2, local_crops=2, local_size=48)).setup("fit")
    data(MultiCrop(global_crops=2, local_crops=2, local_size=32)).setup("fit")  # equal sizes: no warning
