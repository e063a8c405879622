"""Any torch ``Dataset`` of ``(image, target)`` pairs as an image source (from YAML: docs/training.md). Its images
(PIL; ``(H, W, C)`` / ``(H, W)`` arrays or ``(C, H, W)`` / ``(H, W)`` tensors, ``C`` 1 or 3, uint8 or floats in
``[0, 1]``) reach every drawer as ``(3, H, W)`` uint8 tensors, greyscale repeated over the three channels."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence, Sized
from typing import Any, cast

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from hfmca_lightning.data.sources import UNLABELLED, ImageSource, LabelledImages, pil_rgb, unit_floats_to_uint8
from hfmca_lightning.errors import ConfigurationError, check_at_least

__all__ = ["DatasetSource", "as_uint8_image"]


class DatasetSource(ImageSource):
    """Training (and optionally test) images from torch ``Dataset``\\ s of ``(image, target)`` pairs.

    Args:
        train: the training split (targets: its ``targets`` attribute, through its ``target_transform``, where it has
            one of its length, else read once from its pairs).
        test: the test split of the evaluation protocols (kNN, probes), ``train`` their bank; ``None``: no evaluation.
        num_classes: ``None``: one more than the largest training target.
        image_size: side of the square views.
        mean: per-channel normalisation mean (RGB, images in ``[0, 1]``).
        std: per-channel normalisation standard deviation.
        eval_resize: shorter side of evaluation images before the centre crop (``None``: ``image_size``).

    Raises:
        ConfigurationError: when a split is not a sized data set, or a setting is out of its range.
    """

    def __init__(
        self,
        train: Dataset,
        test: Dataset | None = None,
        num_classes: int | None = None,
        image_size: int = 32,
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.25, 0.25, 0.25),
        eval_resize: int | None = None,
    ) -> None:
        for name, split in (("train", train), ("test", test)):
            if split is not None and not (hasattr(split, "__len__") and hasattr(split, "__getitem__")):
                raise ConfigurationError(
                    f"DatasetSource: {name} must be a data set with a length and indexing; got {type(split).__name__}",
                    parameter=name,
                )
        self._image_settings(image_size, eval_resize, mean, std)
        self.train, self.test, self._train_images = train, test, DatasetImages(train)
        targets = self._train_images.targets
        labelled = [target for target in targets if target != UNLABELLED]
        if min(labelled, default=0) < 0:
            raise ConfigurationError(
                f"DatasetSource: a training target is {min(labelled)}; targets are class indices >= 0, or "
                f"{UNLABELLED} for an image without a class",
                parameter="train",
            )
        largest = max(labelled, default=-1)
        if num_classes is not None:
            check_at_least(num_classes, 1, "num_classes", "DatasetSource")  # null: from the targets (0: none)
        self.num_classes = largest + 1 if num_classes is None else num_classes
        if self.num_classes <= largest:
            raise ConfigurationError(
                f"DatasetSource: num_classes {self.num_classes} does not hold the training targets (largest {largest})",
                parameter="num_classes",
            )
        if test is not None and len(labelled) < len(targets):
            raise ConfigurationError(
                f"DatasetSource: {len(targets) - len(labelled)} training images have no class (target {UNLABELLED}), "
                "but with a test split the training split is the bank of kNN and probes: label them, or leave out test",
                parameter="test",
            )

    def split(self, train: bool) -> LabelledImages:
        if train:
            return self._train_images
        if self._test_images is None:
            raise ConfigurationError("DatasetSource has no test split; give `test` for the evaluation protocols")
        return self._test_images

    def evaluation_splits(self) -> tuple[LabelledImages, LabelledImages] | None:
        return None if self._test_images is None else (self._train_images, self._test_images)

    @functools.cached_property
    def _test_images(self) -> DatasetImages | None:
        if self.test is None:
            return None
        images = DatasetImages(self.test)
        outside = [target for target in images.targets if not 0 <= target < self.num_classes]
        if outside:
            raise ConfigurationError(
                f"DatasetSource: {len(outside)} test targets are outside the {self.num_classes} classes of the "
                f"training split (e.g. {outside[0]}); the test split must use the training split's class indices",
                parameter="test",
            )
        return images


class DatasetImages(LabelledImages):
    """A data set of ``(image, target)`` pairs as a split: ``split[i] -> ((3, H, W) uint8 tensor, target)``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        found, length = getattr(dataset, "targets", None), len(cast(Sized, dataset))  # sized: DatasetSource checks
        if found is None or len(found) != length:
            found = [self._pair(index)[1] for index in range(length)]
        elif callable(transform := getattr(dataset, "target_transform", None)):  # the pairs' targets, as torchvision's
            found = [transform(target) for target in found]
        self.targets = [_class_index(target, index) for index, target in enumerate(found)]

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return as_uint8_image(self._pair(index)[0]), self.targets[index]

    def _pair(self, index: int) -> tuple[Any, Any]:
        sample = self.dataset[index]
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            what = f" of {len(sample)}" if isinstance(sample, (tuple, list)) else ""
            raise ConfigurationError(
                f"{type(self.dataset).__name__}[{index}] is a {type(sample).__name__}{what}; DatasetSource needs "
                "(image, target) pairs"
            )
        return sample[0], sample[1]


def _class_index(target: Any, index: int) -> int:
    """``target`` as a class index: an integer (Python, numpy, a one-integer tensor, or a float of integer value, as
    ``TensorDataset(x, y.float())`` gives); anything else is one line."""
    try:
        if isinstance(target, float | np.floating) or (isinstance(target, Tensor) and target.is_floating_point()):
            if not float(target).is_integer():
                raise TypeError
            return int(target)
        return operator.index(target)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigurationError(
            f"DatasetSource: the target of sample {index} is {target!r}, not a class index; give integer class "
            f"indices ({UNLABELLED}: no class)"
        ) from None


def as_uint8_image(image: Any) -> Tensor:
    """The ``(3, H, W)`` uint8 tensor of an image of a kind the module docstring lists (floats are rounded)."""
    if isinstance(image, Image.Image):
        return pil_rgb(image)
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(np.ascontiguousarray(image))
        image = image.permute(2, 0, 1) if image.dim() == 3 else image
    what = "DatasetSource: an image"
    if not isinstance(image, Tensor):
        raise ConfigurationError(f"{what} is a {type(image).__name__}; give PIL images, arrays or tensors")
    image = image.unsqueeze(0) if image.dim() == 2 else image
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise ConfigurationError(f"{what} has shape {tuple(image.shape)}; give (3, H, W), (1, H, W) or (H, W)")
    if image.is_floating_point():
        image = unit_floats_to_uint8(image, what)
    elif image.dtype != torch.uint8:
        raise ConfigurationError(f"{what} is {image.dtype}; give uint8 or floats in [0, 1]")
    return image.expand(3, -1, -1).contiguous() if image.shape[0] == 1 else image
