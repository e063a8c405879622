"""Global-batch statistics across processes (docs/conventions.md §1, across devices).

The statistics are sums plus counts, so the whole-batch statistics are an all-reduce (sum) of the
per-rank sums. The all-reduce must be autograd-aware: its backward all-reduces the gradients, so that
after DDP averages parameter gradients over W ranks they equal the single-process gradients. A raw
``dist.all_reduce`` has no backward and leaves gradients W times too small (lightly #1528, #1977).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from hfmca_lightning.losses.statistics import CorrelationStatistics

__all__ = [
    "distributed_world_size",
    "all_reduce_sum",
    "all_reduce_max",
    "all_reduce_statistics",
    "all_reduce_statistics_together",
]


def distributed_world_size() -> int:
    """Number of processes of the default group, or 1 when ``torch.distributed`` is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _functional_all_reduce_has_autograd() -> bool:
    from torch.distributed import _functional_collectives as funcol

    return hasattr(funcol, "all_reduce_backward")


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum of ``tensor`` over all ranks of the default group; differentiable (backward = sum of grads)."""
    if distributed_world_size() == 1:
        return tensor
    if _functional_all_reduce_has_autograd():
        from torch.distributed import _functional_collectives as funcol

        world = dist.group.WORLD
        assert world is not None  # initialised: the world size is > 1
        return funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), "sum", world))
    # Older torch: the functional all_reduce has no autograd formula yet; this API has one.
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(tensor.contiguous(), op=dist.ReduceOp.SUM)


def all_reduce_max(tensor: Tensor) -> Tensor:
    """Element-wise maximum of ``tensor`` over all ranks of the default group (not differentiable)."""
    if distributed_world_size() == 1:
        return tensor
    reduced = tensor.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced


def all_reduce_statistics(stats: CorrelationStatistics) -> CorrelationStatistics:
    """The statistics of the global batch: every field summed over ranks, in one collective.

    Differentiable: the backward pass sums the gradients over ranks, so DDP's averaged parameter gradients equal the
    single-process ones. Without ``torch.distributed`` (or with one process) ``stats`` come back as they are.

    Args:
        stats: this rank's statistics of one cost.

    Returns:
        The statistics summed over all ranks of the default group.
    """
    return all_reduce_statistics_together([stats])[0]


def all_reduce_statistics_together(statistics: Sequence[CorrelationStatistics]) -> list[CorrelationStatistics]:
    """The global-batch statistics of several cost pairs: every field of every pair summed over ranks in one
    collective (one flat float64 tensor), instead of one collective per pair."""
    if distributed_world_size() == 1 or not statistics:
        return list(statistics)
    fields = [field for stats in statistics for field in _fields(stats)]
    flat = all_reduce_sum(torch.cat([field.reshape(-1) for field in fields]))
    pieces = iter(
        piece.reshape(field.shape)
        for piece, field in zip(torch.split(flat, [field.numel() for field in fields]), fields)
    )
    return [CorrelationStatistics(*(next(pieces) for _ in range(5))) for _ in statistics]


def _fields(stats: CorrelationStatistics) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return stats.low_outer_sum, stats.high_outer_sum, stats.cross_sum, stats.member_count, stats.group_count
