"""The training split kept on the device (``images_on_device``), with the device set to the CPU: the batches of the
batched CPU workers, nothing read on the host or copied from Python while views are drawn, resized folders, and
clear errors for what it cannot do."""

from __future__ import annotations

import pytest
import torch

from hfmca_lightning.data import CIFAR, ImageFolderSource, MultiViewDataModule, SyntheticShapes
from hfmca_lightning.data.stored_images import StoredImages
from hfmca_lightning.data.transforms import resize_transform
from hfmca_lightning.diagnostics import HostReads, OperationCounts
from hfmca_lightning.errors import ConfigurationError
from tests.helpers import write_image_folder


def test_the_stored_images_give_the_batches_of_the_batched_workers(cifar10_on_disk):
    """Every batch of an epoch (CIFAR's layout on disk, 2 workers on the worker path): the same views and targets."""
    source = CIFAR(root=str(cifar10_on_disk), verify=False)
    workers = MultiViewDataModule(
        source, num_views=4, batch_size=8, num_workers=2, worker_augmentation="batched", seed=3
    )
    stored = MultiViewDataModule(source, num_views=4, batch_size=8, num_workers=2, images_on_device=True, seed=3)
    stored_loader = stored.train_dataloader()
    assert stored_loader.num_workers == 0  # a batch is 8 indices and 8 seeds
    batches = 0
    for (views, targets), keys in zip(workers.train_dataloader(), stored_loader):
        assert keys[0].dtype == torch.int64 and keys[0].shape == (8,)
        stored_views, stored_targets = stored.draw_views(keys)
        torch.testing.assert_close(stored_views, views, rtol=0, atol=0)
        assert torch.equal(stored_targets, targets)
        batches += 1
    assert batches == 100 // 8


def test_drawing_views_reads_nothing_on_the_host_and_copies_no_python_constants():
    """With the hue computed on all rows and selected (the default on GPUs), a batch's views come from tensors on the
    device alone: no host read of a device value, no tensor made from Python data."""
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8),
        num_views=4,
        batch_size=6,
        num_workers=0,
        images_on_device=True,
        blur=[1.0, 0.1],
        solarize=[0.0, 0.2],
    )
    data.view_augmentation.select_rows = False
    keys = next(iter(data.train_dataloader()))
    data.draw_views(keys)  # the first call places the images and the pipeline's constants
    with HostReads() as reads, OperationCounts(torch.ops.aten.lift_fresh) as from_python:
        views, targets = data.draw_views(keys)
    assert reads.reads == [] and from_python.count == 0
    assert views.shape == (6, 4, 3, 32, 32) and targets.shape == (6,)


def test_images_of_another_size_are_stored_resized_like_the_workers_resize_them(tmp_path):
    write_image_folder(tmp_path, per_class=2, size=40)
    source = ImageFolderSource(str(tmp_path), image_size=32)
    split = source.training_split()
    stored = StoredImages.from_split(split, 32)
    assert stored.images.shape == (6, 3, 32, 32) and stored.targets.tolist() == split.targets
    assert torch.equal(stored.images[4], resize_transform(32)(split[4][0]))


def test_a_split_too_large_for_the_device_is_one_clear_error(monkeypatch):
    stored = StoredImages(torch.zeros(10, 3, 32, 32, dtype=torch.uint8), torch.zeros(10, dtype=torch.int64))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40_000, 80_000))
    with pytest.raises(
        ConfigurationError,
        match=r"takes 0\.0 GiB as uint8, more than half of the 0\.0 GiB free on cuda.*images_on_device: false",
    ):
        stored.to(torch.device("cuda"))


@pytest.mark.parametrize(
    "options",
    [{"mode": "same_class"}, {"augment_on_device": True}, {"worker_augmentation": "kornia"}],
    ids=["same_class", "augment_on_device", "kornia"],
)
def test_images_on_device_with_another_pipeline_is_rejected(options):
    with pytest.raises(ConfigurationError, match="images_on_device draws the views of mode 'views' on the device"):
        MultiViewDataModule(SyntheticShapes(), images_on_device=True, **options)
