"""RankMe against a plain numpy reference and its two ends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hfmca_lightning.analysis import rankme
from tests.helpers import FLOAT64_UNIT, gamma


def reference_rankme(features: np.ndarray, eps: float = 1e-7) -> float:
    """Garrido et al. 2023, eq. 1: exp of the entropy of the normalised singular values (plus eps)."""
    singular = np.linalg.svd(features, compute_uv=False)
    p = singular / singular.sum() + eps
    return float(np.exp(-(p * np.log(p)).sum()))


def test_rankme_equals_the_reference():
    torch.manual_seed(0)
    features = torch.randn(300, 40) @ torch.diag(torch.linspace(1, 0.01, 40))
    got = float(rankme(features))
    # two float64 SVDs of one matrix: each singular value to gamma_n ||F|| absolute, i.e. gamma_n kappa relative with
    # kappa = 100 (singular values from 1 down to 0.01); the normalised entropy moves by no more than that
    assert got == pytest.approx(reference_rankme(features.double().numpy()), rel=gamma(340, FLOAT64_UNIT) * 100)


def test_rankme_is_one_for_collapsed_and_the_dimension_for_isotropic_embeddings():
    direction = torch.randn(1, 16)
    collapsed = torch.randn(200, 1) * direction  # every embedding on one line
    # eps on the 15 zero singular values adds -15 eps log(eps) < 16 eps * 17 to the entropy
    assert float(rankme(collapsed)) == pytest.approx(1.0, abs=16 * 1e-7 * 17)
    isotropic = torch.linalg.qr(torch.randn(64, 16)).Q * 3.0  # orthonormal columns: equal singular values
    assert float(rankme(isotropic)) == pytest.approx(16.0, rel=1e-5)


def test_rankme_rejects_what_is_not_a_matrix_of_embeddings():
    with pytest.raises(ValueError, match=r"\(N, D\) matrix"):
        rankme(torch.randn(3, 4, 5))
