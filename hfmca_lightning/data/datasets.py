"""The workers' per-sample work and the resumable sampler driving it: a sample's every random choice (views, same-class
partners) comes from its ``(index, seed)`` key, so runs do not depend on the worker count and resume exactly."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate, groupby
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from hfmca_lightning.data.sources import LabelledImages

__all__ = ["EvalDataset", "SeededRandomSampler", "SeededViews", "cycled_views", "same_class_views", "seeded_generators"]

SampleKey = tuple[int, int]
Sample = tuple[list[Tensor], int, int, Tensor | None]  # (groups [(n_g, C, H_g, W_g)], target, index, grids)
Transform = Callable[[Any], Any]  # image -> view, or (view, grid) with crop grids
DrawnViews = tuple[list[Any], int]  # ([view (C, H, W) or (view, grid (g, g, 2)), ...], target)
DrawFunction = Callable[[LabelledImages, int, int], DrawnViews]  # (split, index, seed) -> drawn views


class SeededRandomSampler(DistributedSampler):
    """Shuffles per epoch from ``(seed, epoch)``, yielding ``(index, sample_seed)`` keys (a ``DistributedSampler``: DDP
    leaves it in place). Rank ``r`` takes keys ``r, r + num_replicas, ...`` of one global order (an uneven tail is
    dropped), so consecutive per-rank batches of ``b`` hold exactly the samples and seeds of one single-process batch of
    ``num_replicas * b``. After :meth:`resume` the next iteration starts mid-epoch; ``len()`` stays the full epoch's
    (Lightning counts a resumed epoch's batches from where it stopped).

    Raises:
        ValueError: when ``num_samples`` is below ``num_replicas``.
    """

    def __init__(self, num_samples: int, seed: int = 0, num_replicas: int = 1, rank: int = 0) -> None:
        if num_samples < num_replicas:
            raise ValueError(f"cannot shard {num_samples} samples over {num_replicas} processes")
        self.num_samples_total, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.seed, self.epoch = seed, 0
        self.shuffle = self.drop_last = True
        self.num_samples = num_samples // num_replicas
        self.total_size = self.num_samples * num_replicas
        self._resume_at: tuple[int, int] | None = None
        self.loop_epoch: Callable[[], int] | None = None  # the training loop's epoch, where a trainer drives it

    def resume(self, epoch: int, samples_seen: int) -> None:
        """Start the next iteration at ``epoch`` past its first ``samples_seen`` keys (all ranks', before a checkpoint).

        Raises:
            ValueError: when ``epoch`` is negative or ``samples_seen`` is not in ``[0, num_samples_total]``.
        """
        if epoch < 0 or not 0 <= samples_seen <= self.num_samples_total:
            raise ValueError(f"cannot resume at epoch {epoch} after {samples_seen} of {self.num_samples_total} samples")
        self._resume_at = (epoch, samples_seen)
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration shuffles for: Lightning sets it, or :attr:`loop_epoch` gives it (after a resume
        that finishes an early-ended epoch, Lightning's is one ahead). A resume position of another epoch is dropped."""
        epoch = self.loop_epoch() if self.loop_epoch is not None else epoch
        if self._resume_at is not None and self._resume_at[0] != epoch:
            self._resume_at = None
        self.epoch = epoch

    def __iter__(self) -> Iterator[SampleKey]:  # (index, seed) keys, not indices
        self.epoch, skip = self._resume_at or (self.epoch, 0)
        self._resume_at = None
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_samples_total, generator=generator).tolist()
        seeds = torch.randint(0, 2**62, (self.num_samples_total,), generator=generator).tolist()
        keys = list(zip(order, seeds))[skip:]
        keys = keys[: len(keys) // self.num_replicas * self.num_replicas]  # every rank gets as many
        return iter(keys[self.rank :: self.num_replicas])


@contextmanager
def seeded_generators(seed: int) -> Iterator[None]:
    """torch's CPU, Python's and numpy's global generators seeded with ``seed`` in the block, restored after it (other
    libraries' transforms draw from any of them)."""
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


class SeededViews(Dataset):
    """``(index, seed) -> (groups [(n_g, C, H_g, W_g)], target, index, grids (L, g, g, 2) or None)``: the views of
    ``draw(split, index, seed) -> (views, target)`` stacked in groups of ``group_sizes`` (None: runs of equal shape);
    ``(view, grid)`` pairs (VICRegL) also give the grids."""

    def __init__(self, split: LabelledImages, draw: DrawFunction, group_sizes: Sequence[int] | None = None) -> None:
        self.split, self.draw, self.group_sizes = split, draw, group_sizes

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: SampleKey) -> Sample:
        index, seed = int(key[0]), int(key[1])
        views, target = self.draw(self.split, index, seed)
        grids = None
        if isinstance(views[0], tuple):
            grids, views = torch.stack([grid for _, grid in views]), [view for view, _ in views]
        runs = groupby(views, key=lambda view: view.shape)
        sizes = [len(list(run)) for _, run in runs] if self.group_sizes is None else self.group_sizes
        groups = [torch.stack(views[end - size : end]) for size, end in zip(sizes, accumulate(sizes))]
        return groups, int(target), index, grids


def cycled_views(
    transforms: Sequence[Transform], count: int, split: LabelledImages, index: int, seed: int
) -> DrawnViews:
    """``count`` views of image ``index`` (paper Alg. 1), view ``l`` by ``transforms[l % len]``, seeded once read."""
    image, target = split[index]
    with seeded_generators(seed):
        return [transforms[view % len(transforms)](image) for view in range(count)], target


def same_class_views(
    transforms: Sequence[Transform], by_class: dict[int, Tensor], split: LabelledImages, index: int, seed: int
) -> DrawnViews:
    """Image ``index`` and ``len(transforms) - 1`` others of its class (``by_class``: indices per class) drawn from
    ``seed`` without replacement; member ``l`` read and put through ``transforms[l]`` with generators seeded from it."""
    target = split.targets[index]
    candidates = by_class[target][by_class[target] != index]
    order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed))
    members = [index, *candidates[order[: len(transforms) - 1]].tolist()]
    with seeded_generators(seed):
        return [transform(split[member][0]) for transform, member in zip(transforms, members)], target


class EvalDataset(Dataset):
    """One un-augmented image: ``index -> (transform(image) (C, H, W), target)``, or ``as_dict`` a dict format's
    ``{"image", "label", "sample_idx"}`` (``sample_idx``: ``index``)."""

    def __init__(self, images: LabelledImages, transform: Callable[[Any], Tensor], as_dict: bool = False) -> None:
        self.images, self.transform, self.as_dict = images, transform, as_dict

    def __len__(self) -> int:
        return len(self.images)

    def labelled_image(self, index: int) -> tuple[Tensor, int]:
        """``(transform(image) (C, H, W), target)`` of image ``index``."""
        image, target = self.images[index]
        return self.transform(image), target

    def __getitem__(self, index: int) -> tuple[Tensor, int] | dict[str, Any]:
        image, target = self.labelled_image(index)
        return {"image": image, "label": target, "sample_idx": index} if self.as_dict else (image, target)
