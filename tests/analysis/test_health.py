"""The label-free health metrics (effective rank, alpha-ReQ, LiDAR; RankMe beside them) against plain numpy
references and constructions whose answer is known, and HealthStatistics' sums against the metrics taken on the
samples themselves."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from hfmca_lightning.analysis import rankme
from hfmca_lightning.analysis.health import (
    EPSILON,
    LIDAR_DELTA,
    HealthStatistics,
    alpha_req,
    effective_rank,
    entropy_rank,
    lidar,
)
from tests.helpers import FLOAT64_UNIT, gamma

U = FLOAT64_UNIT


# --- plain references (numpy, float64, loops where the definition sums) ----------------------------------------------


def reference_entropy_rank(values: np.ndarray, epsilon: float = 0.0) -> float:
    """``exp(-sum p_k log p_k)``, ``p_k = v_k / sum(v) + epsilon`` (``0 log 0 = 0``)."""
    p = values / values.sum() + epsilon
    total = 0.0
    for pk in p:
        if pk > 0:
            total -= pk * np.log(pk)
    return float(np.exp(total))


def reference_covariance(x: np.ndarray) -> np.ndarray:
    """The (biased, ``1 / N``) covariance of rows ``x (N, D)``, summed over the rows one by one."""
    mean = x.sum(axis=0) / len(x)
    covariance = np.zeros((x.shape[1], x.shape[1]))
    for row in x:
        covariance += np.outer(row - mean, row - mean)
    return covariance / len(x)


def reference_spectrum(x: np.ndarray) -> np.ndarray:
    return np.clip(np.linalg.eigvalsh(reference_covariance(x))[::-1], 0, None)


def reference_lidar(embeddings: np.ndarray, delta: float = LIDAR_DELTA, epsilon: float = EPSILON) -> float:
    """Thilak et al.'s LiDAR of ``embeddings (n, q, d)``: the samples are the classes, their views the members.
    ``Sigma_b``: the covariance of the per-sample means; ``Sigma_w``: the mean of the samples' within-sample
    covariances, plus ``delta I``; the entropy rank (``p = lambda / sum + epsilon``) of
    ``Sigma_w^-1/2 Sigma_b Sigma_w^-1/2``, the inverse square root by eigendecomposition."""
    n, q, d = embeddings.shape
    means = [embeddings[i].sum(axis=0) / q for i in range(n)]
    centre = sum(means) / n
    between = np.zeros((d, d))
    within = np.zeros((d, d))
    for i in range(n):
        between += np.outer(means[i] - centre, means[i] - centre) / n
        sample = np.zeros((d, d))
        for j in range(q):
            sample += np.outer(embeddings[i, j] - means[i], embeddings[i, j] - means[i]) / q
        within += sample / n
    within += delta * np.eye(d)
    values, vectors = np.linalg.eigh(within)
    inverse_root = vectors @ np.diag(values**-0.5) @ vectors.T
    spectrum = np.clip(np.linalg.eigvalsh(inverse_root @ between @ inverse_root), 0, None)
    return reference_entropy_rank(spectrum, epsilon)


def reference_alpha(x: np.ndarray, floor: float = 1e-12) -> float:
    """alpha-ReQ: minus the least-squares slope of ``log lambda_i`` on ``log i`` over the covariance eigenvalues above
    ``floor`` times the largest (numpy's polyfit)."""
    spectrum = reference_spectrum(x)
    kept = spectrum[spectrum > floor * spectrum[0]]
    return float(-np.polyfit(np.log(np.arange(1, len(kept) + 1)), np.log(kept), 1)[0])


# --- constructions ----------------------------------------------------------------------------------------------------


def with_spectrum(eigenvalues: torch.Tensor, samples: int, seed: int = 0) -> torch.Tensor:
    """``(samples, D)`` float64 features whose (1 / N) covariance has exactly ``eigenvalues`` (to rounding):
    orthonormal centred columns scaled by ``sqrt(samples)``, times ``sqrt(eigenvalues)``, times a random rotation."""
    generator = torch.Generator().manual_seed(seed)
    d = eigenvalues.shape[0]
    columns = torch.randn(samples, d, generator=generator, dtype=torch.float64)
    columns = torch.linalg.qr(columns - columns.mean(dim=0)).Q * samples**0.5
    rotation = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64)).Q
    return columns * eigenvalues.sqrt() @ rotation


def orthonormal_centred(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """``(rows, columns)`` with centred orthonormal columns, times ``sqrt(rows)``: rows whose (1 / rows) covariance
    is exactly the identity."""
    q = torch.randn(rows, columns, generator=generator, dtype=torch.float64)
    return torch.linalg.qr(q - q.mean(dim=0)).Q * rows**0.5


# --- error bounds (float64; first order, doubled) ---------------------------------------------------------------------


def entropy_rank_error(values: np.ndarray, errors: np.ndarray, epsilon: float = 0.0) -> float:
    """Bound on the relative error of ``exp(H(p))``, ``p_k = v_k / sum(v) + epsilon``, when each ``v_k`` moves by at
    most ``errors_k``: ``|d(v_k / s)| <= (e_k + (v_k / s) sum(e)) / s`` and ``|d(p log p)| <= |dp| (|log p| + 1)``
    (``p`` kept away from 0 by ``|dp|``); ``d exp(H) = exp(H) dH``."""
    s = values.sum()
    dp = (errors + values / s * errors.sum()) / s
    p = values / s + epsilon
    return 2 * float((dp * (np.abs(np.log(np.maximum(p - dp, dp))) + 1)).sum())


def eigenvalue_error(matrix: np.ndarray, entry_errors: np.ndarray) -> float:
    """Bound on how far each eigenvalue of a symmetric ``matrix`` computed two ways moves: Weyl's
    ``||E||_2 <= ||E||_F`` of the entries' errors, plus a backward-stable eigensolver's ``4 D u ||M||_2`` on either
    side."""
    d = matrix.shape[0]
    return float(np.linalg.norm(entry_errors) + 8 * d * U * np.linalg.norm(matrix, 2))


def moment_error(x: np.ndarray) -> np.ndarray:
    """Entrywise bound on the difference of the covariance of rows ``x (N, D)`` taken as ``gram / N - m m^T`` and as
    ``c^T c / N`` of centred rows: ``gamma_{N+3}`` of the terms' magnitudes ``|x|^T |x| / N + |m| |m|^T`` on either
    side (centred rows are at most ``|x| + |m|``)."""
    n = x.shape[0]
    mean = np.abs(x.mean(axis=0))
    return 3 * gamma(n + 3, U) * (np.abs(x).T @ np.abs(x) / n + np.outer(mean, mean))


def alpha_error(spectrum: np.ndarray, error: float) -> float:
    """Bound on the error of the least-squares slope when each kept ``log lambda_i`` moves by ``error / lambda_i``:
    ``sum |x_i - mean x| / sum (x_i - mean x)^2`` times the largest move."""
    x = np.log(np.arange(1, len(spectrum) + 1))
    centred = x - x.mean()
    return 2 * float(np.abs(centred).sum() / (centred**2).sum() * (error / spectrum).max())


# --- effective rank and the entropy rank ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 8])
def test_k_equal_variances_give_effective_rank_k(k):
    """Rank-``k`` features with ``k`` equal variances in 8 dimensions: ``p = 1 / k`` on ``k`` eigenvalues, the
    other ``8 - k`` at rounding level (``~ 1e-16``: ``p log p ~ 1e-14``)."""
    eigenvalues = torch.cat([torch.ones(k), torch.zeros(8 - k)]).double()
    features = with_spectrum(eigenvalues, samples=50)
    assert float(effective_rank(features)) == pytest.approx(k, abs=1e-9)
    assert float(effective_rank(features.float())) == pytest.approx(k, abs=1e-5)  # float32 input, float64 maths


def test_effective_rank_of_a_known_spectrum_is_its_entropy_rank():
    spectrum = torch.tensor([5.0, 3.0, 1.0, 0.5, 0.2, 0.05], dtype=torch.float64)
    expected = reference_entropy_rank(spectrum.numpy())
    # the construction's covariance holds the spectrum to ~ D gamma_N ||C|| (1e-13 of 5) against the smallest 0.05
    features = with_spectrum(spectrum, samples=80)
    error = eigenvalue_error(np.diag(spectrum.numpy()), np.full((6, 6), 2 * gamma(80, U) * 5.0))
    tolerance = entropy_rank_error(spectrum.numpy(), np.full(6, error))
    assert tolerance < 1e-11
    assert float(effective_rank(features)) == pytest.approx(expected, rel=tolerance)
    # the entropy rank itself: zeros count as 0 log 0 = 0, epsilon is added to every p
    with_zero = torch.cat([spectrum, torch.zeros(2, dtype=torch.float64)])
    assert float(entropy_rank(with_zero)) == pytest.approx(expected, rel=1e-14)
    assert float(entropy_rank(with_zero, 1e-7)) == pytest.approx(
        reference_entropy_rank(with_zero.numpy(), 1e-7), rel=1e-14
    )
    assert float(entropy_rank(torch.ones(7))) == pytest.approx(7, rel=1e-14)


def test_effective_rank_equals_the_numpy_reference_on_random_features():
    generator = torch.Generator().manual_seed(1)
    x = (
        torch.randn(120, 7, generator=generator, dtype=torch.float64)
        @ torch.diag(torch.linspace(2.0, 0.2, 7, dtype=torch.float64))
        + 3.0
    )
    spectrum = reference_spectrum(x.numpy())
    error = eigenvalue_error(reference_covariance(x.numpy()), moment_error(x.numpy()))
    tolerance = entropy_rank_error(spectrum, np.full(7, error))
    assert tolerance < 1e-10
    assert float(effective_rank(x)) == pytest.approx(reference_entropy_rank(spectrum), rel=tolerance)


# --- alpha-ReQ --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, 3.5])
def test_alpha_req_of_a_power_law_spectrum_is_its_exponent(alpha):
    """Covariance eigenvalues exactly ``i^-alpha``, ``i = 1..16`` (down to ``16^-3.5 = 6e-5``): the construction's
    rounding moves each by ``~ D u`` of the largest (``2e-15``), ``log lambda_i`` by at most ``3e-11``, and the fitted
    slope by less."""
    eigenvalues = torch.arange(1, 17, dtype=torch.float64) ** -alpha
    features = with_spectrum(eigenvalues, samples=64, seed=int(alpha * 10))
    assert float(alpha_req(features)) == pytest.approx(alpha, abs=1e-9)


def test_alpha_req_fits_only_the_eigenvalues_above_the_floor():
    """Rank 5 in 12 dimensions: the 7 zero eigenvalues (rounding level, far below 1e-12 of the largest) are left out
    of the fit; one direction leaves fewer than two eigenvalues: 0."""
    eigenvalues = torch.cat([torch.arange(1, 6, dtype=torch.float64) ** -1.5, torch.zeros(7, dtype=torch.float64)])
    assert float(alpha_req(with_spectrum(eigenvalues, samples=40))) == pytest.approx(1.5, abs=1e-9)
    line = torch.cat([torch.ones(1), torch.zeros(5)]).double()
    assert float(alpha_req(with_spectrum(line, samples=40))) == 0.0


def test_alpha_req_equals_numpy_polyfit_on_a_noisy_spectrum():
    generator = torch.Generator().manual_seed(2)
    scales = torch.arange(1, 11, dtype=torch.float64) ** -0.6 * (1 + 0.3 * torch.rand(10, generator=generator))
    x = torch.randn(200, 10, generator=generator, dtype=torch.float64) * scales - 1.0
    spectrum = reference_spectrum(x.numpy())
    error = eigenvalue_error(reference_covariance(x.numpy()), moment_error(x.numpy()))
    tolerance = alpha_error(spectrum, error)
    assert tolerance < 1e-10
    assert float(alpha_req(x)) == pytest.approx(reference_alpha(x.numpy()), abs=tolerance)


@pytest.mark.parametrize(("samples", "rank", "offset"), [(512, 40, 1.0), (512, 12, 4.0), (200, 256, 1.0)])
def test_alpha_req_from_sums_fits_the_directions_with_variance_as_from_samples(samples, rank, offset):
    """Embeddings far from the origin (``||m||^2 ~ 340 offset^2`` against a largest variance of ``1e-3``) that lost
    rank (``rank`` of 256 directions, or ``samples - 1 < 256``): the covariance from the sums (``gram / n - m m^T``)
    has round-off eigenvalues of ``~ eps ||m||^2`` (``1e-14``, above ``1e-12`` of the largest) in the directions
    without variance. alpha-ReQ leaves them out from the sums as from the samples: both fit the power law the
    directions with variance hold (exactly ``i^-1`` where ``rank < samples``)."""
    d = 256
    generator = torch.Generator().manual_seed(rank)
    centre = offset * 2 * torch.rand(d, generator=generator, dtype=torch.float64)
    if rank < samples:
        eigenvalues = 1e-3 * torch.arange(1, d + 1, dtype=torch.float64) ** -1.0
        eigenvalues[rank:] = 0
        x = with_spectrum(eigenvalues, samples=samples, seed=rank) + centre
        expected = 1.0
    else:
        scales = 0.03 * torch.linspace(1, 0.05, d, dtype=torch.float64)
        x = torch.randn(samples, d, generator=generator, dtype=torch.float64) * scales + centre
        expected = reference_alpha(x.numpy(), floor=1e-9)  # the samples - 1 eigenvalues with variance
    sums = HealthStatistics.of(x[:64, None])
    for batch in x[64:].split(64):  # merged batch by batch, as the callback and `hfmca analyze` add them
        sums = sums.merge(HealthStatistics.of(batch[:, None]))
    assert float(alpha_req(x)) == pytest.approx(expected, abs=1e-6)
    assert sums.metrics()["alpha_req"] == pytest.approx(expected, abs=1e-6)


# --- LiDAR ------------------------------------------------------------------------------------------------------------


def test_lidar_equals_the_reference_of_thilak_et_al():
    generator = torch.Generator().manual_seed(3)
    means = torch.randn(30, 1, 5, generator=generator, dtype=torch.float64) @ torch.diag(
        torch.tensor([2.0, 1.0, 0.5, 0.3, 0.1], dtype=torch.float64)
    )
    embeddings = means + 0.4 * torch.randn(30, 4, 5, generator=generator, dtype=torch.float64) + 0.5
    got = float(lidar(embeddings))
    assert 1 < got < 5
    assert got == pytest.approx(reference_lidar(embeddings.numpy()), rel=1e-8)
    assert float(lidar(embeddings, delta=0.5)) == pytest.approx(reference_lidar(embeddings.numpy(), 0.5), rel=1e-8)
    assert float(lidar(embeddings.float())) == pytest.approx(got, rel=1e-5)  # float32 in, float64 maths


def test_lidar_of_a_within_covariance_left_not_positive_definite_is_finite():
    """The Cholesky factor needs ``Sigma_w + delta I`` positive definite; where rounding left it not (an eigenvalue
    below ``-delta``), the eigendecomposition path clamps it: the discriminant is dominated by that direction."""
    from hfmca_lightning.analysis.health import _lidar_from_moments

    within = torch.diag(torch.tensor([1.0, 0.5, -1.0], dtype=torch.float64))
    value = float(_lidar_from_moments(torch.eye(3, dtype=torch.float64), within, LIDAR_DELTA))
    assert value == pytest.approx(1.0, abs=1e-5)


def separated_views(samples: int, views: int, d: int, k: int, spread: float, seed: int = 0) -> torch.Tensor:
    """``(samples, views, d)``: sample means with covariance exactly the identity on ``k`` random orthonormal
    directions, each sample's views around its mean with covariance exactly ``spread^2`` on those directions (the
    same centred orthonormal offsets for every sample); nothing in the other ``d - k``."""
    generator = torch.Generator().manual_seed(seed)
    means = orthonormal_centred(samples, k, generator)
    offsets = spread * orthonormal_centred(views, k, generator)
    basis = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64)).Q[:k]
    return (means[:, None, :] + offsets[None]) @ basis


def test_lidar_of_well_separated_samples_is_their_dimension():
    """Between-sample covariance ``I``, within ``0.1^2 I``: ``Sigma_w^-1/2 Sigma_b Sigma_w^-1/2`` is ``I / (0.01 +
    delta)``, all ``d`` eigenvalues equal: LiDAR ``d`` (epsilon moves it by ``~ d eps``)."""
    embeddings = separated_views(samples=40, views=7, d=6, k=6, spread=0.1)
    assert float(lidar(embeddings)) == pytest.approx(6, abs=1e-5)
    assert float(HealthStatistics.of(embeddings).metrics()["lidar"]) == pytest.approx(6, abs=1e-5)


@pytest.mark.parametrize("k", [1, 3])
def test_lidar_of_embeddings_on_a_k_dimensional_subspace_is_k(k):
    """Means and views on a ``k``-dimensional subspace of 6 dimensions: ``k`` equal eigenvalues, ``6 - k`` zero ones
    (which epsilon turns into ``-eps log eps ~ 1.6e-6`` each)."""
    embeddings = separated_views(samples=40, views=7, d=6, k=k, spread=0.1)
    assert float(lidar(embeddings)) == pytest.approx(k, abs=1e-4)
    assert float(reference_lidar(embeddings.numpy())) == pytest.approx(k, abs=1e-4)


def test_rankme_is_unchanged():
    """The health module's RankMe (from the sums) is the RankMe of the first views, and RankMe keeps Garrido et
    al.'s definition and epsilon."""
    rankme_module = importlib.import_module("hfmca_lightning.analysis.rankme")
    assert rankme_module.rankme is rankme
    assert rankme_module.EPSILON == EPSILON == 1e-7
    generator = torch.Generator().manual_seed(4)
    features = torch.randn(50, 6, generator=generator, dtype=torch.float64) * torch.linspace(1, 0.1, 6)
    singular = np.linalg.svd(features.numpy(), compute_uv=False)
    p = singular / singular.sum() + 1e-7
    assert float(rankme(features)) == pytest.approx(float(np.exp(-(p * np.log(p)).sum())), rel=1e-12)


# --- HealthStatistics -------------------------------------------------------------------------------------------------


def random_views(samples: int = 64, views: int = 3, d: int = 6, seed: int = 5) -> torch.Tensor:
    """Views around their samples' means, anisotropic, off the origin (so that centring cancels)."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.5, 0.3], dtype=torch.float64)[:d]
    means = torch.randn(samples, 1, d, generator=generator, dtype=torch.float64) * scales + 1.5
    return means + 0.5 * torch.randn(samples, views, d, generator=generator, dtype=torch.float64) * scales.flip(0)


def test_the_sums_give_the_metrics_of_the_samples():
    """``HealthStatistics.of(x).metrics()``: RankMe, effective rank and alpha-ReQ of the first views and LiDAR of all
    views, as the functions give them on the samples, to the float64 error of taking each moment from sums instead
    of from centred samples."""
    x = random_views()
    metrics = HealthStatistics.of(x).metrics()
    assert set(metrics) == {"rankme", "effective_rank", "alpha_req", "lidar"}
    first = x[:, 0].numpy()
    n, q, d = x.shape

    # RankMe: singular values of the first views (SVD) against square roots of their Gram matrix's eigenvalues:
    # each lambda moves by the Gram's gamma_n |x|^T|x| (and the eigensolvers'), sigma by that over 2 sigma, and the
    # SVD's own 4 max(n, d) u ||x||_2
    singular = np.linalg.svd(first, compute_uv=False)
    gram_error = eigenvalue_error(first.T @ first, gamma(n, U) * np.abs(first).T @ np.abs(first))
    sigma_error = gram_error / singular + 4 * max(n, d) * U * singular[0]
    tolerance = entropy_rank_error(singular, sigma_error, EPSILON)
    assert tolerance < 1e-10
    assert metrics["rankme"] == pytest.approx(float(rankme(x[:, 0])), rel=tolerance)

    spectrum = reference_spectrum(first)
    error = eigenvalue_error(reference_covariance(first), moment_error(first))
    tolerance = entropy_rank_error(spectrum, np.full(d, error))
    assert tolerance < 1e-10
    assert metrics["effective_rank"] == pytest.approx(float(effective_rank(x[:, 0])), rel=tolerance)
    tolerance = alpha_error(spectrum, error)
    assert tolerance < 1e-10
    assert metrics["alpha_req"] == pytest.approx(float(alpha_req(x[:, 0])), abs=tolerance)

    # LiDAR: Sigma_b from the means' sums (as a covariance above); Sigma_w as (views' Gram - q means' Gram) / (n q)
    # against the centred views: gamma_{nq+3} of (|X|^T|X| + q |M|^T|M|) / (n q) on either side. The generalised
    # eigenvalues mu of (Sigma_b, Sigma_w + delta I) move by (||dB|| + mu ||dW||) / lambda_min(Sigma_w + delta I),
    # and by the inverse square root's 8 d u kappa(Sigma_w + delta I) of the largest.
    means = x.mean(dim=1).numpy()
    flat = x.flatten(0, 1).numpy()
    within = np.zeros((d, d))  # the within-sample covariance, by loops
    for i in range(n):
        within += reference_covariance(x[i].numpy()) / n
    within += LIDAR_DELTA * np.eye(d)
    values, vectors = np.linalg.eigh(within)
    root = vectors @ np.diag(values**-0.5) @ vectors.T
    between = reference_covariance(means)
    mu = np.clip(np.linalg.eigvalsh(root @ between @ root), 0, None)
    within_terms = (np.abs(flat).T @ np.abs(flat) + q * np.abs(means).T @ np.abs(means)) / (n * q)
    within_error = np.linalg.norm(4 * gamma(n * q + 3, U) * within_terms)
    between_error = np.linalg.norm(moment_error(means))
    kappa = values.max() / values.min()
    mu_error = (between_error + mu * within_error) / values.min() + 8 * d * U * kappa * mu.max()
    tolerance = entropy_rank_error(mu, mu_error, EPSILON)
    assert tolerance < 1e-8  # the within-sample Gram's cancellation: its terms are ~500 times its smallest eigenvalue
    assert metrics["lidar"] == pytest.approx(float(lidar(x)), rel=tolerance)


def test_one_view_per_sample_has_no_lidar():
    metrics = HealthStatistics.of(random_views(views=1)).metrics()
    assert set(metrics) == {"rankme", "effective_rank", "alpha_req"}


def test_merged_sums_of_two_halves_are_the_sums_of_the_whole():
    """Sums of 64 samples in one go, or of 29 and 35 merged: the same sums in two orders, which differ by at most
    ``2 gamma_n`` of the sum of the terms' magnitudes (Higham §3.1)."""
    x = random_views()
    whole = HealthStatistics.of(x)
    merged = HealthStatistics.of(x[:29]).merge(HealthStatistics.of(x[29:]))
    assert merged.views == whole.views == 3
    assert float(merged.samples) == float(whole.samples) == 64
    first, means, flat = x[:, 0].abs(), x.mean(dim=1).abs(), x.flatten(0, 1).abs()
    bounds = {
        "first_sum": 2 * gamma(64, U) * first.sum(0),
        "first_gram": 2 * gamma(64, U) * first.T @ first,
        "mean_sum": 2 * gamma(64 + 3, U) * means.sum(0),
        "mean_gram": 2 * gamma(64 + 3, U) * means.T @ means,
        "view_gram": 2 * gamma(3 * 64, U) * flat.T @ flat,
    }
    for name, bound in bounds.items():
        difference = (getattr(merged, name) - getattr(whole, name)).abs()
        assert bool((difference <= bound).all()), name
    assert [tensor.shape for tensor in merged.tensors()] == [tensor.shape for tensor in whole.tensors()]
    # every sum is summed: a merge that dropped or doubled one would be off by a whole half
    twice = HealthStatistics.of(x[:29]).merge(HealthStatistics.of(x[:29]))
    assert float(twice.samples) == 58
    torch.testing.assert_close(twice.view_gram, 2 * HealthStatistics.of(x[:29]).view_gram, rtol=1e-15, atol=0)


def one_line_value_error(call) -> str:
    with pytest.raises(ValueError) as caught:
        call()
    message = str(caught.value)
    assert message and "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: effective_rank(torch.randn(1, 4)), "effective_rank needs (N, D)"),
        (lambda: effective_rank(torch.randn(3, 4, 5)), "effective_rank needs (N, D)"),
        (lambda: effective_rank(torch.randn(8, 0)), "effective_rank needs (N, D)"),
        (lambda: alpha_req(torch.randn(8)), "alpha_req needs (N, D)"),
        (lambda: lidar(torch.randn(8, 4)), "lidar needs (samples, views, D)"),
        (lambda: lidar(torch.randn(8, 1, 4)), "lidar needs (samples, views, D)"),
        (lambda: lidar(torch.randn(1, 2, 4)), "lidar needs (samples, views, D)"),
        (lambda: lidar(torch.randn(8, 2, 0)), "lidar needs (samples, views, D)"),
        (lambda: HealthStatistics.of(torch.randn(8, 4)), "(8, 4)"),
        (lambda: HealthStatistics.of(torch.randn(8, 2, 0)), "(8, 2, 0)"),
        (lambda: HealthStatistics.of(torch.randn(2, 3, 4, 5)), "(2, 3, 4, 5)"),
        (
            lambda: HealthStatistics.of(torch.randn(4, 2, 3)).merge(HealthStatistics.of(torch.randn(4, 3, 3))),
            "2 and 3 views",
        ),
        (
            lambda: HealthStatistics.of(torch.randn(4, 2, 3)).merge(HealthStatistics.of(torch.randn(4, 2, 5))),
            "3 and 5",
        ),
    ],
    ids=[
        *("one-sample", "3d", "no-dimension", "vector"),
        *("lidar-2d", "lidar-one-view", "lidar-one-sample", "lidar-no-dimension"),
        *("sums-2d", "sums-no-dimension", "sums-4d", "merge-views", "merge-dimensions"),
    ],
)
def test_bad_shapes_are_refused_in_one_line(call, words):
    assert words in one_line_value_error(call)


def test_rankme_from_the_sums_of_fewer_samples_than_dimensions():
    """Fewer samples than dimensions (``hfmca analyze --num_batches 1`` on a wide backbone): RankMe from the sums takes
    the ``min(n, D)`` singular values an ``(n, D)`` matrix has, not the Gram's zero eigenvalues as well (each of
    which added ``eps``, or the square root of its rounding, to the entropy: 11.587 against 11.578 at 32 x 512)."""
    x = torch.randn(4, 2, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 1.0
    metrics = HealthStatistics.of(x).metrics()
    # 4 singular values from an SVD and from a Gram matrix's eigenvalues: float64 rounding of 12-term sums
    assert metrics["rankme"] == pytest.approx(float(rankme(x[:, 0])), rel=1e-9)
