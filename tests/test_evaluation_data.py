"""Images and batches of a data module for evaluation, analysis and figures (hfmca_lightning/evaluation_data.py): the
training views of every drawer (``hfmca analyze``) with their workers gone when the reading stops, the labelled
splits, fine-tuning batches, and the un-augmented images of the figures."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch

from hfmca_lightning.data import (
    BatchedDrawer,
    DatasetSource,
    MultiCrop,
    MultiViewDataModule,
    ResidentDrawer,
    SimCLRViews,
    SyntheticShapes,
)
from hfmca_lightning.data.batch_formats import ViewBatch
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation_data import (
    denormalise,
    figure_batches,
    figure_images,
    finetune_loader,
    labelled_splits,
    view_batches,
)

CPU = torch.device("cpu")


def data(views: Any = None, drawer: Any = None, batch_size: int = 4, workers: int = 0, **options: Any):
    source = options.pop("source", SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2))
    views = SimCLRViews(count=4) if views is None else views
    return MultiViewDataModule(
        source, views=views, drawer=drawer, batch_size=batch_size, num_workers=workers, **options
    )


@pytest.mark.parametrize(
    ("views", "drawer"),
    [
        (None, None),
        (None, BatchedDrawer()),
        (None, BatchedDrawer(on="device")),
        (None, ResidentDrawer(2)),
        (MultiCrop(2, 2), None),
    ],
    ids=["torchvision", "batched workers", "batched device", "resident", "multi-crop"],
)
def test_analysis_gets_view_batches_from_every_drawer(views, drawer):
    """``view_batches`` (what ``hfmca analyze`` reads) draws through the configured drawer, on the device, whatever
    the training loader yields (images, indices and seeds): views, never indices."""
    module = data(views, drawer)
    module.setup()
    batches = list(view_batches(module, CPU, limit=2))
    assert len(batches) == 2 and all(isinstance(batch, ViewBatch) for batch in batches)
    for batch in batches:
        assert all(group.dtype == torch.float32 and group.dim() == 5 for group in batch.groups)
        assert batch.num_views == 4 and batch.targets.shape == (4,)


def _alive(pids: set[int]) -> set[int]:
    """The processes of ``pids`` still running (not finished, not a zombie)."""
    psutil = pytest.importorskip("psutil")
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("stop", ["closed early", "limit reached"])
def test_view_batches_leave_no_worker_behind(stop):
    """A data module with persistent workers: the loader of ``view_batches`` is its own, and its two workers are gone
    as soon as the reading stops, closed after the first batch or at its ``limit``, not kept for another epoch."""
    module = data(workers=2, persistent_workers=True)
    module.setup()
    before = {process.pid for process in multiprocessing.active_children()}
    batches = view_batches(module, CPU, limit=2 if stop == "limit reached" else None)
    next(batches)
    workers = {process.pid for process in multiprocessing.active_children()} - before
    assert len(workers) == 2 and _alive(workers) == workers
    if stop == "closed early":
        batches.close()
    else:
        assert len(list(batches)) == 1
    assert _alive(workers) == set()
    assert not workers & {process.pid for process in multiprocessing.active_children()}


def test_the_labelled_splits_are_the_sources_evaluation_splits_or_one_line():
    module = data()
    train, test = labelled_splits(module)
    assert (len(train), len(test)) == (24, 6) and (train, test) == module.evaluation_splits
    unlabelled = MultiViewDataModule(DatasetSource(SyntheticShapes(num_classes=2).split(True)), num_workers=0)
    with (
        pytest.warns(UserWarning, match="no labelled evaluation split"),
        pytest.raises(
            ConfigurationError,
            match="DatasetSource has no labelled evaluation splits; kNN and linear evaluation need them",
        ),
    ):
        labelled_splits(unlabelled)


def test_finetune_batches_are_shuffled_augmented_images_of_the_chosen_samples():
    module = data(batch_size=4)
    train, _ = labelled_splits(module)
    images, targets = next(iter(finetune_loader(module)))
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32 and targets.shape == (4,)
    chosen = [1, 5, 9, 13, 17, 21]
    seen = torch.cat([targets for _, targets in finetune_loader(module, indices=chosen, seed=3)])
    assert len(seen) == 4  # the short last batch dropped
    assert set(seen.tolist()) <= {train.targets[index] for index in chosen}
    first, again = (torch.cat([images for images, _ in finetune_loader(module, seed=3)]) for _ in range(2))
    assert first.shape == (24, 3, 32, 32) and not torch.equal(first, again)  # augmented: new views each pass
    orders = [torch.cat([t for _, t in finetune_loader(module, indices=range(24), seed=seed)]) for seed in (3, 3, 4)]
    assert torch.equal(orders[0], orders[1]) and not torch.equal(orders[0], orders[2])  # shuffled by the seed


def test_figure_images_are_unaugmented_test_images_of_a_class_from_an_index():
    module = data()
    _, test = labelled_splits(module)
    images, targets = figure_images(module, 3, target=2, start=1)
    indices = [index for index in range(1, len(test)) if test.targets[index] == 2][:3]
    assert targets.tolist() == [2] * len(indices) and len(indices) == 2  # fewer than asked: all there are
    expected = torch.stack([module.eval_transform(test[index][0]) for index in indices])
    torch.testing.assert_close(images, expected, rtol=0, atol=0)
    with pytest.raises(
        ConfigurationError,
        match=r"^the evaluation split has no images of class 7 from index 0 on \(6 images; classes 0, 1, 2\)$",
    ):
        figure_images(module, 3, target=7)


def test_figure_images_of_any_class_take_each_class_in_turn():
    """SyntheticShapes' test split is stored class by class (``0 0 1 1 2 2``), as image folders are: the figures'
    images are the first of each class, then the second, from ``start`` on."""
    module = data()
    _, test = labelled_splits(module)
    assert test.targets == [0, 0, 1, 1, 2, 2]
    for start, count, indices in ((0, 5, [0, 2, 4, 1, 3]), (1, 3, [1, 2, 4])):
        images, targets = figure_images(module, count, start=start)
        assert targets.tolist() == [test.targets[index] for index in indices]
        expected = torch.stack([module.eval_transform(test[index][0]) for index in indices])
        torch.testing.assert_close(images, expected, rtol=0, atol=0)


def test_figure_batches_hold_the_first_images_in_evaluation_batches():
    module = data(eval_batch_size=4)
    _, test = labelled_splits(module)
    batches = list(figure_batches(module, 5))
    assert [len(batch) for batch in batches] == [4, 1]
    expected = torch.stack([module.eval_transform(test[index][0]) for index in range(5)])
    torch.testing.assert_close(torch.cat(batches), expected, rtol=0, atol=0)
    assert sum(len(batch) for batch in figure_batches(module, 100)) == 6  # at most the split


def test_denormalise_undoes_the_sources_normalisation():
    module = data()
    pixels = torch.rand(2, 3, 8, 8)
    mean = torch.tensor(module.source.mean).view(1, 3, 1, 1)
    std = torch.tensor(module.source.std).view(1, 3, 1, 1)
    torch.testing.assert_close(denormalise(module, (pixels - mean) / std), pixels, rtol=0, atol=1e-6)
    assert float(denormalise(module, torch.full((1, 3, 2, 2), 100.0)).max()) == 1.0  # clamped to [0, 1]
