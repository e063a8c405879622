"""The training split kept on the device (docs/conventions.md §5): :class:`ResidentDrawer`, for data sets that fit
(CIFAR's 50,000 images are 150 MB as uint8), whose images then travel to the device once."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from hfmca_lightning.data.batch_formats import ViewBatch
from hfmca_lightning.data.datasets import SeededRandomSampler
from hfmca_lightning.data.drawers import OutputDtype, SeededDrawer
from hfmca_lightning.data.sources import ArrayImages, LabelledImages
from hfmca_lightning.data.transforms import resize_transform
from hfmca_lightning.errors import ConfigurationError, check_at_least

__all__ = ["ResidentBatch", "ResidentDrawer", "stored_split"]

DEVICE_MEMORY_SHARE = 0.5  # the most of the device's free memory the stored images may take (the rest is the model's)
_CHUNKS_PER_PASS = 1 << 32
_PASSES = itertools.count()  # every pass over any _Chunks in this process


def stored_split(split: LabelledImages, image_size: int) -> tuple[Tensor, Tensor]:
    """``(images (N, C, S, S) uint8, targets (N,) int64)`` of ``split``, each image resized and centre-cropped to
    ``image_size`` by the CPU workers' ``resize_transform`` (arrays of that size already, as CIFAR's, as they are)."""
    targets = torch.tensor(split.targets, dtype=torch.int64)
    if isinstance(split, ArrayImages) and tuple(split.images.shape[-2:]) == (image_size, image_size):
        return split.images.contiguous(), targets
    resize = resize_transform(image_size)
    return torch.stack([resize(split[index][0]) for index in range(len(split))]), targets


def stored_on_device(images: Tensor, device: torch.device) -> Tensor:
    """``images`` on ``device``; one clear error when they would take more than half of its free memory."""
    if device.type == "cuda" and device != images.device:
        free, _ = torch.cuda.mem_get_info(device)
        if images.numel() > DEVICE_MEMORY_SHARE * free:
            raise ConfigurationError(
                f"ResidentDrawer: the training split takes {images.numel() / 2**30:.1f} GiB as uint8, more than half "
                f"of the {free / 2**30:.1f} GiB free on {device}; draw the views in CPU workers instead (drawer: "
                "BatchedDrawer)",
                parameter="drawer",
            )
    return images.to(device)


@dataclass
class ResidentBatch:
    """One :class:`ResidentDrawer` training batch: its chunk of ``batches_per_call`` batches (``chunk``: its number,
    increasing over the process; ``indices`` / ``seeds`` (N * B,): its samples), its ``position`` in it, the next
    chunk's samples (empty at an epoch's end), and its own samples' names."""

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


class _Chunks(DistributedSampler):
    """A :class:`ResidentBatch` per batch of a :class:`SeededRandomSampler`, in chunks of ``batches_per_call`` (a
    ``DistributedSampler``: Lightning leaves it in place). Chunk numbers never repeat in a process, so a pass repeating
    an epoch (resumed, or a rerun of the data module) never finds an earlier pass's drawn chunks."""

    def __init__(self, sampler: SeededRandomSampler, batch_size: int, batches_per_call: int) -> None:
        self.sampler, self.batch_size, self.batches_per_call = sampler, batch_size, batches_per_call

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[ResidentBatch]:
        keys = list(self.sampler)
        whole, size = len(keys) // self.batch_size * self.batch_size, self.batch_size * self.batches_per_call
        chunks = [keys[start : min(start + size, whole)] for start in range(0, whole, size)]
        tables = [torch.tensor(chunk, dtype=torch.int64).view(-1, 2) for chunk in [*chunks, []]]  # none after the last
        pairs = [(table[:, 0].clone(), table[:, 1].clone()) for table in tables]  # (indices, seeds) per chunk
        first = next(_PASSES) * _CHUNKS_PER_PASS
        for number, (chunk, (indices, seeds), following) in enumerate(zip(chunks, pairs, pairs[1:])):
            for position, start in enumerate(range(0, len(chunk), self.batch_size)):
                names = [str(index) for index, _ in chunk[start : start + self.batch_size]]
                yield ResidentBatch(first + number, position, self.batch_size, indices, seeds, *following, names)


class _Batches(Dataset):
    """The batches :class:`_Chunks` yields, as they are (auto-collation off: one item per batch)."""

    def __getitem__(self, batch: ResidentBatch) -> ResidentBatch:
        return batch


class ResidentDrawer(SeededDrawer):
    """The training split kept on the device as one uint8 tensor (refused above half the free device memory); a batch is
    its samples' indices and seeds, whose views, :class:`~hfmca_lightning.data.BatchedDrawer`'s, are drawn on the device
    without loader workers (``num_workers`` serves evaluation only). Draws ``SimCLRViews`` without grids.

    Args:
        batches_per_call: draw this many consecutive batches' views per call (fewer, larger GPU launches; on CUDA the
            next chunk is drawn ahead on a side stream while this one trains); the views do not depend on it.
        output_dtype: ``float32`` or ``bfloat16``.
        channels_last: views laid out channels-last.

    Raises:
        ConfigurationError: when ``batches_per_call`` is below 1 or ``output_dtype`` is not ``float32`` or ``bfloat16``.
    """

    draws_on_device = True
    uses_workers = False

    def __init__(
        self, batches_per_call: int = 1, output_dtype: OutputDtype = "float32", channels_last: bool = False
    ) -> None:
        check_at_least(batches_per_call, 1, "batches_per_call", "ResidentDrawer")
        super().__init__(output_dtype, channels_last)
        self.batches_per_call = batches_per_call

    def _clear(self) -> None:
        super()._clear()
        self._stored: tuple[Tensor, Tensor] | None = None  # images, targets
        self._split: LabelledImages | None = None
        self._drawn: dict[int, tuple[Tensor, Tensor, Any]] = {}  # chunk -> (views, targets, event)
        # one side stream for all chunks drawn ahead: the caching allocator reuses a block only on the stream it was
        # freed to, so a stream per chunk would never reuse the temporaries of the chunks before
        self._side_stream: Any = None

    def prepare(self, split: LabelledImages, device: torch.device | None) -> None:
        """Store the split (once), on ``device`` where given: a split too large for it fails before training."""
        if self._stored is None or self._split is not split:
            self._stored, self._split = stored_split(split, self.setup.image_size), split
            self._drawn.clear()
        if device is not None and self._stored[0].device != device:
            self._stored = (stored_on_device(self._stored[0], device), self._stored[1].to(device))
            self._drawn.clear()

    def dataset(self, split: LabelledImages) -> Dataset:
        return _Batches()

    def batching(self, sampler: SeededRandomSampler, batch_size: int) -> dict[str, Any]:
        """Whole batches from the dataset (auto-collation off), in chunks of ``batches_per_call``."""
        return {"sampler": _Chunks(sampler, batch_size, self.batches_per_call), "batch_size": None}

    def collate(self, samples: Any) -> Any:
        return samples

    def draw(self, batch: ResidentBatch) -> ViewBatch:
        device = batch.indices.device
        if self._split is None:
            raise RuntimeError("ResidentDrawer has no training split: the data module stores it in setup()")
        self.prepare(self._split, device)
        self._drawn = {chunk: drawn for chunk, drawn in self._drawn.items() if chunk >= batch.chunk}
        if batch.chunk not in self._drawn:
            self._drawn[batch.chunk] = self._draw_chunk(batch.indices, batch.seeds, side=False)
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
                self._drawn[ahead] = self._draw_chunk(batch.next_indices, batch.next_seeds, side=True)
        rows = slice(batch.position * batch.batch_size, (batch.position + 1) * batch.batch_size)
        return ViewBatch([views[rows]], targets[rows], batch.indices[rows], batch.names)

    def _draw_chunk(self, indices: Tensor, seeds: Tensor, side: bool) -> tuple[Tensor, Tensor, Any]:
        """The views and targets of a chunk; ``side``: drawn on a side stream, with the event that ends it."""
        assert self._stored is not None
        images, targets = self._stored
        if not side:  # no CUDA call: this path also runs on CPUs and MPS
            return self._views(images[indices], seeds), targets[indices], None
        if self._side_stream is None or self._side_stream.device != indices.device:
            self._side_stream = torch.cuda.Stream(indices.device)
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(indices.device))  # the indices' transfer
        indices.record_stream(stream)
        seeds.record_stream(stream)
        with torch.cuda.stream(stream):
            return self._views(images[indices], seeds), targets[indices], stream.record_event()
