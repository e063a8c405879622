"""View specs: what a sample's views are, with all their settings and their number (docs/conventions.md §5); drawers
(:mod:`hfmca_lightning.data.drawers`) say where they are drawn."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms.functional import to_pil_image

from hfmca_lightning.data.datasets import DrawnViews, SeededViews, cycled_views, same_class_views, seeded_generators
from hfmca_lightning.data.sources import UNLABELLED, LabelledImages
from hfmca_lightning.data.transforms import PerChannel, ViewAugmentation, view_transform, view_transforms
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning, check_at_least

__all__ = ["MultiCrop", "SameClassViews", "SimCLRViews", "SingleView", "TransformViews", "ViewSpec"]

Normalisation = tuple[PerChannel, PerChannel]  # (mean, std)


class ViewSpec:
    """What to draw for one sample: :attr:`num_views` views (None where only the output tells), the first
    :attr:`global_views` of them global crops; :meth:`dataset` draws them one sample at a time on the CPU."""

    single_view = False  # batches hold one image per sample, without a view axis

    @property
    def num_views(self) -> int | None:
        raise NotImplementedError

    @property
    def global_views(self) -> int | None:
        """How many leading views are global crops: all but :class:`MultiCrop`'s local ones; None: the first size's."""
        return self.num_views

    def check_split(self, split: LabelledImages, image_size: int, seed: int) -> None:
        """Before training (the data module's ``setup``): refuse a training ``split`` of ``image_size``-px images that
        these views cannot be drawn from; learn what only the data tells."""

    def dataset(self, split: LabelledImages, image_size: int, normalisation: Normalisation) -> Dataset:
        """``(index, seed) -> (groups [(n_g, C, H_g, W_g)], target, index, grids or None)`` for the training
        ``split``, at the source's ``image_size`` (unless the spec sets its own) and ``(mean, std)``."""
        raise NotImplementedError


class _Augmented(ViewSpec):
    """``count`` views of the SimCLR view distribution, from the appearance settings of :class:`SimCLRViews`."""

    grids = 0  # g > 0: each view with the source positions of a g x g grid over it (SimCLRViews only)

    def __init__(
        self,
        count: int = 2,
        crop_strength: float | None = None,
        color_strength: float | None = None,
        gray_strength: float | None = None,
        color_jitter: list[float] | None = None,
        horizontal_flip: bool = True,
        blur: float | list[float] = 0.0,
        solarize: float | list[float] = 0.0,
    ) -> None:
        check_at_least(count, 1, "count", type(self).__name__)
        check_at_least(self.grids, 0, "grids", type(self).__name__)
        self.crop_strength, self.color_strength, self.gray_strength = crop_strength, color_strength, gray_strength
        self.count, self.color_jitter, self.horizontal_flip = count, color_jitter, horizontal_flip
        self.blur, self.solarize = blur, solarize
        self.augmentation(32)  # every value checked now, in one line
        for name, value in (("blur", blur), ("solarize", solarize)):
            if isinstance(value, (list, tuple)) and len(value) > count:
                raise ConfigurationError(
                    f"{type(self).__name__}: {name} gives {len(value)} view kinds for {count} view(s) per image; the "
                    f"last {len(value) - count} would never be drawn",
                    parameter=name,
                )

    @property
    def num_views(self) -> int:
        return self.count

    def augmentation(self, image_size: int) -> ViewAugmentation:
        """The view distribution at ``image_size`` pixels (:meth:`ViewAugmentation.from_strengths`)."""
        knobs = self.crop_strength, self.color_strength, self.gray_strength, self.horizontal_flip
        return ViewAugmentation.from_strengths(image_size, *knobs, self.color_jitter, self.blur, self.solarize)

    def dataset(self, split: LabelledImages, image_size: int, normalisation: Normalisation) -> Dataset:
        transforms = view_transforms(self.augmentation(image_size), *normalisation, grid_size=self.grids)
        return SeededViews(split, partial(cycled_views, transforms, self.num_views))


class SimCLRViews(_Augmented):
    """``count`` SimCLR views of one image (paper Alg. 1; Table 2 knobs: :mod:`hfmca_lightning.data.transforms`).

    Args:
        count: views per image (HFMCA-SS on a 3x3 grid: 9; SimCLR, BYOL: 2).
        crop_strength: crop knob in [0, 1] (0: no distortion, 1: the paper's extreme; None: SimCLR's CIFAR default).
        color_strength: colour-jitter knob, as ``crop_strength``.
        gray_strength: greyscale knob, as ``crop_strength``.
        color_jitter: ``[brightness, contrast, saturation, hue]`` instead of ``color_strength``'s jitter.
        horizontal_flip: random horizontal flips.
        blur: Gaussian blur probability; a list: one per view kind, cycled over the views (BYOL: ``[1.0, 0.1]``).
        solarize: solarisation probability, as ``blur`` (BYOL: ``[0.0, 0.2]``).
        grids: ``g > 0``: views with the source positions of a ``g x g`` grid over each, ``(B, L, g, g, 2)`` (VICRegL).

    Raises:
        ConfigurationError: for a value out of range, or ``color_jitter`` and ``color_strength`` both set.
    """

    def __init__(
        self,
        count: int = 2,
        crop_strength: float | None = None,
        color_strength: float | None = None,
        gray_strength: float | None = None,
        color_jitter: list[float] | None = None,
        horizontal_flip: bool = True,
        blur: float | list[float] = 0.0,
        solarize: float | list[float] = 0.0,
        grids: int = 0,
    ) -> None:
        self.grids = grids  # checked with count, before the appearance settings
        super().__init__(
            count,
            crop_strength=crop_strength,
            color_strength=color_strength,
            gray_strength=gray_strength,
            color_jitter=color_jitter,
            horizontal_flip=horizontal_flip,
            blur=blur,
            solarize=solarize,
        )


class SingleView(_Augmented):
    """One SimCLR view per image, batched ``(images (B, C, H, W), targets)``: internal costs alone, supervised training.

    Args:
        crop_strength: as :class:`SimCLRViews`.
        color_strength: as :class:`SimCLRViews`.
        gray_strength: as :class:`SimCLRViews`.
        color_jitter: as :class:`SimCLRViews`.
        horizontal_flip: as :class:`SimCLRViews`.
        blur: as :class:`SimCLRViews`.
        solarize: as :class:`SimCLRViews`.
    """

    single_view = True

    def __init__(
        self,
        crop_strength: float | None = None,
        color_strength: float | None = None,
        gray_strength: float | None = None,
        color_jitter: list[float] | None = None,
        horizontal_flip: bool = True,
        blur: float | list[float] = 0.0,
        solarize: float | list[float] = 0.0,
    ) -> None:
        super().__init__(1, crop_strength, color_strength, gray_strength, color_jitter, horizontal_flip, blur, solarize)


class SameClassViews(_Augmented):
    """``count`` different images of one class per sample, each a SimCLR view (supervised scenario; all strengths 0 and
    no flips: plain images). The training images need labels, at least ``count`` per class.

    Args:
        count: images per group.
        crop_strength: as :class:`SimCLRViews`.
        color_strength: as :class:`SimCLRViews`.
        gray_strength: as :class:`SimCLRViews`.
        color_jitter: as :class:`SimCLRViews`.
        horizontal_flip: as :class:`SimCLRViews`.
        blur: as :class:`SimCLRViews`.
        solarize: as :class:`SimCLRViews`.
    """

    def check_split(self, split: LabelledImages, image_size: int, seed: int) -> None:
        if (torch.as_tensor(split.targets) == UNLABELLED).any():
            raise ConfigurationError(
                "SameClassViews groups images by class, but the training images have no labels", parameter="views"
            )

    def dataset(self, split: LabelledImages, image_size: int, normalisation: Normalisation) -> Dataset:
        kinds = view_transforms(self.augmentation(image_size), *normalisation)
        transforms = [kinds[member % len(kinds)] for member in range(self.count)]
        return SeededViews(split, partial(same_class_views, transforms, self._indices_by_class(split)))

    def _indices_by_class(self, split: LabelledImages) -> dict[int, Tensor]:
        """Each class's image indices in ``split``, ascending; refused when a class has fewer than ``count``."""
        targets = torch.as_tensor(split.targets)
        classes, counts = targets.unique(return_counts=True)
        groups = [group.clone() for group in targets.argsort(stable=True).split(counts.tolist())]  # own storage each
        smallest = int(counts.argmin())
        if counts[smallest] < self.count:
            raise ConfigurationError(
                f"SameClassViews needs at least count={self.count} images per class, but class "
                f"{int(classes[smallest])} has {int(counts[smallest])}; lower the count or use SimCLRViews",
                parameter="views",
            )
        return dict(zip(classes.tolist(), groups))


class MultiCrop(_Augmented):
    """Global then local crops of one image (DINO, SwAV, iBOT, MSN; defaults theirs, scaled to CIFAR-like data), each a
    SimCLR view at its group's size and crop scale. Stacked batches hold one ``(B, n_g, C, S_g, S_g)`` per group; list
    formats give the crops in order.

    Args:
        global_crops: crops in the global group.
        local_crops: crops in the local group.
        global_size: side of the global crops (default: the source's image size).
        local_size: side of the local crops (default: half the source's image size).
        global_scale: ``(smallest, largest)`` fraction of the image a global crop covers.
        local_scale: the same for a local crop.
        color_strength: as :class:`SimCLRViews`.
        gray_strength: as :class:`SimCLRViews`.
        color_jitter: as :class:`SimCLRViews`.
        horizontal_flip: as :class:`SimCLRViews`.
        blur: as :class:`SimCLRViews`.
        solarize: as :class:`SimCLRViews`.

    Raises:
        ConfigurationError: for a negative count, no crop, a size below 1, a scale not
            ``0 < smallest <= largest <= 1``, or a colour setting out of range; in the data module's ``setup``, for
            local crops larger than the global ones (crops larger than the source's images: a warning).

    Example::

        data = MultiViewDataModule(SyntheticShapes(), views=MultiCrop(global_crops=2, local_crops=6))
        (global_views, local_views), targets = next(iter(data.train_dataloader()))
        # global_views (64, 2, 3, 32, 32), local_views (64, 6, 3, 16, 16)
    """

    def __init__(
        self,
        global_crops: int = 2,
        local_crops: int = 6,
        global_size: int | None = None,
        local_size: int | None = None,
        global_scale: tuple[float, float] = (0.14, 1.0),
        local_scale: tuple[float, float] = (0.05, 0.14),
        color_strength: float | None = None,
        gray_strength: float | None = None,
        color_jitter: list[float] | None = None,
        horizontal_flip: bool = True,
        blur: float | list[float] = 0.0,
        solarize: float | list[float] = 0.0,
    ) -> None:
        check_at_least(global_crops, 0, "global_crops", "MultiCrop")
        check_at_least(local_crops, 0, "local_crops", "MultiCrop")
        if global_crops + local_crops < 1:
            raise ConfigurationError("MultiCrop needs at least one crop", parameter="global_crops")
        for name, scale in (("global_scale", global_scale), ("local_scale", local_scale)):
            if not (isinstance(scale, (tuple, list)) and len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1):
                raise ConfigurationError(
                    f"MultiCrop: {name} is (smallest, largest) fraction of the image, 0 < smallest <= largest <= 1; "
                    f"got {scale!r}",
                    parameter=name,
                )
        for name, size in (("global_size", global_size), ("local_size", local_size)):
            if size is not None:
                check_at_least(size, 1, name, "MultiCrop")
        self.global_crops, self.local_crops = global_crops, local_crops
        self.global_size, self.local_size = global_size, local_size
        self.global_scale, self.local_scale = tuple(global_scale), tuple(local_scale)
        super().__init__(
            global_crops + local_crops,  # the crop scale is each group's
            color_strength=color_strength,
            gray_strength=gray_strength,
            color_jitter=color_jitter,
            horizontal_flip=horizontal_flip,
            blur=blur,
            solarize=solarize,
        )

    @property
    def global_views(self) -> int:
        return self.global_crops

    def check_split(self, split: LabelledImages, image_size: int, seed: int) -> None:
        """Refuse local crops larger than the global ones; warn when crops are larger than the source's images."""
        sizes = [size for _, size, _ in self.groups(image_size)]  # global first
        if len(sizes) == 2 and sizes[1] > sizes[0]:
            raise ConfigurationError(
                f"MultiCrop: the local crops ({sizes[1]} px) are larger than the global ones ({sizes[0]} px); "
                f"local crops are an image's small views: make local_size at most {sizes[0]}",
                parameter="local_size",
            )
        if (largest := max(sizes)) > image_size:
            remedy = f"make global_size and local_size at most {image_size}"
            _warn_larger_views(f"MultiCrop makes {largest}-px crops", image_size, remedy)

    def groups(self, image_size: int) -> list[tuple[int, int, tuple[float, float]]]:
        """``(count, size, scale)`` of each non-empty group, global first, for a source of ``image_size`` pixels."""
        global_group = (self.global_crops, self.global_size or image_size, self.global_scale)
        local_group = (self.local_crops, self.local_size or max(1, image_size // 2), self.local_scale)
        return [group for group in (global_group, local_group) if group[0]]  # type: ignore[misc]  # pairs (checked)

    def dataset(self, split: LabelledImages, image_size: int, normalisation: Normalisation) -> Dataset:
        augmentation, groups = self.augmentation(image_size), self.groups(image_size)
        transforms: list[Any] = []
        for count, size, scale in groups:
            group = replace(augmentation, image_size=size, crop_scale=scale)
            transforms += [view_transform(group, *normalisation, view=len(transforms) + n) for n in range(count)]
        sizes = [count for count, _, _ in groups]  # global and local crops of one size stay two groups
        return SeededViews(split, partial(cycled_views, transforms, len(transforms)), sizes)


class TransformViews(ViewSpec):
    """Any callable PIL image -> list of ``(C, H, W)`` views (lightly's ``SimCLRTransform``, a user's; the data module
    wraps a callable ``views`` in this), under torch's, Python's and numpy's generators seeded from the sample's seed.
    Consecutive views of equal shape form a group (DINO's global, then local crops), counted on the first sample.

    Args:
        transform: image -> list of ``(C, H, W)`` tensors.

    Raises:
        ConfigurationError: when ``transform`` is not callable.

    Example::

        from lightly.transforms import SimCLRTransform

        data = MultiViewDataModule(CIFAR("cifar10"), views=SimCLRTransform(input_size=32), batch_format="lightly")
    """

    def __init__(self, transform: Callable[[Any], Sequence[Tensor]]) -> None:
        if not callable(transform):
            message = f"TransformViews needs a callable image -> list of views; got {type(transform).__name__}"
            raise ConfigurationError(message, parameter="transform")
        self.transform = transform
        self._counted_views: int | None = None

    @property
    def num_views(self) -> int | None:
        return self._counted_views  # known from the output only: None until :meth:`check_split`

    @property
    def global_views(self) -> None:
        return None  # each batch's first group

    def check_split(self, split: LabelledImages, image_size: int, seed: int) -> None:
        """Count the views the transform makes of the first image; warn when they are larger than the source's."""
        groups = self.dataset(split, 0, ((), ()))[(0, seed)][0]
        shapes = [tuple(group.shape[1:]) for group in groups if group.dim() != 4 or group.shape[1] != 3]
        if shapes:  # else the backbone's first layer fails at the first step
            raise ConfigurationError(
                f"TransformViews: the views of the first image have shape {shapes[0]}; give (3, H, W) RGB view "
                "tensors, as the source's images and the evaluation images are",
                parameter="views",
            )
        self._counted_views, (height, width) = sum(len(group) for group in groups), groups[0].shape[-2:]
        if max(height, width) > image_size:  # lightly's 224 px on CIFAR, say
            _warn_larger_views(
                f"the views transform makes {height}x{width} views",
                image_size,
                f"give the transform that size (lightly: input_size={image_size}) and the source's normalisation "
                "(its mean and std)",
            )

    def dataset(self, split: LabelledImages, image_size: int, normalisation: Normalisation) -> Dataset:
        return SeededViews(split, partial(_transformed_views, self.transform))


def _warn_larger_views(views: str, image_size: int, remedy: str) -> None:
    """One warning for views larger than the source's images (upsampled in training, unlike every evaluation)."""
    rank_zero_warn(
        f"{views} of the source's {image_size}-px images, which kNN, probes and analysis read at {image_size} px; "
        f"{remedy}",
        category=HFMCAWarning,
    )


def _transformed_views(transform: Callable[[Any], Any], split: LabelledImages, index: int, seed: int) -> DrawnViews:
    image, target = split[index]
    with seeded_generators(seed):
        views = transform(to_pil_image(image) if isinstance(image, Tensor) else image)
    no_list = not isinstance(views, Sequence) or not views
    if no_list or not all(isinstance(view, Tensor) for view in views):
        name = getattr(transform, "__name__", type(transform).__name__)
        what = type(views).__name__ if no_list else "a list with non-tensors"
        message = f"TransformViews: {name} must return a list of (C, H, W) view tensors; got {what}"
        raise ConfigurationError(message, parameter="views")
    return list(views), target
