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
from hfmca_lightning.data.sources import UNLABELLED

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


def test_the_dict_formats_lay_out_the_same_views_in_new_plain_dicts():
    """stable-pretraining's layouts: a list of view dicts, or the same by name (global crops, then local ones)."""
    batch = _batch()
    expected = [batch.groups[0][:, 0], batch.groups[0][:, 1], *batch.groups[1].unbind(1)]
    listed, named = format_batch(batch, "dict"), format_batch(batch, "dict_named")
    assert type(listed) is dict and type(named) is dict and type(named["views"]) is dict
    assert list(named["views"]) == ["global_0", "global_1", "local_0", "local_1", "local_2", "local_3"]
    for views in (listed["views"], list(named["views"].values())):
        assert len(views) == len(expected)
        for view, want in zip(views, expected):
            assert type(view) is dict and set(view) == {"image", "label", "sample_idx"}
            assert torch.equal(view["image"], want) and torch.equal(view["label"], batch.targets)
            assert torch.equal(view["sample_idx"], batch.indices)
    assert torch.equal(listed["label"], batch.targets) and torch.equal(named["sample_idx"], batch.indices)
    unlabelled = ViewBatch(batch.groups, torch.tensor([UNLABELLED, 0, UNLABELLED]), batch.indices, batch.names)
    assert format_batch(unlabelled, "dict")["views"][3]["label"].tolist() == [-1, 0, -1]
    listed["batch_idx"] = 0  # as stable-pretraining's training_step does: the next batch is a new dict
    assert "batch_idx" not in format_batch(batch, "dict")
    one = ViewBatch([torch.rand(3, 1, 3, 8, 8)], batch.targets, batch.indices, batch.names)
    single = format_batch(one, "dict", single=True)
    assert set(single) == {"image", "label", "sample_idx"} and torch.equal(single["image"], one.groups[0][:, 0])


def test_named_views_follow_the_spec_not_the_sizes():
    """Global and local crops of one size fall in one group of views; the names follow the spec's count of global
    crops (stable-pretraining's DINO sends the global ones, and only those, through its teacher)."""
    from hfmca_lightning.data import MultiCrop

    def names(views: MultiCrop) -> list[str]:
        source = SyntheticShapes(num_classes=2, train_per_class=4, image_size=16)
        data = MultiViewDataModule(source, views=views, batch_format="dict_named", batch_size=4, num_workers=0)
        return list(next(iter(data.train_dataloader()))["views"])

    assert names(MultiCrop(global_crops=2, local_crops=3, local_size=16)) == [
        "global_0", "global_1", "local_0", "local_1", "local_2"
    ]  # fmt: skip
    assert names(MultiCrop(global_crops=0, local_crops=2)) == ["local_0", "local_1"]
    assert names(SimCLRViews(count=3)) == ["global_0", "global_1", "global_2"]


def _spt_module(spt: dict[str, Any], method: str) -> Any:
    torch.manual_seed(0)
    return spt["SPTModule"](spt[method])


def test_a_simclr_module_written_for_stable_pretraining_trains_on_a_list_of_view_dicts():
    """stable-pretraining's SimCLR reads ``batch["views"]``, a list of two ``{"image", "label"}``: its loss on the
    dict batch equals NT-Xent on the same views stacked."""
    spt = example("stable_pretraining_convention")
    formatted, stacked = _same_batches(lambda **options: spt["spt_data"]("simclr", **options))
    module = _spt_module(spt, "simclr")
    outputs = module.training_step(formatted, 7)
    assert formatted["batch_idx"] == 7  # it wrote into the batch
    views, targets = stacked
    with torch.no_grad():
        projections = [module.projector(module.backbone(view)) for view in views.unbind(1)]
        _close(outputs["loss"].detach(), module.simclr_loss(*projections))
        embeddings = torch.cat([module.backbone(view) for view in views.unbind(1)])
    _close(outputs["embedding"], embeddings)
    assert torch.equal(outputs["label"], targets.repeat(2))
    with pytest.raises(ValueError, match="expected a dict of named views"):  # DINO refuses a list, as its original
        spt["dino"](module, formatted, "fit")


def test_a_dino_module_written_for_stable_pretraining_trains_on_named_crops():
    """stable-pretraining's DINO reads the views by name: global crops through the teacher, all through the student;
    its loss on the ``dict_named`` batch equals the DINO loss on the same crops stacked."""
    spt = example("stable_pretraining_convention")
    formatted, stacked = _same_batches(lambda **options: spt["spt_data"]("dino", **options))
    assert list(formatted["views"]) == ["global_0", "global_1", "local_0", "local_1"]
    module = _spt_module(spt, "dino")
    criterion = copy.deepcopy(module.dino_loss)  # the loss moves its centre on every call
    outputs = module.training_step(formatted, 0)
    (global_views, local_views), _ = stacked
    global_images = global_views.transpose(0, 1).flatten(0, 1)  # view after view, as the step concatenates them
    local_images = local_views.transpose(0, 1).flatten(0, 1)
    with torch.no_grad():
        teacher = module.teacher_projector(module.teacher_backbone(global_images)).chunk(2)
        student = [*module.projector(module.backbone(global_images)).chunk(2),
                   *module.projector(module.backbone(local_images)).chunk(2)]  # fmt: skip
        _close(outputs["loss"].detach(), criterion(list(teacher), student, epoch=0))


@pytest.mark.parametrize("batch_format", ["lightly", "solo", "dict", "dict_named"])
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
    for batch_format in ("stacked", "lightly", "solo", "dict", "dict_named"):
        images, targets = first_views(format_batch(batch, batch_format), batch_format)
        assert torch.equal(images, expected) and torch.equal(targets, batch.targets), batch_format
    one = ViewBatch([torch.rand(3, 1, 3, 8, 8)], batch.targets, batch.indices, batch.names)
    for batch_format in ("stacked", "dict"):
        images, _ = first_views(format_batch(one, batch_format, single=True), batch_format)  # type: ignore[arg-type]
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


def expected_views(stacked_batch: Any) -> list[Any]:
    """Every view of a stacked batch, ``(B, C, H, W)`` each, global crops first."""
    views = stacked_batch[0]
    groups = views if isinstance(views, list) else [views]
    return [group[:, view] for group in groups for view in range(group.shape[1])]


@pytest.mark.parametrize("pipeline", list(_pipelines()))
def test_every_pipeline_gives_each_format_the_stacked_views_laid_out(pipeline):
    """lightly's, solo-learn's and stable-pretraining's batches, from every drawer (in the workers or on the device
    after the transfer) and spec, are the stacked batches of the same seed laid out: every view, target and sample of
    an epoch, in the same order."""
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

    stacked, lightly_batches, dict_batches = (epoch_in(name) for name in ("stacked", "lightly", "dict"))
    named_batches = epoch_in("dict_named")
    # solo-learn's batches have no place for grids: that pair is refused (test_spec_drawer_pairs)
    solo_batches = None if pipeline == "torchvision with grids" else epoch_in("solo")
    assert len(stacked) == len(lightly_batches) == len(dict_batches) == len(solo_batches or stacked) == 24 // 4
    seen: list[int] = []
    for position, stacked_batch in enumerate(stacked):
        lightly_views, lightly_targets, names = lightly_batches[position]
        dict_batch, named = dict_batches[position], named_batches[position]
        indexes, solo_views, solo_targets = (
            solo_batches[position]
            if solo_batches
            else (dict_batch["sample_idx"], expected_views(stacked_batch), stacked_batch[1])
        )
        targets = stacked_batch[1]
        expected = expected_views(stacked_batch)
        if len(stacked_batch) == 3:  # view grids follow the views in lightly's layout
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
        # stable-pretraining's: the same views and grids, in a list and by name, with the same labels and indexes
        for views_of in (dict_batch["views"], list(named["views"].values())):
            assert len(views_of) == len(expected)
            assert all(torch.equal(view["image"], want) for view, want in zip(views_of, expected)), pipeline
            assert all(torch.equal(view["label"], targets) and torch.equal(view["sample_idx"], indexes)
                       for view in views_of)  # fmt: skip
            if len(stacked_batch) == 3:
                assert all(torch.equal(view["grid"], grid) for view, grid in zip(views_of, stacked_batch[2].unbind(1)))
        assert torch.equal(dict_batch["label"], targets) and torch.equal(named["sample_idx"], indexes)
        seen += indexes.tolist()
    assert sorted(seen) == list(range(24))  # each training image once, indexed as solo-learn expects
