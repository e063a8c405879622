"""Procedural shape images: a small, offline, class-structured image data set."""

from __future__ import annotations

import numpy as np

__all__ = ["SHAPES", "generate_shapes"]

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
        small = radius * 0.45
        return ((y + radius * 0.5) ** 2 + (x + radius * 0.5) ** 2 <= small**2) | (
            (y - radius * 0.5) ** 2 + (x - radius * 0.5) ** 2 <= small**2
        )
    raise ValueError(f"unknown shape {shape!r}")


def generate_shapes(num_classes: int, per_class: int, image_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``per_class`` images of each of the first ``num_classes`` shapes.

    Returns:
        images ``(num_classes * per_class, image_size, image_size, 3)`` uint8 and targets ``(N,)`` int64,
        ordered by class.
    """
    if not 2 <= num_classes <= len(SHAPES):
        raise ValueError(
            f"SyntheticShapes has {len(SHAPES)} shapes; num_classes must be in [2, {len(SHAPES)}], got {num_classes}"
        )
    if per_class < 1 or image_size < 8:
        raise ValueError(f"need per_class >= 1 and image_size >= 8; got {per_class}, {image_size}")
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
        picture = np.where(mask[..., None], foreground, background) + rng.normal(
            0, 12, size=(image_size, image_size, 3)
        )
        images[index] = np.clip(picture, 0, 255).astype(np.uint8)
    return images, targets
