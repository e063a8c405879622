"""Batch formats: the same views laid out for this project's modules (stacked), lightly's code and solo-learn's; the
example modules of each convention (examples/) compute on them the loss they compute on the stacked views."""

from __future__ import annotations

import copy
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch

from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.data.batch_formats import ViewBatch, first_views, format_batch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict[str, Any]:
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="example")


def _batch(grids: bool = False) -> ViewBatch:
    groups = [torch.rand(3, 2, 3, 8, 8), torch.rand(3, 4, 3, 4, 4)]
    return ViewBatch(groups, torch.tensor([1, 0, 2]), torch.tensor([7, 3, 5]), ["7", "3", "5"])


def test_the_formats_lay_out_the_same_views():
    batch = _batch()
    (global_views, local_views), targets = format_batch(batch, "stacked")
    assert global_views is batch.groups[0] and local_views is batch.groups[1] and targets is batch.targets
    views, targets, names = format_batch(batch, "lightly")
    assert len(views) == 6 and names == ["7", "3", "5"] and targets is batch.targets
    expected = [batch.groups[0][:, 0], batch.groups[0][:, 1], *batch.groups[1].unbind(1)]
    assert all(torch.equal(got, want) for got, want in zip(views, expected))  # global crops first
    indexes, crops, targets = format_batch(batch, "solo")
    assert torch.equal(indexes, batch.indices) and all(torch.equal(a, b) for a, b in zip(crops, expected))
    one = ViewBatch([torch.rand(3, 1, 3, 8, 8)], batch.targets, batch.indices, batch.names)
    images, _ = format_batch(one, "stacked", single=True)
    assert images.shape == (3, 3, 8, 8)


def test_view_grids_follow_the_views_in_lightlys_layout():
    """lightly's VICRegL example splits ``batch[0]`` in half: views, then their grids."""
    module = MultiViewDataModule(
        SyntheticShapes(num_classes=2, train_per_class=4, image_size=16),
        views=SimCLRViews(count=2, grids=2),
        batch_size=4,
        num_workers=0,
        batch_format="lightly",
    )
    views_and_grids, targets, names = next(iter(module.train_dataloader()))
    views, grids = views_and_grids[:2], views_and_grids[2:]
    assert [tuple(view.shape) for view in views] == [(4, 3, 16, 16)] * 2
    assert [tuple(grid.shape) for grid in grids] == [(4, 2, 2, 2)] * 2 and len(names) == 4


def _same_batches(make_data: Any) -> tuple[Any, Any]:
    """One batch in the example's format and the same batch (same seed) stacked."""
    formatted = next(iter(make_data(num_workers=0).train_dataloader()))
    stacked_data = make_data(num_workers=0)
    stacked_data.batch_format = "stacked"
    return formatted, next(iter(stacked_data.train_dataloader()))


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_an_mmcr_module_written_for_lightly_gets_its_views_not_images_swapped():
    """lightly's MMCR training step iterates ``batch[0]``: with ``batch_format: lightly`` it walks the 8 view batches
    of 16 images (the stacked tensor would give it 16 batches of one image's 8 views), and its loss equals MMCRLoss
    on the stacked views, (B, k, D)."""
    mmcr = example("lightly_convention")
    formatted, stacked = _same_batches(mmcr["mmcr_data"])
    views = formatted[0]
    assert len(views) == 8 and views[0].shape == (16, 3, 32, 32)
    module = mmcr["MMCR"]().eval()
    reference = copy.deepcopy(module)
    loss = module.training_step(formatted, 0)
    stacked_views, _ = stacked
    with torch.no_grad():
        online = torch.stack([reference(view) for view in stacked_views.unbind(1)], dim=1)
        momentum = torch.stack([reference.forward_momentum(view) for view in stacked_views.unbind(1)], dim=1)
    _close(loss.detach(), reference.criterion(online, momentum))


def test_a_dino_module_written_for_lightly_gets_global_crops_first():
    dino = example("lightly_convention")
    formatted, stacked = _same_batches(dino["dino_data"])
    views, targets, names = formatted
    assert [tuple(view.shape[-2:]) for view in views] == [(32, 32)] * 2 + [(16, 16)] * 4 and len(names) == 16
    torch.manual_seed(0)
    module = dino["DINO"]().eval()
    torch.manual_seed(0)
    reference = dino["DINO"]().eval()  # (its weight-normed head cannot be deep-copied)
    loss = module.training_step(formatted, 0)
    (global_views, local_views), _ = stacked
    crops = [*global_views.unbind(1), *local_views.unbind(1)]
    from lightly.models.utils import update_momentum

    update_momentum(reference.student_backbone, reference.teacher_backbone, m=0.99)  # as its training step does
    update_momentum(reference.student_head, reference.teacher_head, m=0.99)
    with torch.no_grad():
        teacher = [reference.forward_teacher(crop) for crop in crops[:2]]
        student = [reference(crop) for crop in crops]
    _close(loss.detach(), reference.criterion(teacher, student, epoch=0))


def test_a_solo_learn_module_gets_indexes_and_its_crops_large_first():
    solo = example("solo_convention")
    formatted, stacked = _same_batches(solo["solo_data"])
    indexes, crops, targets = formatted
    module = solo["SoloSimCLR"]().eval()
    assert len(crops) == module.num_crops and indexes.dtype == torch.int64
    assert [tuple(crop.shape[-2:]) for crop in crops] == [(32, 32)] * 2 + [(16, 16)] * 2
    data = solo["solo_data"](num_workers=0)
    data.setup()
    expected_targets = torch.tensor([data.training_split.targets[int(index)] for index in indexes])
    assert torch.equal(targets, expected_targets)  # the indexes name the samples
    loss = module.training_step(formatted, 0)
    (large, small), _ = stacked
    with torch.no_grad():
        _close(loss.detach(), module.loss(indexes, [*large.unbind(1), *small.unbind(1)]))


@pytest.mark.parametrize("batch_format", ["lightly", "solo"])
def test_this_projects_modules_refuse_other_formats_before_training(batch_format):
    from hfmca_lightning.errors import ConfigurationError
    from tests.helpers import bn_free_module, quiet_trainer

    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8),
        views=SimCLRViews(count=4),
        batch_size=4,
        num_workers=0,
        batch_format=batch_format,
    )
    with pytest.raises(ConfigurationError, match=f"takes stacked batches .*batch_format is '{batch_format}'"):
        quiet_trainer(max_steps=1, accelerator="cpu").fit(bn_free_module(), data)


def test_callbacks_find_the_first_view_and_the_targets_in_every_format():
    batch = _batch()
    expected = batch.groups[0][:, 0]
    for batch_format in ("stacked", "lightly", "solo"):
        images, targets = first_views(format_batch(batch, batch_format), batch_format)
        assert torch.equal(images, expected) and torch.equal(targets, batch.targets), batch_format
    one = ViewBatch([torch.rand(3, 1, 3, 8, 8)], batch.targets, batch.indices, batch.names)
    images, _ = first_views(format_batch(one, "stacked", single=True))
    assert torch.equal(images, one.groups[0][:, 0])


def _pipelines() -> dict[str, Any]:
    """``name -> () -> (views, drawer)``: every drawer, and every spec the torchvision drawer draws."""
    from lightly.transforms import SimCLRTransform

    from hfmca_lightning.data import BatchedDrawer, MultiCrop, ResidentDrawer, TorchvisionDrawer

    return {
        "torchvision": lambda: (SimCLRViews(count=2), TorchvisionDrawer()),
        "torchvision with grids": lambda: (SimCLRViews(count=2, grids=2), TorchvisionDrawer()),
        "batched, workers": lambda: (SimCLRViews(count=2), BatchedDrawer()),
        "batched, device": lambda: (SimCLRViews(count=2), BatchedDrawer(on="device")),
        "resident, 2 per call": lambda: (SimCLRViews(count=2), ResidentDrawer(batches_per_call=2)),
        "multi-crop": lambda: (MultiCrop(global_crops=2, local_crops=3), TorchvisionDrawer()),
        "lightly transform": lambda: (SimCLRTransform(input_size=16, gaussian_blur=0.0), TorchvisionDrawer()),
    }


@pytest.mark.parametrize("pipeline", list(_pipelines()))
def test_every_pipeline_gives_each_format_the_stacked_views_laid_out(pipeline):
    """lightly's and solo-learn's batches, from every drawer (in the workers or on the device after the transfer) and
    spec, are the stacked batches of the same seed laid out: every view, target and sample of an epoch, in the same
    order. Exact resume and DDP sharding, tested on the stacked batches, hold for every format."""
    from tests.helpers import epoch_batches

    make_views = _pipelines()[pipeline]

    def epoch_in(batch_format: str) -> list[Any]:
        source = SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2, image_size=16)
        views, drawer = make_views()
        module = MultiViewDataModule(
            source,
            views=views,
            drawer=drawer,
            batch_size=4,
            num_workers=0,
            seed=3,
            batch_format=batch_format,
        )
        return epoch_batches(module)

    stacked, lightly_batches, solo_batches = (epoch_in(name) for name in ("stacked", "lightly", "solo"))
    assert len(stacked) == len(lightly_batches) == len(solo_batches) == 24 // 4
    seen: list[int] = []
    for stacked_batch, (lightly_views, lightly_targets, names), (indexes, solo_views, solo_targets) in zip(
        stacked, lightly_batches, solo_batches
    ):
        views, targets = stacked_batch[0], stacked_batch[1]
        groups = views if isinstance(views, list) else [views]
        expected = [group[:, view] for group in groups for view in range(group.shape[1])]
        if len(stacked_batch) == 3:  # view grids follow the views in lightly's layout, solo-learn has none
            expected_lightly = expected + list(stacked_batch[2].unbind(1))
        else:
            expected_lightly = expected
        assert len(lightly_views) == len(expected_lightly) and len(solo_views) == len(expected)
        for got, want in zip(lightly_views, expected_lightly):
            assert torch.equal(got, want), pipeline
        for got, want in zip(solo_views, expected):
            assert torch.equal(got, want), pipeline
        assert torch.equal(lightly_targets, targets) and torch.equal(solo_targets, targets)
        assert indexes.shape == (4,) and len(names) == 4
        seen += indexes.tolist()
    assert sorted(seen) == list(range(24))  # each training image once, indexed as solo-learn expects
