"""Training and evaluation datasets over a split, and the resumable sampler that drives them.

Training datasets take keys ``(index, sample_seed)`` from :class:`SeededRandomSampler`: all randomness
of a sample (its views' augmentation parameters, its same-class partners) is a function of that seed,
so runs are identical whatever the number of workers, and a run resumed from a checkpoint sees exactly
the batches an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from hfmca_lightning.data.sources import LabelledImages
from hfmca_lightning.errors import ConfigurationError

__all__ = ["SeededRandomSampler", "MultiViewDataset", "SingleViewDataset", "SameClassDataset", "EvalDataset"]

SampleKey = tuple[int, int]


class SeededRandomSampler(DistributedSampler):
    """Shuffles the data per epoch from ``(seed, epoch)`` and yields ``(index, sample_seed)`` keys.

    One global order is drawn for all ranks; rank ``r`` of ``num_replicas`` takes every ``num_replicas``-th
    key starting at ``r`` (the tail that does not divide evenly is dropped), so consecutive per-rank
    batches of ``b`` together hold exactly the samples, with exactly the augmentation seeds, of one
    single-process batch of ``num_replicas * b``. Lightning calls :meth:`set_epoch` every epoch and,
    since this is a ``DistributedSampler``, leaves it in place under DDP.

    :meth:`resume` makes the next iteration start inside an epoch: at ``epoch``, after the first
    ``samples_seen`` keys of the global order (what all ranks together consumed before a checkpoint).
    ``len()`` stays the full epoch's, as Lightning's loop counts the batches of a resumed epoch from where
    it stopped.

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
def _seeded(seed: int | None) -> Iterator[None]:
    """Run the block on torch's global CPU generator seeded with ``seed`` and restore it afterwards."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _split_key(key: int | SampleKey) -> tuple[int, int | None]:
    return (key, None) if isinstance(key, int) else (int(key[0]), int(key[1]))


def _transform_list(transform: Callable | Sequence[Callable]) -> list[Callable]:
    return list(transform) if isinstance(transform, Sequence) else [transform]


class MultiViewDataset(Dataset):
    """``L`` augmented views of one image: ``key -> (views (L, C, H, W), target)`` (paper Alg. 1), or
    ``(views, target, grids (L, g, g, 2))`` when the transforms return views with grids (:class:`ViewWithGrid`).

    ``transform`` is one view transform, or one per view kind (view ``l`` uses ``transform[l % len]``); or
    ``all_views(image, L) -> (L, C, H, W)`` draws the ``L`` views in one batched call instead. The image is
    decoded once for its ``L`` views.

    Args:
        images: the split.
        transform: one view transform, or one per view kind.
        num_views: ``L``, views per image.
        all_views: draws all ``L`` views of an image in one call instead of ``transform``.

    Raises:
        ValueError: when ``num_views`` is below 1.
    """

    def __init__(
        self,
        images: LabelledImages,
        transform: Callable | Sequence[Callable],
        num_views: int,
        all_views: Callable[[Tensor, int], Tensor] | None = None,
    ) -> None:
        if num_views < 1:
            raise ValueError(f"num_views must be >= 1; got {num_views}")
        self.images, self.transforms, self.num_views, self.all_views = (
            images,
            _transform_list(transform),
            num_views,
            all_views,
        )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | SampleKey) -> tuple[Tensor, int]:
        index, seed = _split_key(key)
        image, target = self.images[index]
        with _seeded(seed):
            if self.all_views is not None:
                return self.all_views(image, self.num_views), target
            views = [self.transforms[view % len(self.transforms)](image) for view in range(self.num_views)]
        if isinstance(views[0], tuple):  # ViewWithGrid: (views, target, grids (L, g, g, 2))
            return torch.stack([view for view, _ in views]), target, torch.stack([grid for _, grid in views])
        return torch.stack(views), target


class SeededImageDataset(Dataset):
    """One image and the seed of its views: ``key -> (transform(image), target, sample_seed)``; the views are
    drawn for the whole batch by the collate function (:class:`~hfmca_lightning.data.BatchedViews`)."""

    def __init__(self, images: LabelledImages, transform: Callable) -> None:
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | SampleKey) -> tuple[Tensor, int, int]:
        index, seed = _split_key(key)
        if seed is None:
            raise ValueError("SeededImageDataset needs (index, seed) keys, as SeededRandomSampler yields")
        image, target = self.images[index]
        return self.transform(image), target, seed


class SingleViewDataset(MultiViewDataset):
    """One augmented view of one image: ``key -> (image (C, H, W), target)``.

    Args:
        images: the split.
        transform: the view transform (or one per view kind; the first is used).
        num_views: views drawn per image, of which the first is kept (mode ``single`` has 1).
        all_views: draws the views of an image in one call instead of ``transform``.

    Raises:
        ValueError: when ``num_views`` is below 1.
    """

    def __getitem__(self, key: int | SampleKey) -> tuple[Tensor, int]:
        views, target = super().__getitem__(key)
        return views[0], target


class SameClassDataset(Dataset):
    """``L`` different images of one class: ``key -> (members (L, C, H, W), target)`` (supervised scenario).

    Member 0 is the indexed image; the other ``L - 1`` are drawn without replacement from the rest of its
    class. Member ``l`` goes through ``transform`` (or ``transform[l % len]``).

    Args:
        images: the split, labelled.
        transform: one view transform, or one per member.
        num_views: ``L``, members per group.

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
                f"same_class mode needs at least num_views={num_views} images per class, but class "
                f"{smallest[0]} has {len(smallest[1])}; lower num_views or use mode 'views'"
            )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | SampleKey) -> tuple[Tensor, int]:
        index, seed = _split_key(key)
        target = self.images.targets[index]
        candidates = self.by_class[target]
        candidates = candidates[candidates != index]
        generator = torch.Generator()
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ())))
        partners = candidates[torch.randperm(len(candidates), generator=generator)[: self.num_views - 1]].tolist()
        with _seeded(seed):
            members = torch.stack(
                [
                    self.transforms[member % len(self.transforms)](self.images[i][0])
                    for member, i in enumerate([index, *partners])
                ]
            )
        return members, target


class EvalDataset(Dataset):
    """One un-augmented image: ``index -> (image (C, H, W), target)``.

    Args:
        images: the split.
        transform: the evaluation transform (:func:`~hfmca_lightning.data.transforms.eval_transform`).
    """

    def __init__(self, images: LabelledImages, transform: Callable) -> None:
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image, target = self.images[index]
        return self.transform(image), target
