"""The training split kept in the accelerator's memory for :class:`~hfmca_lightning.data.ResidentDrawer`: for data
sets that fit (CIFAR's 50,000 images are 150 MB as uint8), the images travel to the device once and each training
batch is only its samples' indices and seeds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hfmca_lightning.data.sources import ArrayImages, LabelledImages
from hfmca_lightning.data.transforms import resize_transform
from hfmca_lightning.errors import ConfigurationError

__all__ = ["StoredImages"]

# The most of the device's free memory the stored images may take (the rest is the model's).
DEVICE_MEMORY_SHARE = 0.5


class StoredImages:
    """A split's images as one ``(N, C, S, S)`` uint8 tensor and their targets ``(N,)`` int64, on one device.

    Args:
        images: ``(N, C, S, S)`` uint8.
        targets: ``(N,)`` int64 (``UNLABELLED`` for images without a class).
    """

    def __init__(self, images: Tensor, targets: Tensor) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or targets.shape != images.shape[:1]:
            raise ValueError(
                f"expected (N, C, S, S) uint8 images and (N,) targets; got {images.dtype} {tuple(images.shape)} and "
                f"{tuple(targets.shape)}"
            )
        self.images, self.targets = images, targets

    @classmethod
    def from_split(cls, split: LabelledImages, image_size: int) -> StoredImages:
        """Every image of ``split`` resized (shorter side) and centre-cropped to ``image_size``, as the CPU workers'
        ``resize_transform`` does; arrays of that size already (CIFAR, SyntheticShapes) are taken as they are."""
        targets = torch.tensor(split.targets, dtype=torch.int64)
        if isinstance(split, ArrayImages) and tuple(split.images.shape[-2:]) == (image_size, image_size):
            return cls(split.images.contiguous(), targets)
        resize = resize_transform(image_size)
        return cls(torch.stack([resize(split[index][0]) for index in range(len(split))]), targets)

    @property
    def device(self) -> torch.device:
        return self.images.device

    def to(self, device: torch.device) -> StoredImages:
        """The images on ``device``; a clear error when they would take more than half of its free memory."""
        if device == self.images.device:
            return self
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if self.images.numel() > DEVICE_MEMORY_SHARE * free:
                raise ConfigurationError(
                    f"ResidentDrawer: the training split takes {self.images.numel() / 2**30:.1f} GiB as uint8, "
                    f"more than half of the {free / 2**30:.1f} GiB free on {device}; draw the views in CPU workers "
                    "instead (drawer: BatchedDrawer)",
                    parameter="drawer",
                )
        return StoredImages(self.images.to(device), self.targets.to(device))
