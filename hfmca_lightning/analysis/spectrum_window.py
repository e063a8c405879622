"""The statistics that training-time spectra are taken from: a window of consecutive steps holding enough groups
(docs/conventions.md §4).

One batch of 64 images holds 64 groups for 128-d features, and the spectrum of so few groups shows dependence that
is not there (independent 64-d features: eigenvalues ~0.3 from 32 groups, ~0.01 from 6,400). A
:class:`SpectrumWindow` sums each cost pair's statistics over the batches (and micro-batches) added since the last
:meth:`~SpectrumWindow.close`, keeps the sums of the last closed intervals, and gives the newest intervals that
together hold at least the groups a pair needs.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Mapping
from functools import reduce
from typing import Any

import torch
from torch import Tensor

from hfmca_lightning.analysis.spectral import decompose
from hfmca_lightning.losses.statistics import CorrelationStatistics

__all__ = ["GROUPS_PER_FEATURE", "SpectrumWindow", "groups_needed"]

GROUPS_PER_FEATURE = 100  # groups per feature of the larger side that a spectrum needs, by default


def groups_needed(stats: CorrelationStatistics, groups_per_feature: int = GROUPS_PER_FEATURE) -> int:
    """The fewest groups a pair's spectrum needs: ``groups_per_feature * max(K1, K2)``."""
    return groups_per_feature * max(stats.low_dim, stats.high_dim)


class SpectrumWindow:
    """Per cost pair, the statistics of the newest consecutive intervals holding at least ``groups_needed`` groups,
    and the spectra taken from them.

    Args:
        min_groups: the fewest groups a window holds; default ``groups_per_feature * max(K1, K2)`` per pair.
        groups_per_feature: see ``min_groups``.

    Raises:
        ValueError: when ``min_groups`` or ``groups_per_feature`` is below 1.

    Example::

        window = SpectrumWindow(groups_per_feature=100)
        for step in range(60):
            stats = group_statistics(torch.randn(64, 9, 32), torch.randn(64, 16))  # one step's, per cost pair
            window.add({"external": stats})  # every batch and micro-batch
            if step % 10 == 9:  # a logged step
                window.close()
                eigenvalues = window.spectrum("external", reg=0.1)  # None until the window holds 3,200 groups
    """

    def __init__(self, min_groups: int | None = None, groups_per_feature: int = GROUPS_PER_FEATURE) -> None:
        if min_groups is not None and min_groups < 1:
            raise ValueError(f"min_groups must be >= 1 or None; got {min_groups}")
        if groups_per_feature < 1:
            raise ValueError(f"groups_per_feature must be >= 1; got {groups_per_feature}")
        self.min_groups, self.groups_per_feature = min_groups, groups_per_feature
        self.open: dict[str, CorrelationStatistics] = {}  # per pair, the sum since the last close
        self.chunks: dict[str, deque[CorrelationStatistics]] = {}  # per pair, the sums of the last closed intervals
        self.latest: dict[str, Tensor] = {}  # per pair, the non-trivial eigenvalues of the last spectrum
        self.groups: dict[str, int] = {}  # per pair, the groups the last spectrum came from

    def groups_needed(self, stats: CorrelationStatistics) -> int:
        """The fewest groups a pair's window must hold.

        Args:
            stats: statistics of the pair (for its dimensions ``K1``, ``K2``).

        Returns:
            ``min_groups``, or ``groups_per_feature * max(K1, K2)``.
        """
        return self.min_groups or groups_needed(stats, self.groups_per_feature)

    def add(self, statistics: Mapping[str, CorrelationStatistics]) -> None:
        """Add one batch's (or micro-batch's) statistics of every pair to the open interval (detached).

        Args:
            statistics: the batch's statistics, keyed by pair (``external``, ``internal/L3``, ...).
        """
        added = {name: stats.detach() for name, stats in statistics.items()}
        present = [name for name in added if name in self.open]
        for name in present:
            held, new = self.open[name], added[name]
            if (held.low_dim, held.high_dim) != (new.low_dim, new.high_dim):
                raise ValueError(
                    f"statistics of {name} changed dimensions within a window: (K1={held.low_dim}, "
                    f"K2={held.high_dim}) then (K1={new.low_dim}, K2={new.high_dim})"
                )
        if present:  # every pair's sums in one multi-tensor addition (a few kernels a step, not five per pair)
            sums = torch._foreach_add(
                [tensor for name in present for tensor in _as_tuple(self.open[name])],
                [tensor for name in present for tensor in _as_tuple(added[name])],
            )
            for index, name in enumerate(present):
                self.open[name] = CorrelationStatistics(*sums[5 * index : 5 * index + 5])
        for name, stats in added.items():
            self.open.setdefault(name, stats)

    def close(self) -> None:
        """End the open interval: its sums become each pair's newest chunk."""
        for name, stats in self.open.items():
            self.chunks.setdefault(name, deque()).append(stats)
        self.open = {}

    def full(self, name: str) -> tuple[CorrelationStatistics, int] | None:
        """The newest closed intervals of a pair that together hold the groups it needs; older ones are dropped.

        Args:
            name: the pair.

        Returns:
            The sum of those intervals' statistics and their number of groups (one host read of the counts), or
            ``None`` while there are too few.
        """
        chunks = self.chunks.get(name)
        if not chunks:
            return None
        counts = torch.stack([stats.group_count for stats in chunks]).tolist()
        needed = self.groups_needed(chunks[-1])
        total, start = 0.0, len(chunks)
        while start > 0 and total < needed:
            start -= 1
            total += counts[start]
        for _ in range(start):
            chunks.popleft()
        if total < needed:
            return None
        return reduce(operator.add, chunks), int(total)

    def spectrum(self, name: str, reg: float) -> Tensor | None:
        """Alg. 4's eigenvalues of a pair's full window; its non-trivial ones and group count are kept in
        :attr:`latest` and :attr:`groups`.

        Args:
            name: the pair.
            reg: ``> 0`` diagonal regulariser of the decomposition.

        Returns:
            ``(K,)`` eigenvalues (CPU, descending; the first the constant function's), or ``None`` while the window
            is not full.
        """
        window = self.full(name)
        if window is None:
            return None
        stats, groups = window
        eigenvalues = decompose(stats, reg=reg).eigenvalues.cpu()
        self.latest[name], self.groups[name] = eigenvalues[1:], groups
        return eigenvalues

    def to(self, device: torch.device) -> SpectrumWindow:
        """Move the sums to ``device`` (a checkpoint may be loaded on the CPU).

        Args:
            device: where the sums go.

        Returns:
            This window.
        """
        self.open = {name: _to(stats, device) for name, stats in self.open.items()}
        self.chunks = {name: deque(_to(stats, device) for stats in chunks) for name, chunks in self.chunks.items()}
        return self

    def state_dict(self) -> dict[str, Any]:
        """Everything the window holds, for a checkpoint.

        Returns:
            A few ``K x K`` sums per pair, the last spectra and their group counts.
        """
        return {
            "open": {name: _as_tuple(stats) for name, stats in self.open.items()},
            "chunks": {name: [_as_tuple(stats) for stats in chunks] for name, chunks in self.chunks.items()},
            "latest": {name: values.clone() for name, values in self.latest.items()},
            "groups": dict(self.groups),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave.

        Args:
            state: the output of :meth:`state_dict`.
        """
        self.open = {name: CorrelationStatistics(*tensors) for name, tensors in state.get("open", {}).items()}
        self.chunks = {
            name: deque(CorrelationStatistics(*tensors) for tensors in chunks)
            for name, chunks in state.get("chunks", {}).items()
        }
        self.latest = {name: values.clone() for name, values in state.get("latest", {}).items()}
        self.groups = {name: int(count) for name, count in state.get("groups", {}).items()}


def _as_tuple(stats: CorrelationStatistics) -> tuple[Tensor, ...]:
    """The five tensors of ``stats``, in the order of its fields."""
    return (stats.low_outer_sum, stats.high_outer_sum, stats.cross_sum, stats.member_count, stats.group_count)


def _to(stats: CorrelationStatistics, device: torch.device) -> CorrelationStatistics:
    return CorrelationStatistics(*(tensor.to(device) for tensor in _as_tuple(stats)))
