"""Image sources: where images come from (docs/conventions.md §5), as :class:`LabelledImages` splits. Missing or
bad data raises in :meth:`ImageSource.prepare` or a split method (before training), an undecodable image when read."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from hfmca_lightning.errors import ConfigurationError, check_at_least

__all__ = ["ArrayImages", "ImageSource", "LabelledImages", "UNLABELLED"]

UNLABELLED = -1  # the target of an image without a class


def channel_values(values: Sequence[float], name: str) -> tuple[float, float, float]:
    """``values`` as an RGB triple: a ``mean`` in [0, 1] or a ``std`` in (0, 1] of images in [0, 1]; else one error."""
    if len(values) != 3 or not all(0 < value <= 1 or (name == "mean" and value == 0) for value in values):  # NaN too
        interval = "[0, 1]" if name == "mean" else "(0, 1]"
        raise ConfigurationError(
            f"{name} needs one value in {interval} per RGB channel, a statistic of images in [0, 1] (0-255 "
            f"statistics: divide by 255); got {list(values)}",
            parameter=name,
        )
    return float(values[0]), float(values[1]), float(values[2])


def pil_rgb(image: Image.Image) -> Tensor:
    """A PIL image as an RGB uint8 tensor ``(3, H, W)``, deeper greyscale scaled, not clipped: 16-bit (modes ``I;16``,
    ``I`` in 0..65535) to its high byte, floats (mode ``F``) by :func:`unit_floats_to_uint8`; other values refused."""
    if image.mode == "F":
        grey = unit_floats_to_uint8(torch.from_numpy(np.asarray(image, dtype=np.float64)), "a mode F image")
    elif image.mode.startswith("I"):
        values = np.asarray(image, dtype=np.int64)
        low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
        if not 0 <= low <= high <= 65535:
            raise ConfigurationError(
                f"a mode {image.mode} image holds {low} to {high}; give integers of at most 16 bits"
            )
        grey = torch.from_numpy((values >> 8).astype(np.uint8))
    else:
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
    return grey.expand(3, -1, -1).contiguous()


def unit_floats_to_uint8(values: Tensor, what: str) -> Tensor:
    """Floats in [0, 1] as uint8, rounded (within 0.1 of [0, 1]: clamped); other values: one error naming ``what``."""
    low, high = (float(value) for value in values.aminmax()) if values.numel() else (0.0, 0.0)
    if not -0.1 <= low <= high <= 1.1:  # NaN too
        raise ConfigurationError(
            f"{what} holds values from {low:g} to {high:g}; give floats in [0, 1], not normalised (the source "
            "normalises with its mean and std; floats in [0, 255]: divide by 255), or uint8"
        )
    return (values.clamp(0, 1) * 255).round().to(torch.uint8)


class LabelledImages(Dataset):
    """A split: ``dataset[i] -> (uint8 tensor (3, H, W) or PIL image, class index)``, all targets in :attr:`targets`."""

    targets: list[int]

    def __len__(self) -> int:
        return len(self.targets)


class ArrayImages(LabelledImages):
    """Images in memory: one ``(N, H, W, 3)`` uint8 array and ``N`` targets (``UNLABELLED``: no class).

    Raises:
        ValueError: when ``images`` is not an ``(N, H, W, 3)`` uint8 array or ``targets`` has not ``N`` entries.
    """

    def __init__(self, images: np.ndarray, targets: Sequence[int] | np.ndarray) -> None:
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"expected (N, H, W, 3) uint8 images; got {images.shape} {images.dtype}")
        if len(images) != len(targets):
            raise ValueError(f"{len(images)} images but {len(targets)} targets")
        self.images = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
        self.targets = [int(t) for t in targets]

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.images[index], self.targets[index]


class ImageSource(ABC):
    """Where images come from. Subclasses are configured from YAML with ``class_path`` / ``init_args``."""

    num_classes: int
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    eval_resize: int | None = None  # evaluation images' shorter side before the centre crop (None: image_size)

    def prepare(self) -> None:  # noqa: B027 - optional: sources without files to fetch or check keep this no-op
        """Download (if asked) and check that the data is there; run once, on one process."""

    @abstractmethod
    def split(self, train: bool) -> LabelledImages:
        """The train (``train=True``) or test split: its images and targets."""

    def training_split(self) -> LabelledImages:
        """The images the model trains on (targets may be ``UNLABELLED``)."""
        return self.split(train=True)

    def evaluation_splits(self) -> tuple[LabelledImages, LabelledImages] | None:
        """The labelled ``(bank, queries)`` of kNN and probes, or ``None`` when the source has no labels."""
        return self.split(train=True), self.split(train=False)

    def _image_settings(
        self, image_size: int, eval_resize: int | None, mean: Sequence[float], std: Sequence[float]
    ) -> None:
        """Check and keep the settings views are read with (``mean``, ``std``: :func:`channel_values`)."""
        owner = type(self).__name__
        check_at_least(image_size, 8, "image_size", owner)
        if eval_resize is not None:
            check_at_least(eval_resize, 1, "eval_resize", owner)
        if eval_resize is not None and eval_resize < image_size:
            raise ConfigurationError(
                f"{owner}: eval_resize ({eval_resize}) is the shorter side before the centre crop of image_size "
                f"({image_size}), so it must be >= image_size (or null: image_size)",
                parameter="eval_resize",
            )
        self.image_size, self.eval_resize = image_size, eval_resize
        self.mean, self.std = channel_values(mean, "mean"), channel_values(std, "std")
