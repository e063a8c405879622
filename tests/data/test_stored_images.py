"""The training split kept on the device (``ResidentDrawer``'s images): resized folders, and the memory check (the
batches it gives are tested in tests/data/test_resident.py)."""

from __future__ import annotations

import pytest
import torch

from hfmca_lightning.data import ImageFolderSource
from hfmca_lightning.data.stored_images import StoredImages
from hfmca_lightning.data.transforms import resize_transform
from hfmca_lightning.errors import ConfigurationError
from tests.helpers import write_image_folder


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
        match=r"^ResidentDrawer: the training split takes 0\.0 GiB as uint8, more than half of the 0\.0 GiB free on "
        r"cuda.*\(drawer: BatchedDrawer\)$",
    ) as error:
        stored.to(torch.device("cuda"))
    assert error.value.parameter == "drawer"
