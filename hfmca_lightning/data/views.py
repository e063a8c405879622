"""View pipelines: how the views of a training batch are drawn (docs/conventions.md §5).

:class:`~hfmca_lightning.data.MultiViewDataModule` holds one, chosen in the config by ``class_path``::

    views:
      class_path: hfmca_lightning.data.BatchedViews
      init_args: {on: workers}

========================  ==========================================================================================
pipeline                  draws
========================  ==========================================================================================
:class:`TorchvisionViews` one torchvision call per view in CPU workers (the default; every mode; VICRegL's grids)
:class:`BatchedViews`     the views of a whole batch in a fixed number of tensor operations, in CPU workers or on the
                          device (:class:`~hfmca_lightning.data.batched_augment.BatchedViewAugmentation`)
:class:`ResidentViews`    the training set kept on the device, the views of ``batches_per_call`` batches per call
:class:`MultiCrop`        groups of crops of different sizes and scales (DINO, SwAV: global and local crops)
:class:`TransformViews`   any callable image -> list of views (lightly's ``SimCLRTransform``, ``DINOTransform``, ...)
========================  ==========================================================================================

Each sample's views come from its seed alone (the sampler's, :class:`~hfmca_lightning.data.SeededRandomSampler`), so
runs do not depend on the number of workers, resume exactly and shard the same under DDP, on every pipeline.
The SimCLR distribution (the data module's ``crop_strength``, ``color_strength``, ... knobs) is what the first four
draw; :class:`TransformViews` draws its transform's own.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler
from torchvision.transforms.functional import to_pil_image

from hfmca_lightning.data.batch_formats import ViewBatch, stack_samples
from hfmca_lightning.data.batched_augment import BatchedViewAugmentation
from hfmca_lightning.data.datasets import (
    MultiViewDataset,
    SameClassDataset,
    SeededImageDataset,
    SeededRandomSampler,
    SingleViewDataset,
)
from hfmca_lightning.data.sources import LabelledImages
from hfmca_lightning.data.stored_images import StoredImages
from hfmca_lightning.data.transforms import ViewAugmentation, resize_transform, view_transform, view_transforms
from hfmca_lightning.errors import ConfigurationError

__all__ = [
    "BatchedViews",
    "ImageBatch",
    "MultiCrop",
    "ResidentBatch",
    "ResidentViews",
    "TorchvisionViews",
    "TransformViews",
    "ViewPipeline",
    "ViewSetup",
]

Mode = Literal["views", "same_class", "single"]
Where = Literal["workers", "device"]
OutputDtype = Literal["float32", "bfloat16"]
_PARAMETER = "views"


@dataclass(frozen=True)
class ViewSetup:
    """What a pipeline draws for (given by the data module): the SimCLR view distribution ``spec`` and the names of
    the data module's augmentation settings given to make it (``given_settings``, so that a pipeline refuses those it
    does not use), the normalisation, ``L`` views per sample and the mode."""

    spec: ViewAugmentation
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_views: int
    mode: Mode = "views"
    given_settings: tuple[str, ...] = ()


class ViewPipeline:
    """How training views are drawn. A pipeline draws in data-loader workers (:meth:`collate` gives the views) or
    on the device (``draws_on_device``: :meth:`collate` gives a batch of images or indices, :meth:`draw` the views
    after the transfer). :meth:`bind` checks the pipeline against the data module's settings and raises a one-line
    :class:`~hfmca_lightning.errors.ConfigurationError` for what it cannot do."""

    modes: ClassVar[tuple[str, ...]] = ("views",)

    def __init__(self) -> None:
        self._setup: ViewSetup | None = None

    @property
    def draws_on_device(self) -> bool:
        """Whether the views are drawn on the device after the batch is transferred (else in the workers)."""
        return False

    @property
    def uses_workers(self) -> bool:
        """Whether data-loader workers do any of the work (else the loader runs in the main process)."""
        return True

    @property
    def setup(self) -> ViewSetup:
        if self._setup is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a data module yet")
        return self._setup

    def bind(self, setup: ViewSetup) -> None:
        """Take the data module's settings (the data module calls it once, when it is made).

        Args:
            setup: the view distribution, normalisation, views per sample, mode and seed.

        Raises:
            ConfigurationError: when the pipeline cannot serve ``setup`` (its mode, its number of views, or what
                :meth:`check` rejects).
        """
        if setup.mode not in self.modes:
            raise ConfigurationError(
                f"{type(self).__name__} draws {self._what()}; it does not serve mode {setup.mode!r} "
                f"(use TorchvisionViews{', the default' if setup.mode != 'views' else ''})",
                parameter=_PARAMETER,
            )
        count = self.view_count()
        if count is not None and count != setup.num_views:
            raise ConfigurationError(
                f"{type(self).__name__} makes {count} views per image; set data num_views: {count} (got "
                f"{setup.num_views})",
                parameter="num_views",
            )
        self._setup = setup
        self.check(setup)

    def _what(self) -> str:
        return "augmented views of one image per sample"

    def check(self, setup: ViewSetup) -> None:
        """Check the settings beyond mode and view count (subclasses override it; called by :meth:`bind`).

        Args:
            setup: the data module's settings.

        Raises:
            ConfigurationError: for settings this pipeline cannot serve.
        """

    def view_count(self) -> int | None:
        """The number of views per sample this pipeline makes whatever ``num_views`` says.

        Returns:
            That number, or None: it draws ``num_views`` (:class:`TransformViews`: as many as its transform returns,
            checked on the first sample).
        """
        return None

    def counted_views(self, split: LabelledImages, seed: int) -> int | None:
        """Views per sample known only from the pipeline's output, counted on the first sample.

        Args:
            split: the training split.
            seed: the run's seed.

        Returns:
            The number of views, or None where it is not needed.
        """
        return None

    def prepare(self, split: LabelledImages, device: torch.device | None) -> None:
        """Ready the pipeline for the training split before training starts (the data module calls it in ``setup``,
        so what cannot work, such as a split too large for the device, fails before the first step).

        Args:
            split: the training split.
            device: the device training runs on; None outside a trainer.
        """

    def batching(self, sampler: SeededRandomSampler, batch_size: int) -> dict[str, Any]:
        """How the training loader forms batches from the sampler's ``(index, seed)`` keys.

        Args:
            sampler: the run's sampler (this process's share under DDP).
            batch_size: samples per batch.

        Returns:
            The loader's ``sampler``, ``batch_size`` and ``drop_last``: by default ``batch_size`` samples per batch,
            the short last batch dropped.
        """
        return {"sampler": sampler, "batch_size": batch_size, "drop_last": True}

    def dataset(self, split: LabelledImages) -> Dataset:
        """The per-sample work of the data-loader workers.

        Args:
            split: the training split.

        Returns:
            A dataset of ``(index, seed)`` keys -> samples for :meth:`collate`.
        """
        raise NotImplementedError

    def collate(self, samples: list[Any]) -> Any:
        """The collate function of the training loader.

        Args:
            samples: a batch of the samples of :meth:`dataset`.

        Returns:
            A :class:`ViewBatch` (worker pipelines) or the batch :meth:`draw` takes.
        """
        raise NotImplementedError

    def draw(self, batch: Any, seed: int) -> ViewBatch:
        """Device pipelines: the views of a batch after its transfer to the device.

        Args:
            batch: what :meth:`collate` gave, on the device.
            seed: the batch's seed, for pipelines that draw from a generator rather than from each sample's seed.

        Returns:
            The views, targets and indices of the batch's samples.
        """
        raise NotImplementedError(f"{type(self).__name__} draws its views in the data-loader workers")


# --- per-sample views in CPU workers ----------------------------------------------------------------------------------


class _Samples(Dataset):
    """``(index, seed) -> (groups [(n, C, H, W)], target, index, grids or None)`` from a dataset of
    ``(views (L, C, H, W) or image (C, H, W), target[, grids])``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[list[Tensor], int, int, Tensor | None]:
        item = self.dataset[key]
        views = item[0] if item[0].dim() == 4 else item[0][None]
        return [views], int(item[1]), int(key[0]), item[2] if len(item) > 2 else None


def _collate_samples(samples: list[tuple[list[Tensor], int, int, Tensor | None]]) -> ViewBatch:
    grids = [sample[3] for sample in samples]
    return stack_samples(
        [(groups, target, index) for groups, target, index, _ in samples],
        None if grids[0] is None else [grid for grid in grids if grid is not None],
    )


class TorchvisionViews(ViewPipeline):
    """One torchvision pipeline call per view (per member in mode ``same_class``), in the CPU workers: every mode.

    Args:
        grids: ``g > 0``: each view comes with the source-image positions of a ``g x g`` grid over it
            (:class:`~hfmca_lightning.data.transforms.ViewWithGrid`), what VICRegL matches local features by;
            batches get a grids tensor (``stacked``: ``(views, targets, grids (B, L, g, g, 2))``).

    Raises:
        ConfigurationError: when ``grids`` is negative, or, when the data module binds it, set for a mode other
            than ``views``.

    Example::

        data = MultiViewDataModule(SyntheticShapes(), num_views=2, views=TorchvisionViews(grids=7))
        views, targets, grids = next(iter(data.train_dataloader()))  # grids (64, 2, 7, 7, 2)
    """

    modes = ("views", "same_class", "single")

    def __init__(self, grids: int = 0) -> None:
        super().__init__()
        if grids < 0:
            raise ConfigurationError(f"TorchvisionViews: grids must be >= 0; got {grids}", parameter=_PARAMETER)
        self.grids = grids

    def check(self, setup: ViewSetup) -> None:
        if self.grids and setup.mode != "views":
            raise ConfigurationError(
                f"TorchvisionViews(grids={self.grids}) records crop positions of augmented views (mode 'views'); got "
                f"mode {setup.mode!r}",
                parameter=_PARAMETER,
            )

    def dataset(self, split: LabelledImages) -> Dataset:
        setup = self.setup
        transforms = view_transforms(setup.spec, setup.mean, setup.std, grid_size=self.grids)
        dataset_class = {"views": MultiViewDataset, "same_class": SameClassDataset, "single": SingleViewDataset}
        return _Samples(dataset_class[setup.mode](split, transforms, setup.num_views))

    collate = staticmethod(_collate_samples)  # type: ignore[assignment]


@dataclass
class ImageBatch:
    """A batch of images whose views are drawn after the transfer: ``images (B, C, H, W)`` uint8 resized to the views'
    size, their ``targets``, ``indices`` and per-sample ``seeds`` (int64), and names."""

    images: Tensor
    targets: Tensor
    indices: Tensor
    seeds: Tensor
    names: list[str] = field(default_factory=list)

    def pin_memory(self) -> ImageBatch:
        return replace(
            self, **{name: getattr(self, name).pin_memory() for name in ("images", "targets", "indices", "seeds")}
        )


class _ImagesToDraw(Dataset):
    """``(index, seed) -> (uint8 image resized to the view size, target, index, seed)``."""

    def __init__(self, split: LabelledImages, image_size: int) -> None:
        self.images = SeededImageDataset(split, resize_transform(image_size))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Tensor, int, int, int]:
        image, target, seed = self.images[key]
        return image, int(target), int(key[0]), int(seed)


def _image_batch(samples: list[tuple[Tensor, int, int, int]]) -> ImageBatch:
    return ImageBatch(
        torch.stack([image for image, _, _, _ in samples]),
        torch.tensor([target for _, target, _, _ in samples], dtype=torch.int64),
        torch.tensor([index for _, _, index, _ in samples], dtype=torch.int64),
        torch.tensor([seed for _, _, _, seed in samples], dtype=torch.int64),
        [str(index) for _, _, index, _ in samples],
    )


def _emit(views: Tensor, dtype: OutputDtype, channels_last: bool) -> Tensor:
    """``(B, L, C, H, W)`` views in ``dtype``, with each ``(C, H, W)`` view channels-last if asked (what the backbone
    of a channels-last, bf16 run takes without another pass)."""
    if dtype == "bfloat16":
        views = views.to(torch.bfloat16)
    if channels_last:
        batch, count = views.shape[:2]
        flat = views.reshape(batch * count, *views.shape[2:]).contiguous(memory_format=torch.channels_last)
        views = flat.view(batch, count, *views.shape[2:])
    return views


class _DeviceOutput:
    def _check_output(self, output_dtype: str, channels_last: bool) -> None:
        if output_dtype not in ("float32", "bfloat16"):
            raise ConfigurationError(
                f"{type(self).__name__}: output_dtype must be 'float32' or 'bfloat16'; got {output_dtype!r}",
                parameter=_PARAMETER,
            )
        self.output_dtype: OutputDtype = output_dtype  # type: ignore[assignment]
        self.channels_last = channels_last


class BatchedViews(_DeviceOutput, ViewPipeline):
    """The views of a whole batch in a fixed number of tensor operations
    (:class:`~hfmca_lightning.data.batched_augment.BatchedViewAugmentation`), each image's parameters from its own
    seed: in the collate function of the CPU workers (``on: workers``; several times the views per core of the
    torchvision pipeline on CIFAR-sized images) or on the device after the transfer of uint8 images (``on: device``,
    no host-device waits). Both give the same views. From the image resized and centre-cropped to the view size
    (nothing changes for CIFAR).

    Args:
        on: ``workers`` or ``device``.
        output_dtype: ``float32`` or ``bfloat16`` (``on: device``: what a bf16 run's backbone takes).
        channels_last: ``on: device``: views laid out channels-last.

    Raises:
        ConfigurationError: when ``on`` or ``output_dtype`` is none of the above, or, when the data module binds
            it, ``output_dtype`` / ``channels_last`` are set for views drawn in the workers.

    Example::

        views = BatchedViews(on="device", output_dtype="bfloat16", channels_last=True)
        data = MultiViewDataModule(SyntheticShapes(), num_views=4, views=views)
    """

    def __init__(
        self, on: Where = "workers", output_dtype: OutputDtype = "float32", channels_last: bool = False
    ) -> None:
        super().__init__()
        if on not in ("workers", "device"):
            raise ConfigurationError(
                f"BatchedViews: on must be 'workers' or 'device'; got {on!r}", parameter=_PARAMETER
            )
        self.on = on
        self._check_output(output_dtype, channels_last)
        self._augmentation: BatchedViewAugmentation | None = None

    @property
    def draws_on_device(self) -> bool:
        return self.on == "device"

    def check(self, setup: ViewSetup) -> None:
        if self.on == "workers" and (self.output_dtype != "float32" or self.channels_last):
            raise ConfigurationError(
                "BatchedViews: output_dtype and channels_last apply to views drawn on the device (on: device); the "
                "workers' views travel as float32",
                parameter=_PARAMETER,
            )
        self._augmentation = BatchedViewAugmentation(setup.spec, setup.mean, setup.std)

    @property
    def augmentation(self) -> BatchedViewAugmentation:
        assert self._augmentation is not None, "bind the pipeline first"
        return self._augmentation

    def dataset(self, split: LabelledImages) -> Dataset:
        return _ImagesToDraw(split, self.setup.spec.image_size)

    def collate(self, samples: list[Any]) -> Any:
        batch = _image_batch(samples)
        return batch if self.on == "device" else self._views(batch)

    def draw(self, batch: ImageBatch, seed: int) -> ViewBatch:
        return self._views(batch)

    def _views(self, batch: ImageBatch) -> ViewBatch:
        augmentation = self.augmentation.to(batch.images.device)
        views = augmentation.views_from_seeds(batch.images, batch.seeds, self.setup.num_views)
        return ViewBatch(
            [_emit(views, self.output_dtype, self.channels_last)], batch.targets, batch.indices, batch.names
        )


# --- the training set kept on the device ------------------------------------------------------------------------------


@dataclass
class ResidentBatch:
    """One training batch of :class:`ResidentViews`: the chunk of ``batches_per_call`` consecutive batches it belongs
    to (``chunk`` numbers it, increasing over the process; ``indices`` / ``seeds`` (N * B,) its samples), its
    ``position`` in it, the next chunk's samples (empty at the end of an epoch), and its own samples' names."""

    chunk: int
    position: int
    batch_size: int
    indices: Tensor
    seeds: Tensor
    next_indices: Tensor
    next_seeds: Tensor
    names: list[str] = field(default_factory=list)

    def pin_memory(self) -> ResidentBatch:
        tensors = ("indices", "seeds", "next_indices", "next_seeds")
        return replace(self, **{name: getattr(self, name).pin_memory() for name in tensors})


_CHUNKS_PER_PASS = 1 << 32
_PASSES = itertools.count()  # every pass over any _Chunks in this process: chunk numbers never repeat


class _Chunks(DistributedSampler):
    """Batches of a :class:`SeededRandomSampler` (a ``DistributedSampler``, so Lightning leaves it in place), grouped
    in chunks of ``batches_per_call``: yields ``(chunk number, position, batch size, chunk keys, next chunk keys)``.

    Chunk numbers increase over the whole process, not only within an epoch: a pass that repeats an epoch (a resumed
    one, or a second run with the same data module) never finds the chunks an earlier pass drew under its numbers."""

    def __init__(self, sampler: SeededRandomSampler, batch_size: int, batches_per_call: int) -> None:
        self.sampler, self.batch_size, self.batches_per_call = sampler, batch_size, batches_per_call

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        keys = list(self.sampler)
        batches = [keys[start : start + self.batch_size] for start in range(0, len(keys), self.batch_size)]
        batches = [batch for batch in batches if len(batch) == self.batch_size]  # drop_last
        size = self.batches_per_call
        chunks = [batches[start : start + size] for start in range(0, len(batches), size)]
        first = next(_PASSES) * _CHUNKS_PER_PASS
        for number, chunk in enumerate(chunks):
            following = chunks[number + 1] if number + 1 < len(chunks) else []
            flat, flat_next = [key for batch in chunk for key in batch], [key for batch in following for key in batch]
            for position in range(len(chunk)):
                yield first + number, position, self.batch_size, flat, flat_next


class _ResidentKeys(Dataset):
    """``(chunk, position, batch size, keys, next keys) -> ResidentBatch`` (auto-collation off: one item per batch)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item: Any) -> ResidentBatch:
        chunk, position, batch_size, keys, following = item

        def tensors(pairs: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
            if not pairs:
                return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
            index, seed = zip(*pairs)
            return torch.tensor(index, dtype=torch.int64), torch.tensor(seed, dtype=torch.int64)

        indices, seeds = tensors(keys)
        next_indices, next_seeds = tensors(following)
        own = keys[position * batch_size : (position + 1) * batch_size]
        return ResidentBatch(
            chunk,
            position,
            batch_size,
            indices,
            seeds,
            next_indices,
            next_seeds,
            [str(index) for index, _ in own],
        )


class ResidentViews(_DeviceOutput, ViewPipeline):
    """The training split kept on the device as one uint8 tensor (for data sets that fit: one clear error if it
    would take more than half of the free device memory); a training batch is then its samples' indices and seeds,
    and the views are drawn on the device from the seeds by
    :class:`~hfmca_lightning.data.batched_augment.BatchedViewAugmentation`: the views ``BatchedViews`` gives, without
    data-loader workers (``num_workers`` then serves the evaluation loaders).

    Args:
        batches_per_call: draw the views of this many consecutive batches in one call (fewer, larger launches on a
            GPU); on CUDA the next chunk is drawn ahead on a side stream while the current one trains. The views
            are those of one batch at a time (each sample's come from its own seed).
        output_dtype: ``float32`` or ``bfloat16``, as :class:`BatchedViews` on the device.
        channels_last: views laid out channels-last, as :class:`BatchedViews` on the device.

    Raises:
        ConfigurationError: when ``batches_per_call`` is below 1 or ``output_dtype`` is neither of the above.

    Example::

        data = MultiViewDataModule(SyntheticShapes(), num_views=4, views=ResidentViews(batches_per_call=4))
    """

    def __init__(
        self, batches_per_call: int = 1, output_dtype: OutputDtype = "float32", channels_last: bool = False
    ) -> None:
        super().__init__()
        if batches_per_call < 1:
            raise ConfigurationError(
                f"ResidentViews: batches_per_call must be >= 1; got {batches_per_call}", parameter=_PARAMETER
            )
        self.batches_per_call = batches_per_call
        self._check_output(output_dtype, channels_last)
        self._augmentation: BatchedViewAugmentation | None = None
        self._stored: StoredImages | None = None
        self._split: LabelledImages | None = None
        self._drawn: dict[int, tuple[Tensor, Tensor, Any]] = {}  # chunk -> (views, targets, event)

    @property
    def draws_on_device(self) -> bool:
        return True

    @property
    def uses_workers(self) -> bool:
        return False

    def check(self, setup: ViewSetup) -> None:
        self._augmentation = BatchedViewAugmentation(setup.spec, setup.mean, setup.std)

    def store(self, split: LabelledImages, device: torch.device | None = None) -> StoredImages:
        """The split as one uint8 tensor (made once; the data module calls it in ``setup``).

        Args:
            split: the training split.
            device: where the tensor is kept; None: where it is.

        Returns:
            The stored images and targets.
        """
        if self._stored is None or self._split is not split:
            self._stored, self._split = StoredImages.from_split(split, self.setup.spec.image_size), split
            self._drawn.clear()
        if device is not None and self._stored.device != device:
            self._stored = self._stored.to(device)
            self._drawn.clear()
        return self._stored

    def prepare(self, split: LabelledImages, device: torch.device | None) -> None:
        self.store(split, device)

    def dataset(self, split: LabelledImages) -> Dataset:
        return _ResidentKeys(len(split))

    def batching(self, sampler: SeededRandomSampler, batch_size: int) -> dict[str, Any]:
        """Whole batches from the dataset (auto-collation off), in chunks of ``batches_per_call``."""
        return {"sampler": _Chunks(sampler, batch_size, self.batches_per_call), "batch_size": None}

    def collate(self, samples: Any) -> Any:
        return samples

    def draw(self, batch: ResidentBatch, seed: int) -> ViewBatch:
        device = batch.indices.device
        stored = self.store(self._split if self._split is not None else _missing_split(), device)
        for done in [chunk for chunk in self._drawn if chunk < batch.chunk]:
            del self._drawn[done]
        if batch.chunk not in self._drawn:
            self._drawn[batch.chunk] = self._draw_chunk(stored, batch.indices, batch.seeds, side=False)
        views, targets, event = self._drawn[batch.chunk]
        if event is not None:  # drawn ahead on the side stream
            current = torch.cuda.current_stream(device)
            current.wait_event(event)
            views.record_stream(current)
            targets.record_stream(current)
            self._drawn[batch.chunk] = (views, targets, None)
        ahead = batch.chunk + 1
        if batch.position == 0 and self.batches_per_call > 1 and device.type == "cuda" and len(batch.next_indices):
            if ahead not in self._drawn:  # the next chunk while this one trains
                self._drawn[ahead] = self._draw_chunk(stored, batch.next_indices, batch.next_seeds, side=True)
        rows = slice(batch.position * batch.batch_size, (batch.position + 1) * batch.batch_size)
        return ViewBatch([views[rows]], targets[rows], batch.indices[rows], batch.names)

    def _draw_chunk(
        self, stored: StoredImages, indices: Tensor, seeds: Tensor, side: bool
    ) -> tuple[Tensor, Tensor, Any]:
        assert self._augmentation is not None
        augmentation = self._augmentation.to(indices.device)
        if not side:
            views = augmentation.views_from_seeds(stored.images[indices], seeds, self.setup.num_views)
            return _emit(views, self.output_dtype, self.channels_last), stored.targets[indices], None
        current = torch.cuda.current_stream(indices.device)
        stream = torch.cuda.Stream(indices.device)
        stream.wait_stream(current)  # the indices' transfer
        indices.record_stream(stream)
        seeds.record_stream(stream)
        with torch.cuda.stream(stream):
            views = augmentation.views_from_seeds(stored.images[indices], seeds, self.setup.num_views)
            views = _emit(views, self.output_dtype, self.channels_last)
            targets = stored.targets[indices]
            event = torch.cuda.Event()
            event.record(stream)
        return views, targets, event


def _missing_split() -> LabelledImages:
    raise RuntimeError("ResidentViews has no training split: the data module stores it in setup()")


# --- multi-crop and user transforms -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CropGroup:
    """``count`` crops of ``size`` pixels covering a fraction ``scale`` of the image."""

    count: int
    size: int
    scale: tuple[float, float]


class _GroupedViews(Dataset):
    """``(index, seed) -> (groups [(n_g, C, S_g, S_g)], target, index, None)``: the views of one image, ``view(image,
    l)`` for ``l`` in each group, on torch's generator seeded with the sample's seed."""

    def __init__(self, split: LabelledImages, draw: Callable[[Any, int], list[Tensor]]) -> None:
        self.split, self.draw = split, draw

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: tuple[int, int]) -> tuple[list[Tensor], int, int, None]:
        index, seed = int(key[0]), int(key[1])
        image, target = self.split[index]
        with seeded_generators(seed):
            views = self.draw(image, index)
        return _groups_by_size(views), int(target), index, None


def _groups_by_size(views: Sequence[Tensor]) -> list[Tensor]:
    """Consecutive views of equal shape stacked: ``[(n_g, C, H_g, W_g), ...]``."""
    groups: list[list[Tensor]] = []
    for view in views:
        if groups and groups[-1][0].shape == view.shape:
            groups[-1].append(view)
        else:
            groups.append([view])
    return [torch.stack(group) for group in groups]


@contextmanager
def seeded_generators(seed: int) -> Iterator[None]:
    """torch's CPU generator, Python's ``random`` and numpy's global generator seeded with ``seed`` inside the block,
    and restored after it (transforms from other libraries draw from any of them)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class MultiCrop(ViewPipeline):
    """Groups of crops of different sizes and scales, global crops first (DINO, SwAV, iBOT, MSN): each crop is the
    SimCLR view of :func:`~hfmca_lightning.data.transforms.view_transform` with its group's size and crop scale (the
    colour, greyscale, blur and solarisation knobs of the data module apply to all). Stacked batches hold one
    ``(B, n_g, C, S_g, S_g)`` tensor per group; the list formats the crops in order.

    Defaults: 2 global crops of the source's size, scale 0.14-1, and 6 local crops of half that size, scale
    0.05-0.14 (DINO's and SwAV's settings, scaled to CIFAR-like data). ``num_views`` must equal the total.

    Args:
        global_crops: crops in the global group.
        local_crops: crops in the local group.
        global_size: side of the global crops in pixels (default: the source's image size).
        local_size: side of the local crops in pixels (default: half the source's image size).
        global_scale: ``(smallest, largest)`` fraction of the image a global crop covers.
        local_scale: ``(smallest, largest)`` fraction of the image a local crop covers.

    Raises:
        ConfigurationError: when a count is negative, there is no crop, a size is below 1 or a scale is not
            ``0 < smallest <= largest <= 1``.

    Example::

        views = MultiCrop(global_crops=2, local_crops=6)
        data = MultiViewDataModule(SyntheticShapes(), num_views=8, views=views)
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
    ) -> None:
        super().__init__()
        for name, value in (("global_crops", global_crops), ("local_crops", local_crops)):
            if value < 0:
                raise ConfigurationError(f"MultiCrop: {name} must be >= 0; got {value}", parameter=_PARAMETER)
        if global_crops + local_crops < 1:
            raise ConfigurationError("MultiCrop needs at least one crop", parameter=_PARAMETER)
        for name, scale in (("global_scale", global_scale), ("local_scale", local_scale)):
            low, high = scale
            if not 0 < low <= high <= 1:
                raise ConfigurationError(
                    f"MultiCrop: {name} is (smallest, largest) fraction of the image, 0 < smallest <= largest <= 1; "
                    f"got {tuple(scale)}",
                    parameter=_PARAMETER,
                )
        for name, size in (("global_size", global_size), ("local_size", local_size)):
            if size is not None and size < 1:
                raise ConfigurationError(f"MultiCrop: {name} must be >= 1; got {size}", parameter=_PARAMETER)
        self.global_crops, self.local_crops = global_crops, local_crops
        self.global_size, self.local_size = global_size, local_size
        self.global_scale, self.local_scale = tuple(global_scale), tuple(local_scale)

    def _what(self) -> str:
        return "crops of one image per sample"

    def view_count(self) -> int:
        return self.global_crops + self.local_crops

    def check(self, setup: ViewSetup) -> None:
        if "crop_strength" in setup.given_settings:
            raise ConfigurationError(
                "MultiCrop crops at its own scales (global_scale, local_scale); the data module's crop_strength does "
                "not apply to it: remove crop_strength, or set MultiCrop's scales",
                parameter=_PARAMETER,
            )

    def groups(self) -> list[CropGroup]:
        """The crop groups for the bound source's image size.

        Returns:
            The groups, global first (empty groups left out).
        """
        size = self.setup.spec.image_size
        global_size = self.global_size or size
        local_size = self.local_size or max(1, size // 2)
        groups = [
            CropGroup(self.global_crops, global_size, self.global_scale),  # type: ignore[arg-type]
            CropGroup(self.local_crops, local_size, self.local_scale),  # type: ignore[arg-type]
        ]
        return [group for group in groups if group.count]

    def dataset(self, split: LabelledImages) -> Dataset:
        setup = self.setup
        transforms: list[Any] = []
        for group in self.groups():
            spec = replace(setup.spec, image_size=group.size, crop_scale=group.scale)
            for _ in range(group.count):
                transforms.append(view_transform(spec, setup.mean, setup.std, view=len(transforms)))

        def draw(image: Any, index: int) -> list[Tensor]:
            return [transform(image) for transform in transforms]

        return _GroupedViews(split, draw)

    collate = staticmethod(_collate_samples)  # type: ignore[assignment]


class TransformViews(ViewPipeline):
    """Any callable that maps an image to a list of views: lightly's ``SimCLRTransform``, ``MMCRTransform``,
    ``DINOTransform``, or a user's own. The image is given as a PIL image (what lightly's transforms take); the
    generators of torch, Python's ``random`` and numpy are seeded from the sample's seed before each call, so views
    do not depend on the number of workers and resume exactly. Views of equal shape that follow each other form a
    group (DINO's 2 global crops, then its local crops). The data module's augmentation knobs do not apply.

    Args:
        transform: image -> list of ``(C, H, W)`` tensors.

    Raises:
        ConfigurationError: when ``transform`` is not callable, or, when the data module binds it, the data
            module's augmentation settings are set.

    Example::

        from lightly.transforms import SimCLRTransform

        views = TransformViews(SimCLRTransform(input_size=32))
        data = MultiViewDataModule(SyntheticShapes(), num_views=2, views=views)
    """

    def __init__(self, transform: Callable[[Any], Sequence[Tensor]]) -> None:
        super().__init__()
        if not callable(transform):
            raise ConfigurationError(
                f"TransformViews needs a callable image -> list of views; got {type(transform).__name__}",
                parameter=_PARAMETER,
            )
        self.transform = transform

    def check(self, setup: ViewSetup) -> None:
        if setup.given_settings:
            raise ConfigurationError(
                f"TransformViews draws the views of its transform ({type(self.transform).__name__}); the data "
                f"module's augmentation settings ({', '.join(setup.given_settings)}) do not apply to it: remove them",
                parameter=_PARAMETER,
            )

    def counted_views(self, split: LabelledImages, seed: int) -> int:
        groups = self.dataset(split)[(0, seed)][0]
        return sum(group.shape[0] for group in groups)

    def dataset(self, split: LabelledImages) -> Dataset:
        transform = self.transform

        def draw(image: Any, index: int) -> list[Tensor]:
            views = transform(to_pil_image(image) if isinstance(image, Tensor) else image)
            if isinstance(views, Tensor) or not isinstance(views, Sequence) or not views:
                raise ConfigurationError(
                    f"TransformViews: {type(transform).__name__} must return a list of view tensors; got "
                    f"{type(views).__name__}",
                    parameter=_PARAMETER,
                )
            return list(views)

        return _GroupedViews(split, draw)

    collate = staticmethod(_collate_samples)  # type: ignore[assignment]
