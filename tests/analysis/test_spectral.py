import numpy as np
import pytest
import torch

from hfmca_lightning.analysis import decompose, eigenspectrum, inverse_sqrt
from hfmca_lightning.losses import WindowGeometry, cost_from_statistics, feature_map_statistics, group_statistics
from tests.helpers import reference_group_moments


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
    np.testing.assert_allclose(eigenspectrum(low, high, reg=reg).numpy(), expected, rtol=1e-9, atol=1e-12)


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
    torch.testing.assert_close(members.T @ members / members.shape[0], identity, atol=1e-6, rtol=0)
    torch.testing.assert_close(psi.T @ psi / psi.shape[0], identity, atol=1e-6, rtol=0)
    cross = phi.mean(1).T @ psi / psi.shape[0]
    torch.testing.assert_close(cross, torch.diag(decomposition.eigenvalues.sqrt()), atol=1e-6, rtol=0)


def test_density_ratio_is_the_weighted_sum_of_basis_products():
    low, high = _inputs(seed=2)
    decomposition = decompose(group_statistics(low, high), reg=0.1)
    z, h = low[:, 0], high
    phi, psi = decomposition.low_basis(z), decomposition.high_basis(h)
    expected = torch.zeros(z.shape[0], dtype=torch.float64)
    for k, sigma in enumerate(decomposition.eigenvalues):
        expected += sigma.sqrt() * phi[:, k] * psi[:, k]
    torch.testing.assert_close(decomposition.density_ratio(z, h), expected)
    # Broadcasting: every member of a group against the group's high-level feature.
    assert decomposition.density_ratio(low, high[:, None, :]).shape == low.shape[:2]


def test_decomposition_of_feature_map_statistics_satisfies_the_cost_identity():
    torch.manual_seed(3)
    stats = feature_map_statistics(
        torch.rand(3, 4, 6, 6), torch.rand(3, 4, 3, 3), WindowGeometry(4, 2, 1), precision="float64"
    )
    sigma = decompose(stats, reg=1e-3).eigenvalues
    cost = cost_from_statistics(stats, reg=1e-3)
    assert cost.item() == pytest.approx(torch.log1p(-sigma).sum().item(), rel=1e-9)


def test_decomposition_does_not_track_gradients():
    low, high = _inputs(seed=4)
    low.requires_grad_(True)
    assert not eigenspectrum(low, high).requires_grad
