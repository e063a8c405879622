"""Drawers of a view spec's views: :class:`TorchvisionDrawer` (any spec, CPU workers), :class:`BatchedDrawer` (whole
batches, CPU workers or device), :class:`~hfmca_lightning.data.ResidentDrawer` (training set on the device). Each
sample's views come from its seed alone: runs do not depend on the number of workers or processes and resume exactly."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import torch
from torch import Tensor
from torch.utils.data import Dataset

from hfmca_lightning.data.batch_formats import ViewBatch
from hfmca_lightning.data.batched_augment import BatchedViewAugmentation
from hfmca_lightning.data.datasets import Sample, SampleKey, SeededRandomSampler
from hfmca_lightning.data.sources import LabelledImages
from hfmca_lightning.data.transforms import resize_transform
from hfmca_lightning.data.view_specs import Normalisation, SimCLRViews, ViewSpec
from hfmca_lightning.errors import ConfigurationError, check_choice

__all__ = ["BatchedDrawer", "ImageBatch", "TorchvisionDrawer", "ViewDrawer", "check_drawer"]

OutputDtype = Literal["float32", "bfloat16"]
DrawnOn = Literal["workers", "device"]


@dataclass(frozen=True)
class DrawSetup:
    """What a drawer draws: the spec, and the source's image size and normalisation."""

    views: ViewSpec
    image_size: int
    normalisation: Normalisation


class ViewDrawer:
    """Draws in loader workers (:meth:`collate` gives the views) or on the device (:meth:`collate` gives images or
    indices, :meth:`draw` the views after the transfer). Each data module draws with its own copy (:meth:`bind`)."""

    draws: tuple[type[ViewSpec], ...] = (ViewSpec,)  # the specs it can draw (read by check_drawer)
    records_grids = True  # whether it draws crop grids
    draws_on_device = False
    uses_workers = True  # else the training loader runs in the main process

    def __init__(self) -> None:
        self._setup: DrawSetup | None = None
        self._clear()

    def _clear(self) -> None:
        """Forget what was drawn or kept for a setup (drawers with caches override it)."""

    @property
    def setup(self) -> DrawSetup:
        if self._setup is None:
            raise RuntimeError(f"{type(self).__name__} has no views to draw: use the one a MultiViewDataModule holds")
        return self._setup

    def bind(self, setup: DrawSetup) -> ViewDrawer:
        """A copy of this drawer that draws ``setup`` (with nothing cached from another)."""
        bound = copy.copy(self)
        bound._setup = setup
        bound._clear()
        return bound

    def prepare(self, split: LabelledImages, device: torch.device | None) -> None:
        """Ready for the training split before training starts (so a split too large for the device fails first)."""

    def batching(self, sampler: SeededRandomSampler, batch_size: int) -> dict[str, Any]:
        """The training loader's ``sampler``, ``batch_size`` and ``drop_last`` (default: short last batch dropped)."""
        return {"sampler": sampler, "batch_size": batch_size, "drop_last": True}

    def dataset(self, split: LabelledImages) -> Dataset:
        """The training loader's dataset: the items of :meth:`batching`'s sampler -> samples for :meth:`collate`."""
        raise NotImplementedError

    def collate(self, samples: list[Any]) -> Any:
        """A :class:`ViewBatch` (drawing in the workers) or the batch :meth:`draw` takes."""
        raise NotImplementedError

    def draw(self, batch: Any) -> ViewBatch:
        """Drawing on the device: the views of a transferred batch, each sample's from its own seed."""
        raise NotImplementedError(f"{type(self).__name__} draws its views in the data-loader workers")


class TorchvisionDrawer(ViewDrawer):
    """Each sample's views by the spec's per-image transforms (torchvision's or a user's) in CPU workers: every spec."""

    def dataset(self, split: LabelledImages) -> Dataset:
        return self.setup.views.dataset(split, self.setup.image_size, self.setup.normalisation)

    def collate(self, samples: list[Sample]) -> ViewBatch:
        groups, targets, indices, grids = zip(*samples)
        shapes = sorted({tuple(tuple(group.shape) for group in sample) for sample in groups})
        if len(shapes) > 1:  # a user transform's views: stacked, they would be cut to the fewest or fail in torch
            raise ConfigurationError(
                f"the images of one batch got different views (view groups {shapes[0]} and {shapes[1]}): a views "
                "transform must give every image the same number of views, of the same sizes",
                parameter="views",
            )
        return ViewBatch(
            [torch.stack(group) for group in zip(*groups)],
            torch.tensor(targets, dtype=torch.int64),
            torch.tensor(indices, dtype=torch.int64),
            [str(index) for index in indices],
            None if grids[0] is None else torch.stack(grids),
        )


@dataclass
class ImageBatch:
    """Images whose views are drawn after the transfer: ``images (B, C, H, W)`` uint8 at the views' size, their
    ``targets``, ``indices`` and per-sample ``seeds`` (int64), and names."""

    images: Tensor
    targets: Tensor
    indices: Tensor
    seeds: Tensor
    names: list[str] = field(default_factory=list)

    def pin_memory(self) -> ImageBatch:
        pinned = {name: getattr(self, name).pin_memory() for name in ("images", "targets", "indices", "seeds")}
        return replace(self, **pinned)


class _ImagesToDraw(Dataset):
    """``(index, seed) -> (uint8 image at the view size, target, index, seed)``."""

    def __init__(self, split: LabelledImages, image_size: int) -> None:
        self.split, self.resize = split, resize_transform(image_size)

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, int, int, int]:
        image, target = self.split[key[0]]
        return self.resize(image), int(target), int(key[0]), int(key[1])


class SeededDrawer(ViewDrawer):
    """Drawers of :class:`~hfmca_lightning.data.batched_augment.BatchedViewAugmentation`'s views, in ``output_dtype``,
    channels-last if asked: what a bf16 channels-last backbone takes as is."""

    draws = (SimCLRViews,)
    records_grids = False

    def __init__(self, output_dtype: OutputDtype, channels_last: bool) -> None:
        super().__init__()
        check_choice(output_dtype, get_args(OutputDtype), "output_dtype", type(self).__name__)
        self.output_dtype, self.channels_last = output_dtype, channels_last

    def _clear(self) -> None:
        self._augmentation: BatchedViewAugmentation | None = None

    @property
    def augmentation(self) -> BatchedViewAugmentation:
        if self._augmentation is None:
            views, size = self.setup.views, self.setup.image_size
            assert isinstance(views, SimCLRViews)  # check_drawer: SimCLRViews only
            self._augmentation = BatchedViewAugmentation(views.augmentation(size), *self.setup.normalisation)
        return self._augmentation

    def _views(self, images: Tensor, seeds: Tensor) -> Tensor:
        """``(B, L, C, S, S)`` views of ``images (B, C, H, W)`` uint8, in ``output_dtype``, channels-last if asked."""
        count: int = self.setup.views.num_views  # type: ignore[assignment]  # SimCLRViews: known
        views = self.augmentation.to(images.device).views_from_seeds(images, seeds, count)
        views = views.to(torch.bfloat16) if self.output_dtype == "bfloat16" else views
        if self.channels_last:  # each view channels-last, in the (B, L, C, S, S) shape
            views = views.flatten(0, 1).contiguous(memory_format=torch.channels_last).view(views.shape)
        return views


class BatchedDrawer(SeededDrawer):
    """:class:`~hfmca_lightning.data.SimCLRViews` without grids, a whole batch's views at once
    (:class:`~hfmca_lightning.data.batched_augment.BatchedViewAugmentation`) of the images resized and centre-cropped
    to the view size, each image's from its own seed: in the CPU workers' collate (several times
    :class:`TorchvisionDrawer`'s views per core on CIFAR-sized images) or on the device after the uint8 images'
    transfer, the same views either way.

    Args:
        on: ``workers`` or ``device``.
        output_dtype: ``on: device``: ``float32`` or ``bfloat16`` (what a bf16 run's backbone takes).
        channels_last: ``on: device``: views laid out channels-last.

    Raises:
        ConfigurationError: when ``on`` or ``output_dtype`` is none of the above, or ``output_dtype`` /
            ``channels_last`` are set for views drawn in the workers (they travel as float32).
    """

    def __init__(
        self, on: DrawnOn = "workers", output_dtype: OutputDtype = "float32", channels_last: bool = False
    ) -> None:
        check_choice(on, get_args(DrawnOn), "on", "BatchedDrawer")
        super().__init__(output_dtype, channels_last)
        if on == "workers" and (output_dtype != "float32" or channels_last):
            raise ConfigurationError(
                "BatchedDrawer: output_dtype and channels_last apply to views drawn on the device (on: device); the "
                "workers' views travel as float32",
                parameter="output_dtype" if output_dtype != "float32" else "channels_last",
            )
        self.on, self.draws_on_device = on, on == "device"

    def dataset(self, split: LabelledImages) -> Dataset:
        return _ImagesToDraw(split, self.setup.image_size)

    def collate(self, samples: list[tuple[Tensor, int, int, int]]) -> ImageBatch | ViewBatch:
        images, *keys = zip(*samples)
        targets, indices, seeds = (torch.tensor(values, dtype=torch.int64) for values in keys)
        batch = ImageBatch(torch.stack(images), targets, indices, seeds, [str(index) for index in indices.tolist()])
        return batch if self.draws_on_device else self.draw(batch)

    def draw(self, batch: ImageBatch) -> ViewBatch:
        return ViewBatch([self._views(batch.images, batch.seeds)], batch.targets, batch.indices, batch.names)


def check_drawer(views: ViewSpec, drawer: ViewDrawer) -> None:
    """The one check of whether ``drawer`` can draw ``views``: a one-line ``ConfigurationError`` naming one that can."""
    name = type(drawer).__name__
    if not isinstance(views, drawer.draws):
        what = ", ".join(spec.__name__ for spec in drawer.draws)
        raise ConfigurationError(
            f"{name} draws {what} only; {type(views).__name__} is drawn by TorchvisionDrawer (set drawer: "
            f"TorchvisionDrawer, or views: {what})",
            parameter="drawer",
        )
    if isinstance(views, SimCLRViews) and views.grids and not drawer.records_grids:
        message = f"{name} does not record crop grids; SimCLRViews(grids={views.grids}) is drawn by TorchvisionDrawer"
        raise ConfigurationError(message, parameter="drawer")
