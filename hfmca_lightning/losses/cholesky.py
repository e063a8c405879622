"""Batched Cholesky factorisations and inverses of the costs' matrices (docs/conventions.md §1, numerics).

A training step with internal costs factors about twenty symmetric positive definite matrices of a handful of
sizes. Issued one at a time they are latency, not arithmetic, on a GPU; here every stack of matrices of one
size goes to the solver in one batched call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["cholesky_by_size", "inverse_from_factor", "identity_where"]

# MKL's Cholesky runs slower at sizes that are multiples of 64 (docs/benchmarks/cpu.md); such sizes from 128 up are
# factored with this many rows and columns of the identity appended.
_CPU_PADDING = 8


def cholesky_by_size(matrices: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Lower Cholesky factors of stacks of matrices ``(n_i, k_i, k_i)``, with one ``torch.linalg.cholesky_ex`` call
    per distinct size ``k``: stacks of equal size are concatenated, factored together and split again.

    Returns ``(factor (n_i, k_i, k_i), info (n_i,))`` per stack, in order; ``info > 0`` is the order of the first
    leading minor that is not positive definite (the factor's values are then meaningless), ``0`` success.
    """
    by_size: dict[int, list[int]] = {}
    for position, stack in enumerate(matrices):
        if stack.dim() != 3 or stack.shape[-1] != stack.shape[-2]:
            raise ValueError(f"expected a stack of square matrices (n, k, k); got shape {tuple(stack.shape)}")
        by_size.setdefault(stack.shape[-1], []).append(position)
    results: dict[int, tuple[Tensor, Tensor]] = {}
    for positions in by_size.values():
        stacks = [matrices[position] for position in positions]
        factors, infos = _cholesky_ex(stacks[0] if len(stacks) == 1 else torch.cat(stacks))
        start = 0
        for position, stack in zip(positions, stacks):
            stop = start + stack.shape[0]
            results[position] = (factors[start:stop], infos[start:stop])
            start = stop
    return [results[position] for position in range(len(matrices))]


def _cholesky_ex(stack: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.cholesky_ex`` of ``(n, k, k)``; on CPUs of ``[[M, 0], [0, I]]`` when ``k`` is a multiple of 64
    from 128 up (the factor's leading block is M's)."""
    size = stack.shape[-1]
    if stack.device.type != "cpu" or size < 128 or size % 64:
        return torch.linalg.cholesky_ex(stack)
    padded = F.pad(stack, (0, _CPU_PADDING, 0, _CPU_PADDING))
    padded.diagonal(dim1=-2, dim2=-1)[..., size:] = 1.0
    factors, infos = torch.linalg.cholesky_ex(padded)
    return factors[..., :size, :size], infos


def identity_where(failed: Tensor, factors: Tensor) -> Tensor:
    """``factors (n, k, k)`` with the identity in place of those whose factorisation ``failed (n,)``: what is
    computed from them next (inverses, triangular solves) then never raises and never waits on the host; the
    step that failed is reported from its flags."""
    identity = torch.eye(factors.shape[-1], dtype=factors.dtype, device=factors.device)
    return torch.where(failed[:, None, None], identity, factors)


def inverse_from_factor(factors: Tensor) -> Tensor:
    """``(L L^T)^-1`` of lower factors ``(n, k, k)``: LAPACK's ``potri`` on CPUs; on GPUs ``L^-T L^-1`` from one
    triangular solve and one product (``torch.cholesky_inverse`` spends far more host time per call there)."""
    if factors.device.type == "cpu":
        return torch.cholesky_inverse(factors)
    return _inverse_by_triangular_solve(factors)


def _inverse_by_triangular_solve(factors: Tensor) -> Tensor:
    """``(L L^T)^-1 = L^-T L^-1`` (the GPU path of :func:`inverse_from_factor`)."""
    identity = torch.eye(factors.shape[-1], dtype=factors.dtype, device=factors.device).expand_as(factors)
    inverse_factors = torch.linalg.solve_triangular(factors, identity, upper=False)
    return inverse_factors.mT @ inverse_factors
