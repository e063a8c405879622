"""Label-free health of a representation: effective rank, alpha-ReQ and LiDAR beside RankMe
(:mod:`hfmca_lightning.analysis.rankme`), from embeddings or from sums of them (:class:`HealthStatistics`).

* **Effective rank** (Roy and Vetterli, *The effective rank: a measure of effective dimensionality*, EUSIPCO 2007):
  ``exp(H(p))``, ``p_k = lambda_k / sum(lambda)``, ``lambda`` the eigenvalues of the embeddings' covariance; ``k``
  equal variances give ``k``.
* **alpha-ReQ** (Agrawal et al., *alpha-ReQ: Assessing representation quality in self-supervised learning by
  measuring eigenspectrum decay*, NeurIPS 2022): ``alpha`` of the power law ``lambda_i ~ i^-alpha`` fitted by least
  squares to ``log lambda_i`` against ``log i`` over the eigenvalues above ``1e-12`` of the largest and above the
  float64 round-off of the uncentred second moment (:func:`round_off_floor`); near 1 is healthy, large is
  collapsing onto few directions, small is noise-like.
* **LiDAR** (Thilak et al., *LiDAR: Sensing linear probing performance in joint embedding SSL architectures*, ICLR
  2024): the RankMe-style entropy rank of ``Sigma_w^-1/2 Sigma_b Sigma_w^-1/2``, the linear-discriminant matrix whose
  classes are the samples and whose members are their views: ``Sigma_b`` the covariance of the samples' mean
  embeddings, ``Sigma_w`` the mean covariance of the views around them plus ``delta I``.

Every estimate is float64. The rank an estimate can show is at most the number of samples it saw: the health
callback waits for ``2 * D`` samples of ``D``-dimensional embeddings (docs/conventions.md §9).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["HealthStatistics", "alpha_req", "effective_rank", "entropy_rank", "lidar"]

EPSILON = 1e-7  # RankMe's and LiDAR's epsilon, added to every normalised eigenvalue
LIDAR_DELTA = 1e-4  # LiDAR's ridge on the within-sample covariance
RELATIVE_FLOOR = 1e-12  # alpha-ReQ fits the eigenvalues above this fraction of the largest (and the round-off floor)


def entropy_rank(values: Tensor, epsilon: float = 0.0) -> Tensor:
    """``exp(-sum_k p_k log p_k)``, ``p_k = v_k / sum(v) + epsilon`` of non-negative ``values`` (float64): between 1
    (one value) and their number (all equal)."""
    values = values.to(torch.float64).clamp_min(0)
    p = values / values.sum().clamp_min(torch.finfo(torch.float64).tiny) + epsilon
    terms = torch.where(p > 0, p * torch.log(p), torch.zeros_like(p))
    return torch.exp(-terms.sum())


def _check(features: Tensor, name: str) -> Tensor:
    if features.dim() != 2 or features.shape[0] < 2 or features.shape[1] < 1:
        raise ValueError(f"{name} needs (N, D) embeddings with N >= 2; got shape {tuple(features.shape)}")
    return features.detach().to(torch.float64)


def _covariance_spectrum(features: Tensor) -> Tensor:
    centred = features - features.mean(dim=0)
    return torch.linalg.eigvalsh(centred.T @ centred / features.shape[0]).flip(0).clamp_min(0)


def effective_rank(features: Tensor) -> Tensor:
    """Roy and Vetterli's effective rank of the covariance of ``features (N, D)``: a 0-dim float64 tensor in
    ``[1, min(N - 1, D)]``.

    Args:
        features: ``(N, D)`` embeddings.

    Returns:
        The effective rank.

    Raises:
        ValueError: when ``features`` is not ``(N, D)`` with ``N >= 2``.
    """
    return entropy_rank(_covariance_spectrum(_check(features, "effective_rank")))


def round_off_floor(mean_square: Tensor, dimension: int) -> Tensor:
    """``D * eps * mean ||x||^2``: the size of the float64 round-off in the eigenvalues of a covariance taken from sums
    (``gram / n - m m^T``, :class:`HealthStatistics`), where the centring cancels ``||m||^2``. Below it, a covariance
    eigenvalue (a direction without variance, as when rank is lost or ``n <= D``) cannot be told from rounding
    (measured: at most ~4 ``eps mean ||x||^2`` after thousands of merged batches); alpha-ReQ fits none of them, from
    sums or from samples, so both give one value."""
    return dimension * torch.finfo(torch.float64).eps * mean_square


def power_law_exponent(eigenvalues: Tensor, floor: Tensor | float = 0.0) -> Tensor:
    """``alpha`` of ``lambda_i ~ i^-alpha`` fitted to descending ``eigenvalues`` above ``RELATIVE_FLOOR`` of the
    largest and above ``floor`` (:func:`round_off_floor`) (0-dim float64; 0 where fewer than two are)."""
    relative = RELATIVE_FLOOR * eigenvalues[0].clamp_min(torch.finfo(torch.float64).tiny)
    kept = eigenvalues[eigenvalues > torch.clamp(relative, min=floor)]
    if kept.numel() < 2:
        return torch.zeros((), dtype=torch.float64, device=eigenvalues.device)
    x = torch.log(torch.arange(1, kept.numel() + 1, dtype=torch.float64, device=kept.device))
    y = torch.log(kept)
    x_centred = x - x.mean()
    return -(x_centred * (y - y.mean())).sum() / (x_centred * x_centred).sum()


def alpha_req(features: Tensor) -> Tensor:
    """alpha-ReQ: the power-law decay of the covariance eigenvalues of ``features (N, D)`` above ``1e-12`` of the
    largest and above :func:`round_off_floor` (the directions with no variance are not in the fit).

    Args:
        features: ``(N, D)`` embeddings.

    Returns:
        0-dim float64 ``alpha``.

    Raises:
        ValueError: when ``features`` is not ``(N, D)`` with ``N >= 2``.
    """
    x = _check(features, "alpha_req")
    mean_square = (x * x).sum(dim=1).mean()
    return power_law_exponent(_covariance_spectrum(x), round_off_floor(mean_square, x.shape[1]))


def _lidar_from_moments(between: Tensor, within: Tensor, delta: float) -> Tensor:
    """The eigenvalues of ``W^-1/2 B W^-1/2`` (``W = within + delta I``) are those of ``L^-1 B L^-T``, ``W = L L^T``
    (similar matrices): one Cholesky factor and two triangular solves, half the time of an eigendecomposition of
    ``W``, which stays for a ``W`` that rounding left not positive definite."""
    within = within + delta * torch.eye(within.shape[0], dtype=within.dtype, device=within.device)
    factor, info = torch.linalg.cholesky_ex(within)
    if int(info) == 0:
        half = torch.linalg.solve_triangular(factor, between, upper=False)
        discriminant = torch.linalg.solve_triangular(factor, half.mT, upper=False)
    else:
        values, vectors = torch.linalg.eigh(within)
        inverse_root = (vectors * values.clamp_min(torch.finfo(torch.float64).tiny).rsqrt()) @ vectors.T
        discriminant = inverse_root @ between @ inverse_root
    return entropy_rank(torch.linalg.eigvalsh(discriminant), EPSILON)


def lidar(embeddings: Tensor, delta: float = LIDAR_DELTA) -> Tensor:
    """LiDAR of ``embeddings (n, q, d)``: ``n`` samples with ``q`` views each.

    Args:
        embeddings: ``(n, q, d)``, ``n >= 2``, ``q >= 2``.
        delta: the ridge added to the within-sample covariance.

    Returns:
        0-dim float64 LiDAR, between 1 and ``min(n - 1, d)``.

    Raises:
        ValueError: when ``embeddings`` is not ``(n, q, d)`` with ``n, q >= 2``.
    """
    if embeddings.dim() != 3 or embeddings.shape[0] < 2 or embeddings.shape[1] < 2 or embeddings.shape[2] < 1:
        raise ValueError(f"lidar needs (samples, views, D) with >= 2 of each; got shape {tuple(embeddings.shape)}")
    x = embeddings.detach().to(torch.float64)
    means = x.mean(dim=1)
    centred_means = means - means.mean(dim=0)
    between = centred_means.T @ centred_means / x.shape[0]
    spread = (x - means[:, None]).flatten(0, 1)
    within = spread.T @ spread / spread.shape[0]
    return _lidar_from_moments(between, within, delta)


@dataclass
class HealthStatistics:
    """Sums over samples of ``q`` views of ``D``-dimensional embeddings from which every metric of this module
    follows exactly (float64): the first views' sum and Gram matrix (RankMe, effective rank, alpha-ReQ) and the
    views' mean per sample, its Gram matrix and the views' Gram matrix (LiDAR). Sums add, so batches, steps and
    processes merge by adding (:meth:`merge`; DDP: an all-reduce of :meth:`tensors`).

    Args:
        samples: samples summed.
        first_sum: ``(D,)`` sum of the first views.
        first_gram: ``(D, D)`` sum of ``x x^T`` over the first views.
        mean_sum: ``(D,)`` sum of the samples' view means.
        mean_gram: ``(D, D)`` sum of ``m m^T`` over the samples' view means.
        view_gram: ``(D, D)`` sum of ``x x^T`` over every view.
        views: views per sample.
    """

    samples: Tensor
    first_sum: Tensor
    first_gram: Tensor
    mean_sum: Tensor
    mean_gram: Tensor
    view_gram: Tensor
    views: int

    @classmethod
    def of(cls, embeddings: Tensor) -> HealthStatistics:
        """The sums of ``embeddings (n, q, D)``."""
        if embeddings.dim() != 3 or min(embeddings.shape) < 1:
            raise ValueError(
                f"HealthStatistics needs (samples, views, D) embeddings; got shape {tuple(embeddings.shape)}"
            )
        x = embeddings.detach().to(torch.float64)
        first, means, flat = x[:, 0], x.mean(dim=1), x.flatten(0, 1)
        samples = torch.full((), float(x.shape[0]), dtype=torch.float64, device=x.device)  # no host-device copy
        return cls(samples, first.sum(0), first.T @ first, means.sum(0), means.T @ means, flat.T @ flat, x.shape[1])

    def merge(self, other: HealthStatistics) -> HealthStatistics:
        """The sums of both."""
        if other.views != self.views:
            raise ValueError(f"cannot merge statistics of {self.views} and {other.views} views per sample")
        if other.first_sum.shape != self.first_sum.shape:
            raise ValueError(
                f"cannot merge statistics of {self.first_sum.shape[0]} and {other.first_sum.shape[0]} dimensions"
            )
        return HealthStatistics.from_tensors(
            [mine + theirs for mine, theirs in zip(self.tensors(), other.tensors())], self.views
        )

    @classmethod
    def from_tensors(cls, tensors: list[Tensor], views: int) -> HealthStatistics:
        """The statistics of :meth:`tensors` (after an all-reduce, or from a checkpoint)."""
        samples, first_sum, first_gram, mean_sum, mean_gram, view_gram = tensors
        return cls(samples, first_sum, first_gram, mean_sum, mean_gram, view_gram, views)

    def tensors(self) -> list[Tensor]:
        """The sums, in field order (what DDP all-reduces)."""
        return [getattr(self, f.name) for f in fields(self)[:-1]]

    def metrics(self) -> dict[str, float]:
        """``rankme``, ``effective_rank``, ``alpha_req`` and (with two or more views) ``lidar`` of the summed
        samples, as the functions of this module give them on those samples."""
        n = self.samples
        gram = self.first_gram
        # the singular values of the (n, D) samples: as many as min(n, D), the Gram's other eigenvalues are zeros
        singular = torch.linalg.eigvalsh(gram).flip(0).clamp_min(0).sqrt()[: min(int(n), gram.shape[0])]
        metrics = {"rankme": float(entropy_rank(singular, EPSILON))}
        mean = self.first_sum / n
        covariance = gram / n - torch.outer(mean, mean)
        spectrum = torch.linalg.eigvalsh(covariance).flip(0).clamp_min(0)
        metrics["effective_rank"] = float(entropy_rank(spectrum))
        floor = round_off_floor(torch.trace(gram) / n, gram.shape[0])
        metrics["alpha_req"] = float(power_law_exponent(spectrum, floor))
        if self.views >= 2:
            centre = self.mean_sum / n
            between = self.mean_gram / n - torch.outer(centre, centre)
            within = (self.view_gram - self.views * self.mean_gram) / (n * self.views)
            metrics["lidar"] = float(_lidar_from_moments(between, within, LIDAR_DELTA))
        return metrics
