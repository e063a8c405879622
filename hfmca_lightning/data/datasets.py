"""The per-sample work of the data-loader workers, and the resumable sampler that drives it.

Training datasets take keys ``(index, sample_seed)`` from :class:`SeededRandomSampler`: all randomness of a sample
(its views' augmentation parameters, its same-class partners) is a function of that seed, so runs are identical
whatever the number of workers, and a run resumed from a checkpoint sees exactly the batches an uninterrupted run
would.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from hfmca_lightning.data.batch_formats import ViewBatch, stack_samples
from hfmca_lightning.data.sources import LabelledImages
from hfmca_lightning.errors import ConfigurationError

__all__ = [
    "EvalDataset",
    "GroupedViews",
    "MultiViewDataset",
    "SameClassDataset",
    "SeededRandomSampler",
    "collate_samples",
    "seeded_generators",
]

SampleKey = tuple[int, int]
Sample = tuple[list[Tensor], int, int, Tensor | None]  # (groups [(n_g, C, H_g, W_g)], target, index, grids)


class SeededRandomSampler(DistributedSampler):
    """Shuffles the data per epoch from ``(seed, epoch)`` and yields ``(index, sample_seed)`` keys.

    One global order is drawn for all ranks; rank ``r`` of ``num_replicas`` takes every ``num_replicas``-th key
    starting at ``r`` (the tail that does not divide evenly is dropped), so consecutive per-rank batches of ``b``
    together hold exactly the samples, with exactly the augmentation seeds, of one single-process batch of
    ``num_replicas * b``. Lightning calls :meth:`set_epoch` every epoch and, since this is a ``DistributedSampler``,
    leaves it in place under DDP.

    :meth:`resume` makes the next iteration start inside an epoch: at ``epoch``, after the first ``samples_seen``
    keys of the global order (what all ranks together consumed before a checkpoint). ``len()`` stays the full
    epoch's, as Lightning's loop counts the batches of a resumed epoch from where it stopped.

    Args:
        num_samples: the size of the dataset.
        seed: seeds the order and the sample seeds of every epoch.
        num_replicas: processes sharing the data.
        rank: this process's rank among them.

    Raises:
        ValueError: when there are fewer samples than processes.
    """

    def __init__(self, num_samples: int, seed: int = 0, num_replicas: int = 1, rank: int = 0) -> None:
        if num_samples < num_replicas:
            raise ValueError(f"cannot shard {num_samples} samples over {num_replicas} processes")
        self.num_samples_total = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.shuffle = True
        self.drop_last = True
        self.num_samples = num_samples // num_replicas
        self.total_size = self.num_samples * num_replicas
        self._resume_at: tuple[int, int] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def resume(self, epoch: int, samples_seen: int) -> None:
        """Start the next iteration inside an epoch.

        Args:
            epoch: the epoch to resume.
            samples_seen: keys of that epoch's global order already consumed (by all ranks together).

        Raises:
            ValueError: when ``epoch`` is negative or ``samples_seen`` is not in ``[0, num_samples]``.
        """
        if epoch < 0 or not 0 <= samples_seen <= self.num_samples_total:
            raise ValueError(f"cannot resume at epoch {epoch} after {samples_seen} of {self.num_samples_total} samples")
        self._resume_at = (epoch, samples_seen)
        self.epoch = epoch

    def __iter__(self) -> Iterator[SampleKey]:  # type: ignore[override]  # (index, seed) keys, not indices
        skip = 0
        if self._resume_at is not None:
            self.epoch, skip = self._resume_at
            self._resume_at = None
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_samples_total, generator=generator).tolist()
        seeds = torch.randint(0, 2**62, (self.num_samples_total,), generator=generator).tolist()
        keys = list(zip(order, seeds))[skip:]
        keys = keys[: len(keys) // self.num_replicas * self.num_replicas]  # every rank gets as many
        return iter(keys[self.rank :: self.num_replicas])


@contextmanager
def seeded_generators(seed: int) -> Iterator[None]:
    """torch's CPU generator, Python's ``random`` and numpy's global generator seeded with ``seed`` inside the block
    and restored after it (transforms of other libraries draw from any of them)."""
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


def _transform_list(transform: Callable | Sequence[Callable]) -> list[Callable]:
    return list(transform) if isinstance(transform, Sequence) else [transform]


class MultiViewDataset(Dataset):
    """``L`` augmented views of one image (paper Alg. 1): ``(index, seed) -> ([views (L, C, H, W)], target, index,
    grids (L, g, g, 2) or None)``, grids where the transforms return views with grids (VICRegL). ``transform`` is one
    view transform, or one per view kind (view ``l`` uses ``transform[l % len]``); the image is decoded once.

    Raises:
        ValueError: when ``num_views`` is below 1.
    """

    def __init__(self, images: LabelledImages, transform: Callable | Sequence[Callable], num_views: int) -> None:
        if num_views < 1:
            raise ValueError(f"num_views must be >= 1; got {num_views}")
        self.images, self.transforms, self.num_views = images, _transform_list(transform), num_views

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: SampleKey) -> Sample:
        index = int(key[0])
        image, target = self.images[index]
        with seeded_generators(key[1]):
            views = [self.transforms[view % len(self.transforms)](image) for view in range(self.num_views)]
        if isinstance(views[0], tuple):  # views with grids
            grids = torch.stack([grid for _, grid in views])
            return [torch.stack([view for view, _ in views])], int(target), index, grids
        return [torch.stack(views)], int(target), index, None


class SameClassDataset(Dataset):
    """``L`` different images of one class (supervised scenario): ``(index, seed) -> ([members (L, C, H, W)], target,
    index, None)``. Member 0 is the indexed image; the other ``L - 1`` are drawn without replacement from the rest of
    its class. Member ``l`` goes through ``transform`` (or ``transform[l % len]``).

    Raises:
        ConfigurationError: when a class has fewer than ``num_views`` images.
    """

    def __init__(self, images: LabelledImages, transform: Callable | Sequence[Callable], num_views: int) -> None:
        self.images, self.transforms, self.num_views = images, _transform_list(transform), num_views
        targets = torch.as_tensor(images.targets)
        self.by_class = {int(c): (targets == c).nonzero().flatten() for c in targets.unique()}
        smallest = min(self.by_class.items(), key=lambda item: len(item[1]))
        if len(smallest[1]) < num_views:
            raise ConfigurationError(
                f"SameClassViews needs at least count={num_views} images per class, but class {smallest[0]} has "
                f"{len(smallest[1])}; lower the count or use SimCLRViews",
                parameter="views",
            )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: SampleKey) -> Sample:
        index, seed = int(key[0]), int(key[1])
        target = self.images.targets[index]
        candidates = self.by_class[target]
        candidates = candidates[candidates != index]
        generator = torch.Generator().manual_seed(seed)
        partners = candidates[torch.randperm(len(candidates), generator=generator)[: self.num_views - 1]].tolist()
        with seeded_generators(seed):
            members = [
                self.transforms[member % len(self.transforms)](self.images[i][0])
                for member, i in enumerate([index, *partners])
            ]
        return [torch.stack(members)], int(target), index, None


class GroupedViews(Dataset):
    """``(index, seed) -> (groups [(n_g, C, S_g, S_g)], target, index, None)``: ``draw(image)``'s views of one image
    on generators seeded with the sample's seed, consecutive views of equal shape stacked into a group."""

    def __init__(self, split: LabelledImages, draw: Callable[[Any], list[Tensor]]) -> None:
        self.split, self.draw = split, draw

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: SampleKey) -> Sample:
        index, seed = int(key[0]), int(key[1])
        image, target = self.split[index]
        with seeded_generators(seed):
            views = self.draw(image)
        groups: list[list[Tensor]] = []
        for view in views:
            if groups and groups[-1][0].shape == view.shape:
                groups[-1].append(view)
            else:
                groups.append([view])
        return [torch.stack(group) for group in groups], int(target), index, None


def collate_samples(samples: list[Sample]) -> ViewBatch:
    """The :class:`ViewBatch` of a batch of per-sample views."""
    grids = [sample[3] for sample in samples]
    return stack_samples(
        [(groups, target, index) for groups, target, index, _ in samples],
        None if grids[0] is None else [grid for grid in grids if grid is not None],
    )


class EvalDataset(Dataset):
    """One un-augmented image: ``index -> (transform(image) (C, H, W), target)``, or ``(..., target, index)``
    ``with_index``."""

    def __init__(self, images: LabelledImages, transform: Callable, with_index: bool = False) -> None:
        self.images, self.transform, self.with_index = images, transform, with_index

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, int] | tuple[Tensor, int, int]:
        image, target = self.images[index]
        return (self.transform(image), target, index) if self.with_index else (self.transform(image), target)
