"""Per-step seeds: the random numbers of a training step as a function of ``(seed, step, rank)``.

Used by :class:`~hfmca_lightning.callbacks.RunState` (model noise), so that a resumed run draws exactly what an
uninterrupted one draws. (Views never need one: each sample's come from its own seed.)
"""

from __future__ import annotations

__all__ = ["step_seed"]

_MASK64 = 2**64 - 1


def step_seed(seed: int, step: int, rank: int = 0, stream: int = 0) -> int:
    """A 63-bit seed for training step ``step`` of process ``rank``: SplitMix64 over the four integers.

    Different ``stream`` values give unrelated seeds for the same step.
    """
    state = 0
    for value in (seed, step, rank, stream):
        state = _splitmix64(state ^ (value & _MASK64))
    return state >> 1


def _splitmix64(state: int) -> int:
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state ^ (state >> 31)
