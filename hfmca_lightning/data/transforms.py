"""SimCLR view augmentations with the strength knobs of the paper's Table 2 (docs/conventions.md §5): 0 -> no
distortion, 1 -> the paper's extreme, ``None`` -> the SimCLR CIFAR default:

========  ==============================================  ===================  =====================
knob      meaning of strength t                            SimCLR default       t = 1
========  ==============================================  ===================  =====================
crop      RandomResizedCrop scale (1 - t (1 - 1/HW), 1)    scale (0.08, 1)      any patch, 1x1 to full
color     ColorJitter(0.8t, 0.8t, 0.8t, 0.2t), p = 0.8     t = 0.5 (0.4, ..0.1)  twice the default
gray      RandomGrayscale p = t                            t = 0.2              always grey
========  ==============================================  ===================  =====================

Crop strength 0: the whole image (scale, aspect ratio 1). Blur and solarisation (ImageNet scale) take per-view-kind
probabilities, as lightly's (BYOL: ``color_jitter=(0.4, 0.4, 0.2, 0.1), blur=(1.0, 0.1), solarize=(0.0, 0.2)``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image, ImageFilter
from torch import nn
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor, to_pil_image

from hfmca_lightning.errors import ConfigurationError

__all__ = [
    "RandomGaussianBlur",
    "ViewAugmentation",
    "eval_transform",
    "resize_transform",
    "view_transform",
    "view_transforms",
]

DEFAULT_CROP_SCALE = (0.08, 1.0)
BLUR_SIGMA = (0.1, 2.0)
SOLARIZE_THRESHOLD = 128  # of 255, as lightly's RandomSolarization (PIL's solarize)
DEFAULT_COLOR_STRENGTH = 0.5
DEFAULT_GRAY_STRENGTH = 0.2
PerChannel = tuple[float, ...]  # a mean or a standard deviation, one value per channel


@dataclass(frozen=True)
class ViewAugmentation:
    """The view distribution every drawer draws (:meth:`from_strengths`: from the Table 2 knobs).

    Args:
        image_size: side of the square views.
        crop_scale: ``RandomResizedCrop`` scale range.
        crop_ratio: ``RandomResizedCrop`` aspect-ratio range.
        jitter: colour jitter ``(brightness, contrast, saturation, hue)``; all 0: no jitter.
        jitter_p: probability of the colour jitter.
        gray_p: probability of greyscale.
        horizontal_flip: random horizontal flips.
        blur_p: probability of a Gaussian blur, per view kind (:meth:`kind`).
        solarize_p: probability of a solarisation, per view kind.
    """

    image_size: int
    crop_scale: tuple[float, float]
    crop_ratio: tuple[float, float]
    jitter: tuple[float, float, float, float]
    jitter_p: float
    gray_p: float
    horizontal_flip: bool
    blur_p: tuple[float, ...] = (0.0,)
    solarize_p: tuple[float, ...] = (0.0,)

    @property
    def view_kinds(self) -> int:
        """How many different view distributions there are (views cycle through them)."""
        return max(len(self.blur_p), len(self.solarize_p))

    def kind(self, view: int) -> tuple[float, float]:
        """``(blur probability, solarisation probability)`` of view number ``view`` of a group (its kind's)."""
        return self.blur_p[view % len(self.blur_p)], self.solarize_p[view % len(self.solarize_p)]

    @property
    def blur_kernel(self) -> int:
        """Odd kernel size of the batched blur: about 10 % of the image side (SimCLR: 23 at 224 px), and at least
        three of the largest sigmas either side, as far as PIL's blur of the per-image views reaches (three box
        passes); below the image side (its reflect padding)."""
        wide = max(2 * math.ceil(3 * BLUR_SIGMA[1]) + 1, int(0.1 * self.image_size) // 2 * 2 + 1)
        return min(wide, 2 * self.image_size - 1)

    @classmethod
    def from_strengths(
        cls,
        image_size: int,
        crop_strength: float | None = None,
        color_strength: float | None = None,
        gray_strength: float | None = None,
        horizontal_flip: bool = True,
        color_jitter: Sequence[float] | None = None,
        blur: float | Sequence[float] = 0.0,
        solarize: float | Sequence[float] = 0.0,
    ) -> ViewAugmentation:
        """The distribution of the Table 2 knobs (module docstring); ``color_jitter`` ``(brightness, contrast,
        saturation, hue)`` replaces the colour knob's jitter.

        Raises:
            ConfigurationError: for a strength or probability not in [0, 1], blur and solarisation lists of two
                lengths, or a ``color_jitter`` out of range or set together with ``color_strength``.
        """
        strengths = {"crop_strength": crop_strength, "color_strength": color_strength, "gray_strength": gray_strength}
        for name, value in strengths.items():
            if value is not None and not 0.0 <= value <= 1.0:
                message = f"{name} must be in [0, 1] (0: no distortion, 1: the paper's extreme) or null; got {value}"
                raise ConfigurationError(message, parameter=name)
        blur_p, solarize_p = _probabilities("blur", blur), _probabilities("solarize", solarize)
        if min(len(blur_p), len(solarize_p)) > 1 and len(blur_p) != len(solarize_p):
            raise ConfigurationError(
                f"blur gives {len(blur_p)} view kinds and solarize {len(solarize_p)}: give one probability per view "
                "kind in both lists (the same length), or a single value",
                parameter="solarize",
            )
        ratio = (1.0, 1.0) if crop_strength == 0 else (3 / 4, 4 / 3)
        scale = DEFAULT_CROP_SCALE if crop_strength is None else (1 - crop_strength * (1 - 1 / image_size**2), 1.0)
        color = DEFAULT_COLOR_STRENGTH if color_strength is None else color_strength
        gray = DEFAULT_GRAY_STRENGTH if gray_strength is None else gray_strength
        jitter = (0.8 * color, 0.8 * color, 0.8 * color, 0.2 * color)
        if color_jitter is not None:
            given = list(color_jitter)
            if color_strength is not None:
                raise ConfigurationError(
                    f"color_jitter {given} replaces the jitter of color_strength ({color_strength}): set one of them",
                    parameter="color_jitter",
                )
            if len(given) != 4 or not (all(0 <= value < math.inf for value in given[:3]) and 0 <= given[3] <= 0.5):
                raise ConfigurationError(
                    f"color_jitter is (brightness, contrast, saturation, hue), finite and >= 0, hue at most 0.5; got "
                    f"{given}",
                    parameter="color_jitter",
                )
            brightness, contrast, saturation, hue = map(float, given)
            jitter = (brightness, contrast, saturation, hue)
        jitter_p = 0.8 if any(jitter) else 0.0
        return cls(image_size, scale, ratio, jitter, jitter_p, gray, horizontal_flip, blur_p, solarize_p)


def _probabilities(name: str, value: float | Sequence[float]) -> tuple[float, ...]:
    values = (float(value),) if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        message = f"{name} is a probability in [0, 1], or a list of them (one per view kind); got {value!r}"
        raise ConfigurationError(message, parameter=name)
    return values


def view_transform(spec: ViewAugmentation, mean: PerChannel, std: PerChannel, view: int = 0) -> v2.Compose:
    """uint8 / PIL image -> normalised float view ``(3, S, S)`` of ``spec`` with view ``view``'s kind: crop, flip,
    colour jitter, greyscale, blur, solarisation, normalisation (lightly's SimCLR / BYOL order)."""
    crop = v2.RandomResizedCrop(spec.image_size, scale=spec.crop_scale, ratio=spec.crop_ratio, antialias=True)
    flip = [v2.RandomHorizontalFlip()] if spec.horizontal_flip else []
    return v2.Compose([v2.ToImage(), crop, *flip, *appearance_steps(spec, mean, std, view)])


def appearance_steps(spec: ViewAugmentation, mean: PerChannel, std: PerChannel, view: int = 0) -> list[nn.Module]:
    """:func:`view_transform`'s steps after the crop and flip, to normalisation, with kind ``view``'s probabilities."""
    steps: list[nn.Module] = []
    if spec.jitter_p > 0:
        steps.append(v2.RandomApply([v2.ColorJitter(*spec.jitter)], p=spec.jitter_p))
    if spec.gray_p > 0:
        steps.append(v2.RandomGrayscale(p=spec.gray_p))
    blur_p, solarize_p = spec.kind(view)
    if blur_p > 0:
        steps.append(RandomGaussianBlur(p=blur_p, sigma=BLUR_SIGMA))
    if solarize_p > 0:
        steps.append(v2.RandomSolarize(threshold=SOLARIZE_THRESHOLD, p=solarize_p))
    return steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]


class ViewWithGrid(nn.Module):
    """image -> ``(view (3, S, S), grid (g, g, 2))``, ``grid[i, j]`` the ``(x, y)`` source pixel of the centre of cell
    ``(i, j)`` (row, column) of a ``g x g`` grid over the view, after its flip: lightly's location-recording crop and
    flip (VICRegL's) with ``spec``'s settings, then :func:`appearance_steps`. Cell centres are
    ``left + (j + 1/2) w / g`` as in the VICRegL authors' code; lightly's ``RandomResizedCropAndFlip`` (not used) spaces
    them ``w / (g - 1)`` apart (``linspace`` over the crop plus half a cell), putting the last outside the crop."""

    def __init__(self, spec: ViewAugmentation, mean: PerChannel, std: PerChannel, view: int, grid_size: int) -> None:
        super().__init__()
        from lightly.transforms import random_crop_and_flip_with_grid as located

        self.grid_size = grid_size
        self.to_image = v2.ToImage()
        self.crop = located.RandomResizedCropWithLocation(
            size=spec.image_size, scale=spec.crop_scale, ratio=spec.crop_ratio, antialias=True
        )
        self.flip = located.RandomHorizontalFlipWithLocation(p=0.5 if spec.horizontal_flip else 0.0)
        self.appearance = v2.Compose(appearance_steps(spec, mean, std, view))

    def forward(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        view, location = self.crop(self.to_image(image))
        view, location = self.flip(view, location)
        cells = torch.arange(self.grid_size, dtype=torch.float32) + 0.5
        x = location.left + cells * (location.width / self.grid_size)
        y = location.top + cells * (location.height / self.grid_size)
        if location.horizontal_flip:
            x = x.flip(0)
        grid_x, grid_y = torch.meshgrid(x, y, indexing="xy")  # [i, j] = (x_j, y_i)
        return self.appearance(view), torch.stack([grid_x, grid_y], dim=-1)


class RandomGaussianBlur(nn.Module):
    """With probability ``p``, PIL's Gaussian blur of radius (sigma) uniform in ``sigma``, as lightly's (PIL's separable
    filter is much faster than torchvision's 23 x 23 kernel at 224 px: docs/benchmarks/cpu.md). Draws from torch's
    generator, so views stay a function of their sample seed."""

    def __init__(self, p: float = 0.5, sigma: tuple[float, float] = BLUR_SIGMA) -> None:
        super().__init__()
        self.p, self.sigma = p, sigma

    def forward(self, image: Any) -> Any:
        if float(torch.rand(())) >= self.p:
            return image
        radius = self.sigma[0] + float(torch.rand(())) * (self.sigma[1] - self.sigma[0])
        pil = image if isinstance(image, Image.Image) else to_pil_image(image)
        blurred = pil.filter(ImageFilter.GaussianBlur(radius=radius))
        return blurred if pil is image else tv_tensors.wrap(pil_to_tensor(blurred), like=image)

    def extra_repr(self) -> str:
        return f"p={self.p}, sigma={self.sigma}"


def view_transforms(spec: ViewAugmentation, mean: PerChannel, std: PerChannel, grid_size: int = 0) -> list[nn.Module]:
    """A :func:`view_transform` per view kind (view ``l``: ``l % len``); ``grid_size > 0``: :class:`ViewWithGrid`."""
    if grid_size > 0:
        return [ViewWithGrid(spec, mean, std, kind, grid_size) for kind in range(spec.view_kinds)]
    return [view_transform(spec, mean, std, view=kind) for kind in range(spec.view_kinds)]


def eval_transform(image_size: int, mean: PerChannel, std: PerChannel, resize: int | None = None) -> v2.Compose:
    """uint8 / PIL image -> normalised float ``(3, image_size, image_size)``, without augmentation: the shorter side
    resized to ``resize`` (default ``image_size``; ImageNet: 256 for 224), centre-cropped, normalised."""
    steps = [v2.ToImage(), v2.Resize(resize or image_size, antialias=True), v2.CenterCrop(image_size)]
    return v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def finetune_transform(image_size: int, mean: PerChannel, std: PerChannel) -> v2.Compose:
    """Fine-tuning augmentation (standard): ``RandomResizedCrop(image_size, scale=(0.08, 1))``, flip, normalise."""
    crop = v2.RandomResizedCrop(image_size, scale=(0.08, 1.0), antialias=True)
    steps = [v2.ToImage(), crop, v2.RandomHorizontalFlip()]
    return v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def resize_transform(image_size: int) -> v2.Compose:
    """uint8 image resized (shorter side) and centre-cropped to ``image_size``: on-device augmentation's CPU half."""
    return v2.Compose([v2.ToImage(), v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])
