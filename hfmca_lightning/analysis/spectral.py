"""Eigenspectrum, basis functions and local density ratio of a trained cost (paper Alg. 4; docs/conventions.md §4).

From the regularised statistics ``A = R1 + reg I``, ``C = R2 + reg I`` and ``P``:

    A^{-1/2} P C^{-1/2} = U diag(sqrt(sigma)) V^T                       (SVD, descending)
    phi_hat(z) = U^T A^{-1/2} z,   psi_hat(h) = V^T C^{-1/2} h          (orthonormal basis functions)
    rho_hat(z, h) = sum_k sqrt(sigma_k) phi_hat_k(z) psi_hat_k(h)       (local density ratio)

and the cost is ``r = sum_k log(1 - sigma_k)`` (Schur complement), so the spectrum and the cost are
two views of the same statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hfmca_lightning.losses.hfmca_cost import check_reg
from hfmca_lightning.losses.statistics import CorrelationStatistics, group_statistics, marginal_blocks

__all__ = ["SpectralDecomposition", "decompose", "eigenspectrum", "inverse_sqrt"]


def inverse_sqrt(matrix: Tensor) -> Tensor:
    """Symmetric inverse square root ``M^{-1/2}`` of a symmetric positive-definite matrix."""
    values, vectors = torch.linalg.eigh(matrix)
    return (vectors * values.rsqrt()) @ vectors.T


@dataclass(frozen=True)
class SpectralDecomposition:
    """Alg. 4 normalisation of one cost. ``r = min(K1, K2)``.

    Attributes:
        low_whitening: ``(K1, K1)`` ``A^{-1/2}``.
        high_whitening: ``(K2, K2)`` ``C^{-1/2}``.
        low_singular_vectors: ``(K1, r)`` ``U``.
        high_singular_vectors: ``(K2, r)`` ``V``.
        eigenvalues: ``(r,)`` ``sigma_k`` in ``[0, 1)``, descending.
    """

    low_whitening: Tensor
    high_whitening: Tensor
    low_singular_vectors: Tensor
    high_singular_vectors: Tensor
    eigenvalues: Tensor

    def low_basis(self, z: Tensor) -> Tensor:
        """``phi_hat(z)``: ``(..., K1)`` low-level features -> ``(..., r)`` basis functions."""
        return z.to(torch.float64) @ (self.low_whitening @ self.low_singular_vectors)

    def high_basis(self, h: Tensor) -> Tensor:
        """``psi_hat(h)``: ``(..., K2)`` high-level features -> ``(..., r)`` basis functions."""
        return h.to(torch.float64) @ (self.high_whitening @ self.high_singular_vectors)

    def density_ratio(self, z: Tensor, h: Tensor) -> Tensor:
        """``rho_hat(z, h)`` for broadcastable ``z (..., K1)`` and ``h (..., K2)`` -> ``(...)``."""
        return (self.low_basis(z) * self.eigenvalues.sqrt() * self.high_basis(h)).sum(dim=-1)


def decompose(stats: CorrelationStatistics, *, reg: float = 0.1) -> SpectralDecomposition:
    """Alg. 4: whiten the regularised statistics and take the SVD of the whitened cross-correlation."""
    check_reg(reg)
    a, c, cross = marginal_blocks(stats.detach(), reg)
    low_whitening = inverse_sqrt(a)
    high_whitening = inverse_sqrt(c)
    u, singular_values, vh = torch.linalg.svd(low_whitening @ cross @ high_whitening, full_matrices=False)
    return SpectralDecomposition(
        low_whitening=low_whitening,
        high_whitening=high_whitening,
        low_singular_vectors=u,
        high_singular_vectors=vh.T,
        eigenvalues=singular_values.square(),
    )


def eigenspectrum(low: Tensor, high: Tensor, *, reg: float = 0.1) -> Tensor:
    """Eigenvalues ``sigma_k`` (descending, ``min(K1, K2)`` of them) between ``low (M, L, K1)`` and ``high (M, K2)``."""
    return decompose(group_statistics(low, high), reg=reg).eigenvalues
