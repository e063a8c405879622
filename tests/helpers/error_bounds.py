"""Tolerances from the arithmetic they check: unit roundoffs, gamma_n, error bounds of log-determinants, inverses,
costs, gradients and eigenvalues, and sampling bounds (KS, binomial)."""

from __future__ import annotations

import torch

from hfmca_lightning.losses import CorrelationStatistics
from tests.helpers.references import reference_group_moments

# Round to nearest: |fl(x) - x| <= u |x|, with the unit roundoff u of each precision. Bounds are worst cases, valid on
# any CPU or BLAS (any summation order); a test states beside its tolerance which bound it uses and with what n.
FLOAT32_UNIT = 2.0**-24
FLOAT64_UNIT = 2.0**-53


def gamma(terms: int, unit: float) -> float:
    """``gamma_n = n u / (1 - n u)``: the largest error of a sum or dot product of ``terms`` rounded terms, relative
    to the sum of the terms' magnitudes, in any order of summation (Higham, *Accuracy and Stability of Numerical
    Algorithms*, §3.1). Two computations of the same sum in different orders differ by at most twice that."""
    return terms * unit / (1 - terms * unit)


def logdet_error(matrix: torch.Tensor) -> float:
    """Bound on the absolute error of ``logdet`` of a symmetric positive definite float64 ``matrix`` from a Cholesky
    factor: the computed factor is exact for ``M + dM`` with ``|dM| <= gamma_{n+1} |M|`` elementwise (Higham,
    Theorem 10.3), and ``|logdet(M + dM) - logdet(M)| ~ |tr(M^-1 dM)| <= n ||M^-1||_2 ||dM||_2``, so at most
    ``n^2 gamma_{n+1} kappa(M)`` (with ``||dM||_2 <= n gamma_{n+1} ||M||_2``)."""
    n = matrix.shape[-1]
    condition = float(torch.linalg.cond(matrix.double()))
    return n * n * gamma(n + 1, FLOAT64_UNIT) * condition


def inverse_error(matrix: torch.Tensor) -> float:
    """Bound on the relative (2-norm) error of the inverse of a symmetric positive definite float64 ``matrix`` from
    its Cholesky factor: ``c n u kappa(M)``, with ``c = 4`` for the factorisation and the two triangular solves
    (Higham, §14.3)."""
    n = matrix.shape[-1]
    return 4 * n * FLOAT64_UNIT * float(torch.linalg.cond(matrix.double()))


def cost_matrices(low: torch.Tensor, high: torch.Tensor, reg: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, C, J)`` of groups ``low (M, L, K1)``, ``high (M, K2)`` in float64, from the plain loops' moments."""
    r1, r2, cross = (torch.from_numpy(moment) for moment in reference_group_moments(low, high))
    a = r1 + reg * torch.eye(r1.shape[0], dtype=torch.float64)
    c = r2 + reg * torch.eye(r2.shape[0], dtype=torch.float64)
    return a, c, torch.cat([torch.cat([a, cross], dim=1), torch.cat([cross.T, c], dim=1)], dim=0)


def cost_error(low: torch.Tensor, high: torch.Tensor, reg: float) -> float:
    """Bound on the absolute float64 error of ``r = logdet J - logdet A - logdet C`` (:func:`logdet_error` of each),
    plus the float64 moments' own rounding (sums of ``M * L`` terms), carried through ``|dr| <= ||J^-1|| ||dJ||``."""
    a, c, joint = cost_matrices(low, high, reg)
    moments = gamma(low.shape[0] * low.shape[1], FLOAT64_UNIT) * sum(
        float(torch.linalg.cond(m)) * m.shape[0] for m in (a, c, joint)
    )
    return logdet_error(joint) + logdet_error(a) + logdet_error(c) + moments


def spectrum_error(low: torch.Tensor, high: torch.Tensor, reg: float, sigma: torch.Tensor) -> float:
    """Bound on the absolute error of ``sum_k log(1 - sigma_k)`` from eigenvalues taken after whitening by
    ``A^-1/2`` and ``C^-1/2`` (Alg. 4): each ``sigma_k`` carries a relative error of at most
    ``4 n u (kappa(A) + kappa(C))`` (the inverse square roots and the SVD, first order), and
    ``|d log(1 - sigma)| = |d sigma| / (1 - sigma)``."""
    a, c, _ = cost_matrices(low, high, reg)
    n = a.shape[0] + c.shape[0]
    relative = 4 * n * FLOAT64_UNIT * (float(torch.linalg.cond(a)) + float(torch.linalg.cond(c)))
    return float((relative * sigma / (1 - sigma)).sum())


def gradient_error(low: torch.Tensor, high: torch.Tensor, reg: float) -> float:
    """Bound on the absolute float64 error of each entry of ``dr/dlow`` and ``dr/dhigh``: the gradient w.r.t. the
    moments is a sum of inverses (``(J^-1)_11 - A^-1``, ``2 (J^-1)_12``, ``(J^-1)_22 - C^-1``), each with relative
    error :func:`inverse_error` times its norm ``1 / lambda_min``; the chain rule to a feature multiplies by at most
    ``2 max |feature| / M`` (each group's moments are means over its ``M`` groups)."""
    a, c, joint = cost_matrices(low, high, reg)
    moments = sum(inverse_error(m) / float(torch.linalg.eigvalsh(m)[0]) for m in (a, c, joint))
    largest = max(float(low.abs().max()), float(high.abs().max()))
    return 4 * moments * largest / low.shape[0]


def eigenvalue_error(stats: CorrelationStatistics, reg: float) -> float:
    """Relative error bound of the whitened cross-correlation ``W = A^-1/2 P C^-1/2`` in one float64 computation:
    ``e = 4 n u (kappa(A) + kappa(C))``. Its singular values then move by at most ``e ||W|| <= e`` (Weyl; ``||W|| < 1``)
    and the eigenvalues ``sigma = s^2`` by at most ``3 e``."""
    a, c, _ = (m.double() for m in stats.means())
    a = a + reg * torch.eye(a.shape[0], dtype=torch.float64)
    c = c + reg * torch.eye(c.shape[0], dtype=torch.float64)
    n = a.shape[0] + c.shape[0]
    return 4 * n * FLOAT64_UNIT * (float(torch.linalg.cond(a)) + float(torch.linalg.cond(c)))


# --- Statistical tolerances: tests that compare distributions draw with fixed seeds, so they are deterministic; the
# tolerances say how far a correct sampler may stray by chance, so that a change of random stream never fails them.
def ks_critical(n: int, m: int, alpha: float = 1e-4) -> float:
    """Two-sample Kolmogorov-Smirnov statistic exceeded with probability ``alpha`` by samples of sizes ``n`` and ``m``
    of one distribution (asymptotic: ``sqrt(-ln(alpha / 2) / 2) sqrt((n + m) / (n m))``)."""
    import math

    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def proportion_tolerance(p: float, n: int, sigmas: float = 5.0) -> float:
    """How far the fraction of ``n`` independent draws with probability ``p`` strays from ``p``: ``sigmas`` standard
    deviations, ``sigmas * sqrt(p (1 - p) / n)``."""
    return sigmas * (p * (1 - p) / n) ** 0.5
