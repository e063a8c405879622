"""SimCLR view augmentations with the strength knobs of the paper's Table 2 (docs/conventions.md §5).

Each knob maps 0 -> no distortion and 1 -> the paper's extreme; ``None`` keeps the SimCLR CIFAR default:

========  ==============================================  ===================  =====================
knob      meaning of strength t                            SimCLR default       t = 1
========  ==============================================  ===================  =====================
crop      RandomResizedCrop scale (1 - t (1 - 1/HW), 1)    scale (0.08, 1)      any patch, 1x1 to full
color     ColorJitter(0.8t, 0.8t, 0.8t, 0.2t), p = 0.8     t = 0.5 (0.4, ..0.1)  twice the default
gray      RandomGrayscale p = t                            t = 0.2              always grey
========  ==============================================  ===================  =====================

At crop strength 0 the view is the whole image (scale and aspect ratio 1). Transforms run on one image
at a time, so every view draws its own parameters (batched v2 transforms would share one draw,
pytorch/vision #8484).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.transforms import v2

from hfmca_lightning.errors import ConfigurationError

__all__ = ["ViewAugmentation", "view_transform", "eval_transform", "resize_transform", "DEFAULT_CROP_SCALE", "DEFAULT_COLOR_STRENGTH", "DEFAULT_GRAY_STRENGTH"]

DEFAULT_CROP_SCALE = (0.08, 1.0)
DEFAULT_COLOR_STRENGTH = 0.5
DEFAULT_GRAY_STRENGTH = 0.2


def _check_strength(name: str, value: float | None) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ConfigurationError(f"{name} must be in [0, 1] (0: no distortion, 1: the paper's extreme) or null; got {value}", parameter=name)


@dataclass(frozen=True)
class ViewAugmentation:
    """The parameters of one SimCLR view distribution, shared by the CPU and the on-device pipelines."""

    image_size: int
    crop_scale: tuple[float, float]
    crop_ratio: tuple[float, float]
    jitter: tuple[float, float, float, float]  # brightness, contrast, saturation, hue; all 0 = no jitter
    jitter_p: float
    gray_p: float
    horizontal_flip: bool

    @classmethod
    def from_strengths(
        cls,
        image_size: int,
        crop_strength: float | None = None,
        color_strength: float | None = None,
        gray_strength: float | None = None,
        horizontal_flip: bool = True,
    ) -> ViewAugmentation:
        """Map the Table 2 knobs (module docstring) to parameters."""
        for name, value in (("crop_strength", crop_strength), ("color_strength", color_strength), ("gray_strength", gray_strength)):
            _check_strength(name, value)
        if crop_strength is None:
            scale, ratio = DEFAULT_CROP_SCALE, (3 / 4, 4 / 3)
        elif crop_strength == 0:
            scale, ratio = (1.0, 1.0), (1.0, 1.0)
        else:
            scale, ratio = (1.0 - crop_strength * (1.0 - 1.0 / image_size**2), 1.0), (3 / 4, 4 / 3)
        color = DEFAULT_COLOR_STRENGTH if color_strength is None else color_strength
        gray = DEFAULT_GRAY_STRENGTH if gray_strength is None else gray_strength
        jitter = (0.8 * color, 0.8 * color, 0.8 * color, 0.2 * color)
        return cls(image_size, scale, ratio, jitter, 0.8 if color > 0 else 0.0, gray, horizontal_flip)


def view_transform(spec: ViewAugmentation, mean: tuple[float, ...], std: tuple[float, ...]) -> v2.Compose:
    """One random SimCLR view of a uint8 / PIL image -> normalised float ``(3, image_size, image_size)``,
    drawn from ``spec`` (the distribution :class:`DeviceViewAugmentation` draws from on the device)."""
    steps: list[v2.Transform] = [v2.ToImage(), v2.RandomResizedCrop(spec.image_size, scale=spec.crop_scale, ratio=spec.crop_ratio, antialias=True)]
    if spec.horizontal_flip:
        steps.append(v2.RandomHorizontalFlip())
    if spec.jitter_p > 0:
        steps.append(v2.RandomApply([v2.ColorJitter(*spec.jitter)], p=spec.jitter_p))
    if spec.gray_p > 0:
        steps.append(v2.RandomGrayscale(p=spec.gray_p))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(steps)


def eval_transform(image_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> v2.Compose:
    """No augmentation: resize (shorter side) and centre-crop to ``image_size``, then normalise."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(image_size, antialias=True),
            v2.CenterCrop(image_size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean, std),
        ]
    )


def resize_transform(image_size: int) -> v2.Compose:
    """uint8 image resized (shorter side) and centre-cropped to ``image_size``: the CPU half of on-device augmentation."""
    return v2.Compose([v2.ToImage(), v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])
