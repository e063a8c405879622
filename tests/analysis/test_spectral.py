import numpy as np
import pytest
import torch

from hfmca_lightning.analysis import decompose, eigenspectrum, inverse_sqrt
from hfmca_lightning.losses import WindowGeometry, cost_from_statistics, feature_map_statistics, group_statistics
from tests.helpers import FLOAT64_UNIT, logdet_error, reference_group_moments


def _inputs(seed: int = 0, groups: int = 200, members: int = 4, k1: int = 6, k2: int = 5):
    generator = torch.Generator().manual_seed(seed)
    low = torch.rand(groups, members, k1, generator=generator, dtype=torch.float64)
    high = torch.rand(groups, k2, generator=generator, dtype=torch.float64) + low.mean(1)[:, :k2]
    return low, high


def test_eigenvalues_match_a_generalised_eigenproblem_reference():
    low, high = _inputs()
    reg = 0.05
    r1, r2, cross = reference_group_moments(low, high)
    a = r1 + reg * np.eye(r1.shape[0])
    c = r2 + reg * np.eye(r2.shape[0])
    # sigma are the eigenvalues of C^-1 P^T A^-1 P (the squared canonical correlations).
    expected = np.sort(np.linalg.eigvals(np.linalg.solve(c, cross.T @ np.linalg.solve(a, cross))).real)[::-1]
    # two float64 solvers: each moves sigma by at most 3 e (e = 4 n u (kappa(A) + kappa(C)); see spectrum_error)
    kappa = np.linalg.cond(a) + np.linalg.cond(c)
    tolerance = 2 * 3 * 4 * (a.shape[0] + c.shape[0]) * FLOAT64_UNIT * kappa
    np.testing.assert_allclose(eigenspectrum(low, high, reg=reg).numpy(), expected, rtol=0, atol=tolerance)


def test_inverse_sqrt():
    matrix = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    root = inverse_sqrt(matrix)
    torch.testing.assert_close(root @ matrix @ root, torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(root, root.T)


def test_basis_functions_are_orthonormal_and_aligned():
    low, high = _inputs(seed=1, groups=500)
    decomposition = decompose(group_statistics(low, high), reg=1e-9)
    phi = decomposition.low_basis(low)  # (M, L, r)
    psi = decomposition.high_basis(high)  # (M, r)
    members = phi.reshape(-1, phi.shape[-1])
    identity = torch.eye(phi.shape[-1], dtype=torch.float64)
    # whitening with reg = 1e-9: the whitened moments equal the identity up to reg times ||A^-1|| (the regulariser's
    # own share) plus the inverse square root's rounding, 4 n u kappa(A)
    a, c, _ = (m.double() for m in group_statistics(low, high).means())
    bound = max(
        1e-9 / float(torch.linalg.eigvalsh(m)[0]) + 4 * m.shape[0] * FLOAT64_UNIT * float(torch.linalg.cond(m))
        for m in (a, c)
    )
    torch.testing.assert_close(members.T @ members / members.shape[0], identity, atol=2 * bound, rtol=0)
    torch.testing.assert_close(psi.T @ psi / psi.shape[0], identity, atol=2 * bound, rtol=0)
    cross = phi.mean(1).T @ psi / psi.shape[0]
    torch.testing.assert_close(cross, torch.diag(decomposition.eigenvalues.sqrt()), atol=4 * bound, rtol=0)


def test_density_ratio_is_the_weighted_sum_of_basis_products():
    low, high = _inputs(seed=2)
    decomposition = decompose(group_statistics(low, high), reg=0.1)
    z, h = low[:, 0], high
    phi, psi = decomposition.low_basis(z), decomposition.high_basis(h)
    expected = torch.zeros(z.shape[0], dtype=torch.float64)
    for k, sigma in enumerate(decomposition.eigenvalues):
        expected += sigma.sqrt() * phi[:, k] * psi[:, k]
    torch.testing.assert_close(decomposition.density_ratio(z, h), expected)  # float64 defaults: sums of 5 products
    # Broadcasting: every member of a group against the group's high-level feature.
    assert decomposition.density_ratio(low, high[:, None, :]).shape == low.shape[:2]


def test_decomposition_of_feature_map_statistics_satisfies_the_cost_identity():
    torch.manual_seed(3)
    stats = feature_map_statistics(
        torch.rand(3, 4, 6, 6), torch.rand(3, 4, 3, 3), WindowGeometry(4, 2, 1), precision="float64"
    )
    sigma = decompose(stats, reg=1e-3).eigenvalues
    cost = cost_from_statistics(stats, reg=1e-3)
    # the log-dets and the eigenvalues, each within its float64 bound (logdet_error; 3 e / (1 - sigma) per eigenvalue)
    a, c, cross = (m.double() for m in stats.means())
    a, c = a + 1e-3 * torch.eye(4, dtype=torch.float64), c + 1e-3 * torch.eye(4, dtype=torch.float64)
    joint = torch.cat([torch.cat([a, cross], 1), torch.cat([cross.T, c], 1)], 0)
    e = 4 * 8 * FLOAT64_UNIT * (float(torch.linalg.cond(a)) + float(torch.linalg.cond(c)))
    bound = sum(logdet_error(m) for m in (a, c, joint)) + float((3 * e / (1 - sigma)).sum())
    assert cost.item() == pytest.approx(torch.log1p(-sigma).sum().item(), rel=0, abs=bound)


def test_decomposition_does_not_track_gradients():
    low, high = _inputs(seed=4)
    low.requires_grad_(True)
    assert not eigenspectrum(low, high).requires_grad


def test_non_finite_features_are_one_clear_error() -> None:
    low = torch.full((64, 9, 8), float("nan"), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the statistics cannot be decomposed \(.*\); are the features finite\?"):
        eigenspectrum(low, torch.rand(64, 8, dtype=torch.float64), reg=0.1)
