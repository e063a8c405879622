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
    """Symmetric inverse square root ``M^{-1/2}`` of a symmetric positive-definite matrix, by its eigendecomposition.

    Args:
        matrix: ``(K, K)`` symmetric positive-definite matrix.

    Returns:
        ``(K, K)`` symmetric matrix ``M^{-1/2}``.
    """
    values, vectors = torch.linalg.eigh(matrix)
    return (vectors * values.rsqrt()) @ vectors.T


@dataclass(frozen=True)
class SpectralDecomposition:
    """Alg. 4 normalisation of one cost, made by :func:`decompose`. ``r = min(K1, K2)``.

    Gives the basis functions (:meth:`low_basis`, :meth:`high_basis`) and the local density ratio
    (:meth:`density_ratio`) of the module docstring.

    Args:
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
        """The low-level basis functions ``phi_hat(z) = U^T A^{-1/2} z``.

        Args:
            z: ``(..., K1)`` low-level features.

        Returns:
            ``(..., r)`` float64 basis functions.
        """
        return z.to(torch.float64) @ (self.low_whitening @ self.low_singular_vectors)

    def high_basis(self, h: Tensor) -> Tensor:
        """The high-level basis functions ``psi_hat(h) = V^T C^{-1/2} h``.

        Args:
            h: ``(..., K2)`` high-level features.

        Returns:
            ``(..., r)`` float64 basis functions.
        """
        return h.to(torch.float64) @ (self.high_whitening @ self.high_singular_vectors)

    def density_ratio(self, z: Tensor, h: Tensor) -> Tensor:
        """The local density ratio ``rho_hat(z, h) = sum_k sqrt(sigma_k) phi_hat_k(z) psi_hat_k(h)``.

        Args:
            z: ``(..., K1)`` low-level features.
            h: ``(..., K2)`` high-level features, broadcastable with ``z``.

        Returns:
            ``(...)`` float64 density ratios.
        """
        return (self.low_basis(z) * self.eigenvalues.sqrt() * self.high_basis(h)).sum(dim=-1)


def decompose(stats: CorrelationStatistics, *, reg: float = 0.1) -> SpectralDecomposition:
    """Eigenspectrum and basis functions of a cost (paper Alg. 4).

    Whitens the regularised statistics (``A = R1 + reg I``, ``C = R2 + reg I``) and takes the SVD of the whitened
    cross-correlation ``A^{-1/2} P C^{-1/2}`` (docs/conventions.md §4). The statistics are detached.

    Args:
        stats: the statistics of one cost, e.g. :func:`~hfmca_lightning.losses.group_statistics`.
        reg: ``> 0`` diagonal regulariser (1e-3 for spectrum analysis, paper appendix).

    Returns:
        The whitening matrices, singular vectors and eigenvalues (descending, in ``[0, 1)``).

    Raises:
        ConfigurationError: when ``reg`` is not a finite number ``> 0``.
        ValueError: when a solver refuses the statistics (NaN or Inf features, on the CPU).

    Example::

        stats = group_statistics(torch.randn(64, 9, 32), torch.randn(64, 16))
        spectral = decompose(stats, reg=1e-3)
        sigma = spectral.eigenvalues  # (16,), descending
        rho = spectral.density_ratio(torch.randn(5, 32), torch.randn(5, 16))  # (5,)
    """
    check_reg(reg)
    a, c, cross = marginal_blocks(stats.detach(), reg)
    try:
        low_whitening = inverse_sqrt(a)
        high_whitening = inverse_sqrt(c)
        u, singular_values, vh = torch.linalg.svd(low_whitening @ cross @ high_whitening, full_matrices=False)
    except torch.linalg.LinAlgError as error:  # CPU solvers refuse NaN or Inf: one line instead of theirs
        first = str(error).strip().splitlines()[0]
        raise ValueError(f"the statistics cannot be decomposed ({first}); are the features finite?") from None
    return SpectralDecomposition(
        low_whitening=low_whitening,
        high_whitening=high_whitening,
        low_singular_vectors=u,
        high_singular_vectors=vh.T,
        eigenvalues=singular_values.square(),
    )


def eigenspectrum(low: Tensor, high: Tensor, *, reg: float = 0.1) -> Tensor:
    """Eigenvalues ``sigma_k`` of the dependence between members and groups (paper Alg. 4).

    The cost of the same features is ``sum_k log(1 - sigma_k)`` (module docstring).

    Args:
        low: ``(M, L, K1)`` member features.
        high: ``(M, K2)`` group features.
        reg: ``> 0`` diagonal regulariser (1e-3 for spectrum analysis, paper appendix).

    Returns:
        ``(min(K1, K2),)`` float64 eigenvalues in ``[0, 1)``, descending.

    Raises:
        ConfigurationError: when ``reg`` is not a finite number ``> 0``.
        ValueError: when ``low`` is not ``(M, L, K1)`` or ``high`` not ``(M, K2)`` with the same ``M``.

    Example::

        sigma = eigenspectrum(torch.randn(64, 9, 32), torch.randn(64, 16), reg=1e-3)  # (16,), descending
    """
    return decompose(group_statistics(low, high), reg=reg).eigenvalues
