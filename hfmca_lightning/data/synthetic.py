"""Procedural shape images: a small, offline, class-structured image data set, and its source."""

from __future__ import annotations

import numpy as np

from hfmca_lightning.data.sources import ArrayImages, ImageSource
from hfmca_lightning.errors import ConfigurationError, check_at_least

__all__ = ["SHAPES", "SyntheticShapes", "generate_shapes"]

SHAPES = ("disk", "square", "triangle", "ring", "cross", "h_stripes", "v_stripes", "checker", "diamond", "two_disks")


def _mask(shape: str, y: np.ndarray, x: np.ndarray, radius: float) -> np.ndarray:
    """Boolean mask of ``shape`` centred at 0 with size ``radius`` on coordinate grids ``y``, ``x``."""
    ay, ax = np.abs(y), np.abs(x)
    inside = np.maximum(ay, ax) <= radius
    if shape == "disk":
        return y**2 + x**2 <= radius**2
    if shape == "square":
        return inside
    if shape == "triangle":
        return (y <= radius * 0.8) & (ay <= radius) & (ax <= (y + radius) * 0.55)
    if shape == "ring":
        r2 = y**2 + x**2
        return (r2 <= radius**2) & (r2 >= (0.55 * radius) ** 2)
    if shape == "cross":
        return inside & ((ay <= radius * 0.3) | (ax <= radius * 0.3))
    if shape == "h_stripes":
        return inside & (np.floor((y + radius) / (radius * 0.4)) % 2 == 0)
    if shape == "v_stripes":
        return inside & (np.floor((x + radius) / (radius * 0.4)) % 2 == 0)
    if shape == "checker":
        cell = radius * 0.5
        return inside & ((np.floor((y + radius) / cell) + np.floor((x + radius) / cell)) % 2 == 0)
    if shape == "diamond":
        return ay + ax <= radius
    if shape == "two_disks":
        offset, small = radius * 0.5, radius * 0.45
        return ((y + offset) ** 2 + (x + offset) ** 2 <= small**2) | ((y - offset) ** 2 + (x - offset) ** 2 <= small**2)
    raise ValueError(f"unknown shape {shape!r}")


def generate_shapes(num_classes: int, per_class: int, image_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``per_class`` images of each of the first ``num_classes`` shapes, ordered by class: images ``(N, S, S, 3)``
    uint8 and targets ``(N,)`` int64 (the settings are checked by :class:`SyntheticShapes`)."""
    rng = np.random.default_rng(seed)
    coords = np.arange(image_size, dtype=np.float64) + 0.5
    images = np.empty((num_classes * per_class, image_size, image_size, 3), dtype=np.uint8)
    targets = np.repeat(np.arange(num_classes), per_class)
    for index, target in enumerate(targets):
        radius = image_size * rng.uniform(0.22, 0.36)
        cy, cx = rng.uniform(radius, image_size - radius, size=2)
        y, x = np.meshgrid(coords - cy, coords - cx, indexing="ij")
        mask = _mask(SHAPES[target], y, x, radius)
        background = rng.uniform(0, 255, size=3)
        foreground = (background + rng.uniform(80, 175, size=3)) % 255
        noise = rng.normal(0, 12, size=(image_size, image_size, 3))
        images[index] = np.clip(np.where(mask[..., None], foreground, background) + noise, 0, 255).astype(np.uint8)
    return images, targets


class SyntheticShapes(ImageSource):
    """The procedurally generated data set of the offline demo and the tests, deterministic from ``seed``, not stored:
    each class is a shape (disk, square, triangle, ring, cross, stripes, ...) in random colours, position and size over
    a noisy background, so a representation must see shape, not colour, to separate the classes.

    Args:
        num_classes: shapes, hence classes, in ``[2, 10]``.
        train_per_class: training images per class.
        test_per_class: test images per class.
        image_size: side of the square images, ``>= 8``.
        seed: seeds the generation.
    """

    def __init__(
        self,
        num_classes: int = 10,
        train_per_class: int = 200,
        test_per_class: int = 50,
        image_size: int = 32,
        seed: int = 0,
    ) -> None:
        if not 2 <= num_classes <= len(SHAPES):
            raise ConfigurationError(
                f"SyntheticShapes has {len(SHAPES)} shapes; num_classes must be in [2, {len(SHAPES)}], got "
                f"{num_classes}",
                parameter="num_classes",
            )
        check_at_least(train_per_class, 1, "train_per_class", "SyntheticShapes")
        check_at_least(test_per_class, 1, "test_per_class", "SyntheticShapes")
        check_at_least(seed, 0, "seed", "SyntheticShapes")
        self._image_settings(image_size, None, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
        self.num_classes, self.train_per_class, self.test_per_class = num_classes, train_per_class, test_per_class
        self.seed = seed

    def split(self, train: bool) -> ArrayImages:
        per_class = self.train_per_class if train else self.test_per_class
        images, targets = generate_shapes(self.num_classes, per_class, self.image_size, self.seed * 2 + int(not train))
        return ArrayImages(images, targets)
