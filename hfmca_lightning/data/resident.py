"""The training split kept on the device: :class:`ResidentDrawer` (docs/conventions.md §5)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from hfmca_lightning.data.batch_formats import ViewBatch
from hfmca_lightning.data.batched_augment import BatchedViewAugmentation
from hfmca_lightning.data.datasets import SeededRandomSampler
from hfmca_lightning.data.drawers import OutputDtype, ViewDrawer, batched_augmentation, check_output_dtype, emit
from hfmca_lightning.data.sources import LabelledImages
from hfmca_lightning.data.stored_images import StoredImages
from hfmca_lightning.data.view_specs import SimCLRViews
from hfmca_lightning.errors import ConfigurationError

__all__ = ["ResidentBatch", "ResidentDrawer"]


@dataclass
class ResidentBatch:
    """One training batch of :class:`ResidentDrawer`: the chunk of ``batches_per_call`` consecutive batches it belongs
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


class ResidentDrawer(ViewDrawer):
    """The training split kept on the device as one uint8 tensor (for data sets that fit: one clear error if it
    would take more than half of the free device memory); a training batch is then its samples' indices and seeds,
    and the views are drawn on the device from the seeds by
    :class:`~hfmca_lightning.data.batched_augment.BatchedViewAugmentation`: the views
    :class:`~hfmca_lightning.data.BatchedDrawer` gives, without data-loader workers (``num_workers`` then serves the
    evaluation loaders). Draws :class:`~hfmca_lightning.data.SimCLRViews` without grids.

    Args:
        batches_per_call: draw the views of this many consecutive batches in one call (fewer, larger launches on a
            GPU); on CUDA the next chunk is drawn ahead on a side stream while the current one trains. The views
            are those of one batch at a time (each sample's come from its own seed).
        output_dtype: ``float32`` or ``bfloat16``, as :class:`~hfmca_lightning.data.BatchedDrawer` on the device.
        channels_last: views laid out channels-last, as :class:`~hfmca_lightning.data.BatchedDrawer` on the device.

    Raises:
        ConfigurationError: when ``batches_per_call`` is below 1 or ``output_dtype`` is neither of the above.

    Example::

        drawer = ResidentDrawer(batches_per_call=4)
        data = MultiViewDataModule(SyntheticShapes(), views=SimCLRViews(count=4), drawer=drawer)
    """

    draws = (SimCLRViews,)
    records_grids = False
    draws_on_device = True
    uses_workers = False

    def __init__(
        self, batches_per_call: int = 1, output_dtype: OutputDtype = "float32", channels_last: bool = False
    ) -> None:
        super().__init__()
        if batches_per_call < 1:
            raise ConfigurationError(
                f"ResidentDrawer: batches_per_call must be >= 1; got {batches_per_call}", parameter="batches_per_call"
            )
        self.batches_per_call = batches_per_call
        check_output_dtype("ResidentDrawer", output_dtype)
        self.output_dtype, self.channels_last = output_dtype, channels_last

    def _clear(self) -> None:
        self._augmentation: BatchedViewAugmentation | None = None
        self._stored: StoredImages | None = None
        self._split: LabelledImages | None = None
        self._drawn: dict[int, tuple[Tensor, Tensor, Any]] = {}  # chunk -> (views, targets, event)

    def store(self, split: LabelledImages, device: torch.device | None = None) -> StoredImages:
        """The split as one uint8 tensor (made once; the data module calls it in ``setup``).

        Args:
            split: the training split.
            device: where the tensor is kept; None: where it is.

        Returns:
            The stored images and targets.
        """
        if self._stored is None or self._split is not split:
            self._stored, self._split = StoredImages.from_split(split, self.setup.image_size), split
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

    def draw(self, batch: ResidentBatch) -> ViewBatch:
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
        if self._augmentation is None:
            self._augmentation = batched_augmentation(self.setup)
        augmentation = self._augmentation.to(indices.device)
        count: int = self.setup.views.num_views  # type: ignore[assignment]  # SimCLRViews: known
        if not side:
            views = augmentation.views_from_seeds(stored.images[indices], seeds, count)
            return emit(views, self.output_dtype, self.channels_last), stored.targets[indices], None
        current = torch.cuda.current_stream(indices.device)
        stream = torch.cuda.Stream(indices.device)
        stream.wait_stream(current)  # the indices' transfer
        indices.record_stream(stream)
        seeds.record_stream(stream)
        with torch.cuda.stream(stream):
            views = augmentation.views_from_seeds(stored.images[indices], seeds, count)
            views = emit(views, self.output_dtype, self.channels_last)
            targets = stored.targets[indices]
            event = torch.cuda.Event()
            event.record(stream)
        return views, targets, event


def _missing_split() -> LabelledImages:
    raise RuntimeError("ResidentDrawer has no training split: the data module stores it in setup()")
