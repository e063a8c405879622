"""The view pipelines (hfmca_lightning/data/views.py) through the data module, as training and analysis draw them:
the same views wherever and however they are drawn, per-sample seeds, N batches per call, output layouts, multi-crop
groups checked on their crop boxes, user transforms seeded, and one line for what a pipeline cannot do."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import torch

from hfmca_lightning.data import (
    CIFAR,
    BatchedViews,
    MultiCrop,
    MultiViewDataModule,
    ResidentViews,
    SyntheticShapes,
    TorchvisionViews,
    TransformViews,
    ViewBatch,
)
from hfmca_lightning.data.datamodule import TrainingPosition
from hfmca_lightning.data.views import ResidentBatch
from hfmca_lightning.diagnostics import HostReads, OperationCounts
from hfmca_lightning.errors import ConfigurationError
from tests.helpers.views import CPU, drawn, epoch_batches


def data(views: Any = None, num_views: int = 4, batch_size: int = 4, workers: int = 0, **options: Any):
    source = options.pop("source", SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2))
    return MultiViewDataModule(
        source, num_views=num_views, batch_size=batch_size, num_workers=workers, views=views, **options
    )


def test_batched_views_are_the_same_in_workers_on_the_device_and_alone(cifar10_on_disk):
    """Every batch of an epoch (CIFAR's layout on disk): the batched pipeline in 2 workers, on the device after the
    transfer, and with the training set kept on the device (in chunks of 1 and 3 batches) give the same views and
    targets; each image's views equal a call for that image alone with its seed."""
    source = CIFAR(root=str(cifar10_on_disk), verify=False)
    paths = {
        "workers": data(BatchedViews(), batch_size=8, workers=2, source=source, seed=3),
        "device": data(BatchedViews(on="device"), batch_size=8, workers=2, source=source, seed=3),
        "resident": data(ResidentViews(), batch_size=8, workers=2, source=source, seed=3),
        "resident, 3 per call": data(ResidentViews(batches_per_call=3), batch_size=8, source=source, seed=3),
    }
    assert paths["resident"].train_dataloader().num_workers == 0  # a batch is its indices and seeds
    epochs = {name: epoch_batches(module) for name, module in paths.items()}
    reference = epochs.pop("workers")
    assert len(reference) == 100 // 8
    for name, batches in epochs.items():
        assert len(batches) == len(reference), name
        for (views, targets), (expected_views, expected_targets) in zip(batches, reference):
            torch.testing.assert_close(views, expected_views, rtol=0, atol=0, msg=name)
            assert torch.equal(targets, expected_targets), name
    module = paths["workers"]
    keys = list(module.train_dataloader().sampler)[:8]
    augmentation = module.views.augmentation
    for row, (index, seed) in enumerate(keys):
        image = module._train_split[index][0]
        alone = augmentation.views_from_seeds(image[None], torch.tensor([seed]), 4)[0]
        torch.testing.assert_close(reference[0][0][row], alone, rtol=0, atol=1e-6)


def test_views_do_not_depend_on_the_workers_or_the_batch_composition():
    for views in (TorchvisionViews(), BatchedViews(), MultiCrop(1, 3)):
        count = 4
        serial = next(iter(data(views, num_views=count).train_dataloader()))
        parallel = next(iter(data(type(views)(**_arguments(views)), num_views=count, workers=2).train_dataloader()))
        torch.testing.assert_close(parallel, serial, rtol=0, atol=0)
    pairs = list(data(BatchedViews(), batch_size=2).train_dataloader())[:2]
    fours = next(iter(data(BatchedViews(), batch_size=4).train_dataloader()))
    torch.testing.assert_close(torch.cat([pairs[0][0], pairs[1][0]]), fours[0], rtol=0, atol=1e-6)


def _arguments(views: Any) -> dict[str, Any]:
    if isinstance(views, MultiCrop):
        return {"global_crops": views.global_crops, "local_crops": views.local_crops}
    return {}


def test_n_batches_per_call_give_the_views_of_one_batch_at_a_time():
    """ResidentViews(batches_per_call=N): one call draws the views of N batches; every batch equals the batch drawn
    alone, for chunks that end with a short one (7 batches in chunks of 3) and across epochs."""
    alone = data(ResidentViews(), batch_size=3, seed=5)
    chunked = data(ResidentViews(batches_per_call=3), batch_size=3, seed=5)
    for epoch_number in range(2):
        loaders = [module.train_dataloader() for module in (alone, chunked)]
        for loader in loaders:
            loader.sampler.set_epoch(epoch_number)
        first, second = [
            [drawn(module, batch, number) for number, batch in enumerate(loader)]
            for module, loader in zip((alone, chunked), loaders)
        ]
        assert len(first) == len(second) == 24 // 3
        for (views, targets), (chunk_views, chunk_targets) in zip(first, second):
            torch.testing.assert_close(chunk_views, views, rtol=0, atol=1e-6)
            assert torch.equal(chunk_targets, targets)
    batch = next(iter(chunked.train_dataloader()))
    assert isinstance(batch, ResidentBatch) and batch.indices.shape == (9,) and batch.next_indices.shape == (9,)


def test_drawing_on_the_device_reads_nothing_on_the_host_and_copies_no_python_constants():
    """The training set kept on the device, the hue computed on all rows and selected (the default on GPUs): a batch's
    views come from tensors on the device alone: no host read, no tensor made from Python data."""
    module = data(ResidentViews(batches_per_call=2), batch_size=6, blur=[1.0, 0.1], solarize=[0.0, 0.2])
    module.views._augmentation.select_rows = False
    batches = list(module.train_dataloader())
    drawn(module, batches[0])  # the first call places the images and the pipeline's constants
    with HostReads() as reads, OperationCounts(torch.ops.aten.lift_fresh) as from_python:
        views, targets = drawn(module, batches[2])
    assert reads.reads == [] and from_python.count == 0
    assert views.shape == (6, 4, 3, 32, 32) and targets.shape == (6,)


def test_device_pipelines_emit_bf16_channels_last_views_when_asked():
    for views in (
        BatchedViews(on="device", output_dtype="bfloat16", channels_last=True),
        ResidentViews(2, "bfloat16", True),
    ):
        module = data(views)
        images, _ = drawn(module, next(iter(module.train_dataloader())))
        flat = images.flatten(0, 1)
        assert images.dtype == torch.bfloat16 and flat.is_contiguous(memory_format=torch.channels_last)
        reference = data(BatchedViews())
        expected, _ = next(iter(reference.train_dataloader()))
        torch.testing.assert_close(images.float(), expected, rtol=2**-8, atol=2**-8 * float(expected.abs().max()))


@pytest.mark.parametrize(
    "views",
    [None, BatchedViews(), BatchedViews(on="device"), ResidentViews(2), MultiCrop(2, 2)],
    ids=["torchvision", "batched workers", "batched device", "resident", "multi-crop"],
)
def test_analysis_gets_view_batches_from_every_pipeline(views):
    """``view_batches`` (what ``hfmca analyze`` reads) draws through the configured pipeline, on the device, whatever
    the training loader yields (images, indices and seeds): views, never indices."""
    module = data(views)
    module.setup()
    batches = list(module.view_batches(CPU, limit=2))
    assert len(batches) == 2 and all(isinstance(batch, ViewBatch) for batch in batches)
    for batch in batches:
        assert all(group.dtype == torch.float32 and group.dim() == 5 for group in batch.groups)
        assert batch.num_views == 4 and batch.targets.shape == (4,)


def test_multi_crop_groups_have_their_sizes_and_crop_scales():
    """On an image whose pixels hold their own coordinates (no colour changes, no flips), each crop's corners give
    its box: every global crop covers 14-100 % of the image at 32 px, every local one 5-14 % at 16 px."""
    size = 64
    rows, columns = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    image = torch.stack([columns * 4, rows * 4, torch.zeros_like(rows)]).to(torch.uint8)  # 4 levels per pixel

    class Coordinates(SyntheticShapes):
        def split(self, train: bool):
            from hfmca_lightning.data import ArrayImages

            return ArrayImages(image.permute(1, 2, 0)[None].expand(16, -1, -1, -1).numpy().copy(), [0] * 16)

    source = Coordinates(num_classes=2, train_per_class=8, image_size=size)
    crops = MultiCrop(2, 6, global_size=32, local_size=16)
    module = data(
        crops, num_views=8, batch_size=16, source=source, color_strength=0.0, gray_strength=0.0, horizontal_flip=False
    )
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

    module = data(MultiCrop(2, 2), num_views=4)
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


def test_a_user_transform_is_seeded_from_each_sample_and_grouped_by_view_size():
    """A callable that draws from torch, Python's random and numpy: the same views for the same seed with 0 and 2
    workers; views of two sizes form two groups."""
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

    serial = next(iter(data(TransformViews(ThreeGenerators()), num_views=5).train_dataloader()))
    parallel = next(iter(data(TransformViews(ThreeGenerators()), num_views=5, workers=2).train_dataloader()))
    (large, small), targets = serial
    assert large.shape == (4, 2, 3, 32, 32) and small.shape == (4, 3, 3, 16, 16)
    torch.testing.assert_close(parallel, serial, rtol=0, atol=0)
    other_seed = next(iter(data(TransformViews(ThreeGenerators()), num_views=5, seed=1).train_dataloader()))
    assert not torch.equal(other_seed[0][0], large)


def test_lightlys_simclr_transform_gives_the_same_views_with_0_and_2_workers():
    from lightly.transforms import SimCLRTransform

    def views(workers: int) -> Any:
        transform = SimCLRTransform(input_size=32, gaussian_blur=0.5, cj_prob=0.8)
        return next(iter(data(TransformViews(transform), num_views=2, workers=workers).train_dataloader()))

    serial, parallel = views(0), views(2)
    assert serial[0].shape == (4, 2, 3, 32, 32)
    torch.testing.assert_close(parallel, serial, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: data(BatchedViews(on="gpu")), "BatchedViews: on must be 'workers' or 'device'; got 'gpu'"),
        (lambda: data(BatchedViews(output_dtype="bfloat16")), "output_dtype and channels_last apply to views drawn"),
        (lambda: data(BatchedViews(output_dtype="float16")), "output_dtype must be 'float32' or 'bfloat16'"),
        (lambda: data(BatchedViews(), mode="same_class"), "BatchedViews draws augmented views of one image per sample"),
        (lambda: data(ResidentViews(), mode="single", num_views=1), "does not serve mode 'single'"),
        (lambda: data(ResidentViews(batches_per_call=0)), "batches_per_call must be >= 1"),
        (lambda: data(MultiCrop(2, 6), num_views=4), r"MultiCrop makes 8 views per image; set data num_views: 8"),
        (lambda: data(MultiCrop(2, 6, local_scale=(0.3, 0.1))), "local_scale is .smallest, largest."),
        (lambda: data(TorchvisionViews(grids=-1)), "grids must be >= 0"),
        (lambda: data(TransformViews(object())), "TransformViews needs a callable"),
        (
            lambda: data(TransformViews(lambda image: [image]), crop_strength=0.5, blur=0.5),
            r"settings \(crop_strength, blur\) do not apply to it: remove them",
        ),
        (
            lambda: data(MultiCrop(2, 2), num_views=4, crop_strength=0.5),
            "the data module's crop_strength does not apply to it",
        ),
        (
            lambda: data(color_strength=0.5, color_jitter=[0.4, 0.4, 0.2, 0.1]),
            r"color_jitter \[0.4, 0.4, 0.2, 0.1\] replaces the jitter of color_strength \(0.5\): set one of them",
        ),
        (
            lambda: data(TransformViews(lambda image: [torch.zeros(3, 8, 8)] * 3)).setup(),
            "TransformViews makes 3 views per image; set data num_views: 3",
        ),
        (lambda: data(batch_format="torch"), "batch_format must be one of stacked, lightly, solo"),
    ],
    ids=[
        "where",
        "workers in bf16",
        "float16",
        "batched same_class",
        "resident single",
        "batches per call",
        "multi-crop count",
        "multi-crop scale",
        "grids",
        "not callable",
        "transform with knobs",
        "multi-crop with crop_strength",
        "color_jitter with color_strength",
        "transform count",
        "batch format",
    ],
)
def test_what_a_pipeline_cannot_do_is_one_line_before_anything_runs(make, message):
    with pytest.raises(ConfigurationError, match=message) as error:
        make()
    assert "\n" not in str(error.value)


def test_a_resumed_epoch_in_the_same_process_draws_its_own_chunks_not_the_interrupted_runs():
    """An epoch interrupted after two batches and resumed by the same data module (a fit, then a fit from its
    checkpoint in one process): every resumed batch has the views a fresh module draws for it, not views left over from
    the chunks the interrupted pass drew (chunks 3 batches long, resumed one batch into the second)."""

    def resumed_epoch(module: MultiViewDataModule) -> list[Any]:
        module.load_state_dict({"position": asdict(TrainingPosition(epoch=0, samples_seen=4 * 3))})
        return epoch_batches(module)

    reused = data(ResidentViews(batches_per_call=3), batch_size=3, seed=5)
    for number, batch in zip(range(5), reused.train_dataloader()):  # the chunks of batches 0-2 and 3-5 drawn
        drawn(reused, batch, number)
    fresh = data(ResidentViews(batches_per_call=3), batch_size=3, seed=5)
    for (views, targets), (expected_views, expected_targets) in zip(resumed_epoch(reused), resumed_epoch(fresh)):
        assert torch.equal(targets, expected_targets)
        torch.testing.assert_close(views, expected_views, rtol=0, atol=0)
