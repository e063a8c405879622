"""Random numbers as a function of ``(sample seed, position)``: counter-based, batched, the same on every device (no
per-sample generator resets on a GPU); a sample's numbers do not depend on its batch, rank or device. The hash is Chris
Wellons' ``lowbias32``, chained over the seed's two 32-bit halves, the stream and the position."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["CounterUniforms", "counter_uniforms", "hash32"]

_MASK32 = 0xFFFFFFFF
_ROUNDS = ((16, 0x7FEB352D), (15, 0x846CA68B))  # lowbias32's shift and multiplier of each round
_STREAM = 0x9E3779B9  # the golden ratio's bits: keeps stream 0 from leaving the seed's hash unchanged


def hash32(x: Tensor) -> Tensor:
    """``lowbias32`` of int64 ``x`` in ``[0, 2**32)``: a bijection of 32-bit words with good avalanche."""
    for shift, multiplier in _ROUNDS:
        x = x ^ (x >> shift)  # then x * multiplier mod 2**32 by its 16-bit halves: exact in int64 on any device
        x = (x * (multiplier & 0xFFFF) + (((x * (multiplier >> 16)) & 0xFFFF) << 16)) & _MASK32
    return x ^ (x >> 16)


def counter_uniforms(seeds: Tensor, count: int, stream: int = 0) -> Tensor:
    """``(B, count)`` float64 uniforms in ``[0, 1)``, row ``b`` a function of ``(seeds[b], stream)`` only: ``seeds``
    ``(B,)`` int64 in ``[0, 2**63)`` (as the sampler gives them), any device; ``stream`` separates uses of the seeds."""
    if seeds.dim() != 1 or seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be a (B,) int64 tensor; got {seeds.dtype} {tuple(seeds.shape)}")
    state = hash32(seeds & _MASK32)
    state = hash32(state ^ (seeds >> 32))
    state = hash32(state ^ (((stream + 1) * _STREAM) & _MASK32))
    positions = torch.arange(2 * count, dtype=torch.int64, device=seeds.device)
    bits = hash32(state[:, None] ^ hash32(positions)[None, :]).view(-1, count, 2)
    # 53 random bits per number, as numpy's random_double: 27 from one word, 26 from the next
    return ((bits[..., 0] >> 5) * 67108864 + (bits[..., 1] >> 6)).to(torch.float64) / 9007199254740992.0


class CounterUniforms:
    """``per_view`` uniforms for each of ``L`` views of ``B`` samples, made at once by :func:`counter_uniforms`, handed
    out in order by :meth:`uniform` and :meth:`rand` as ``(B * L, ...)``: view ``l`` of sample ``b`` is row
    ``b * L + l``, its numbers a function of ``seeds[b]``, ``l`` and the order of requests."""

    def __init__(self, seeds: Tensor, num_views: int, per_view: int = 40) -> None:
        self.rows, self.per_view = seeds.shape[0] * num_views, per_view
        self._numbers, self._used = counter_uniforms(seeds, num_views * per_view).view(self.rows, per_view), 0

    def rand(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        """Uniforms in ``[0, 1)`` of ``shape = (B * L, ...)`` (those that ``dtype`` would round up to 1 are its
        largest value below 1, so ``rand < p`` holds for ``p = 1``)."""
        if shape[0] != self.rows:
            raise ValueError(f"requests must have one row per view ({self.rows}); got shape {shape}")
        width = math.prod(shape[1:])
        if self._used + width > self.per_view:
            raise ValueError(f"more than {self.per_view} random numbers per view requested: raise per_view")
        numbers = self._numbers[:, self._used : self._used + width].reshape(shape)
        self._used += width
        return numbers.to(dtype).clamp_(max=1.0 - torch.finfo(dtype).eps / 2)

    def uniform(self, shape: tuple[int, ...], low: float, high: float, dtype: torch.dtype = torch.float32) -> Tensor:
        """Uniforms in ``[low, high)`` of ``shape = (B * L, ...)`` (float32: may round up to ``high``)."""
        return (self.rand(shape, torch.float64) * (high - low) + low).to(dtype)
