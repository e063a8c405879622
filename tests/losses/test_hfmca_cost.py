import dataclasses
import io

import numpy as np
import pytest
import torch

from hfmca_lightning.analysis import eigenspectrum
from hfmca_lightning.diagnostics import HostReads
from hfmca_lightning.losses import (
    CorrelationStatistics,
    CostFactorisationError,
    HFMCACost,
    WindowGeometry,
    cost_from_statistics,
    feature_map_statistics,
    hfmca_cost,
)
from hfmca_lightning.losses.hfmca_cost import hfmca_costs
from tests.helpers import (
    FLOAT64_UNIT,
    cost_error,
    gamma,
    gradient_error,
    inverse_error,
    reference_cost,
    reference_cost_autograd,
    reference_group_moments,
    reference_unfold_windows,
    spectrum_error,
)

CASES = {
    "random": (64, 9, 16, 16),
    "rank_deficient_M_lt_K": (5, 3, 32, 24),  # M < K: R2 has rank <= 5
    "K1_ne_K2": (30, 4, 10, 6),
    "single_group_single_member": (1, 1, 8, 8),
}


def _inputs(groups: int, members: int, k1: int, k2: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    low = torch.rand(groups, members, k1, generator=generator, dtype=torch.float64)
    high = torch.rand(groups, k2, generator=generator, dtype=torch.float64)
    return low, high


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("reg", [0.1, 1e-3])
def test_cost_equals_sum_log_one_minus_eigenvalues(case: str, reg: float):
    low, high = _inputs(*CASES[case])
    cost = hfmca_cost(low, high, reg=reg)
    sigma = eigenspectrum(low, high, reg=reg)
    assert sigma.shape == (min(low.shape[-1], high.shape[-1]),)
    assert bool((sigma[:-1] >= sigma[1:]).all()), "eigenvalues must be descending"
    assert bool((sigma >= 0).all()) and bool((sigma < 1).all())
    identity = torch.log1p(-sigma).sum()
    assert cost.item() <= 0
    # two float64 computations of r (Cholesky log-dets; whitened eigenvalues): within the sum of their error bounds
    assert abs(cost.item() - identity.item()) <= cost_error(low, high, reg) + spectrum_error(low, high, reg, sigma)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cost_matches_numpy_slogdet_reference(case: str):
    low, high = _inputs(*CASES[case], seed=3)
    expected = reference_cost(*reference_group_moments(low, high), reg=0.1)
    # numpy's LU log-dets and the Cholesky ones err alike (backward stable): twice the Cholesky bound
    assert hfmca_cost(low, high, reg=0.1).item() == pytest.approx(expected, rel=0, abs=2 * cost_error(low, high, 0.1))


@pytest.mark.parametrize(
    "geometry", [WindowGeometry(1, 1, 0), WindowGeometry(3, 1, 1), WindowGeometry(4, 2, 1)], ids=str
)
def test_feature_map_cost_matches_unfolded_reference(geometry: WindowGeometry):
    torch.manual_seed(4)
    low_map = torch.rand(2, 5, 6, 6)
    high_map = torch.rand(2, 4, *geometry.output_size((6, 6)))
    cost = cost_from_statistics(feature_map_statistics(low_map, high_map, geometry, precision="float64"), reg=0.01)
    members, highs, real = reference_unfold_windows(
        low_map, high_map, geometry.kernel, geometry.stride, geometry.padding
    )
    expected = reference_cost(*reference_group_moments(members, highs, real), reg=0.01)
    assert cost.item() == pytest.approx(expected, rel=0, abs=2 * cost_error(members, highs, 0.01))


def test_independent_levels_cost_near_zero_and_dependent_levels_cost_negative():
    torch.manual_seed(5)
    low = torch.randn(4096, 2, 4, dtype=torch.float64)
    independent = torch.randn(4096, 4, dtype=torch.float64)
    dependent = low.mean(dim=1)
    assert hfmca_cost(low, independent, reg=0.1).item() > -0.02
    assert hfmca_cost(low, dependent, reg=0.1).item() < -1.0


def test_collapsed_features_and_tiny_batches_give_finite_cost():
    collapsed_low = torch.full((8, 9, 128), 0.5)
    collapsed_high = torch.full((8, 128), 0.5)
    for low, high in [(collapsed_low, collapsed_high), (torch.rand(1, 2, 128), torch.rand(1, 128))]:
        low.requires_grad_(True)
        cost = hfmca_cost(low, high, reg=0.1)
        cost.backward()
        assert torch.isfinite(cost) and bool(torch.isfinite(low.grad).all())


@pytest.mark.parametrize("reg", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_reg_is_rejected_at_construction(reg: float):
    with pytest.raises(ValueError, match="reg must be a finite number > 0"):
        HFMCACost(reg=reg)
    with pytest.raises(ValueError, match="reg must be a finite number > 0"):
        hfmca_cost(torch.rand(2, 2, 2), torch.rand(2, 2), reg=reg)


@pytest.mark.parametrize("beta", [-0.1, 1.0, 2.0])
def test_beta_outside_unit_interval_is_rejected(beta: float):
    with pytest.raises(ValueError, match=r"beta .* must be in \[0, 1\)"):
        HFMCACost(beta=beta)


def test_nan_features_raise_an_error_that_names_the_cost():
    low = torch.rand(4, 3, 8)
    low[0, 0, 0] = float("nan")
    with pytest.raises(CostFactorisationError, match=r"HFMCA cost 'external'.*NaN or Inf"):
        hfmca_cost(low, torch.rand(4, 8), name="external")
    module = HFMCACost(name="internal/L3")
    with pytest.raises(CostFactorisationError, match=r"HFMCA cost 'internal/L3'"):
        module(low, torch.rand(4, 8))


def test_cost_is_float64_outside_bf16_autocast_and_differentiable():
    torch.manual_seed(6)
    layer = torch.nn.Linear(8, 8)
    x = torch.rand(16, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = layer(x)
        high = layer(x.mean(dim=1))
        assert low.dtype == torch.bfloat16
        cost = hfmca_cost(low, high)
    assert cost.dtype == torch.float64
    # the same float64 arithmetic on the same (bf16-valued) features, in the same order: equal to rounding
    assert cost.item() == pytest.approx(
        hfmca_cost(low.double(), high.double()).item(), rel=0, abs=cost_error(low, high, 0.1)
    )
    cost.backward()
    assert layer.weight.grad is not None and bool(torch.isfinite(layer.weight.grad).all())


def _grads(cost_fn, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    low = low.clone().requires_grad_(True)
    high = high.clone().requires_grad_(True)
    cost = cost_fn(low, high)
    cost.backward()
    return cost.detach(), low.grad, high.grad


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_values_and_gradients_equal_autograd_through_the_assembled_matrices(case: str):
    """The cost's value and gradient (from the blocks of J's factor, handed to the statistics in one node) equal
    autograd through ``slogdet`` of the assembled J, A and C: the training module, the functional form, and a
    module in eval mode."""
    low, high = _inputs(*CASES[case], seed=7)
    expected = _grads(lambda lo, hi: reference_cost_autograd(lo, hi, 0.1), low, high)
    # two float64 computations (blocks of J's factor; LU of the assembled matrices): each within its bound
    bounds = (2 * cost_error(low, high, 0.1), 2 * gradient_error(low, high, 0.1), 2 * gradient_error(low, high, 0.1))
    for cost_fn in (
        HFMCACost(reg=0.1, beta=0.0).train(),
        HFMCACost(reg=0.1, beta=0.5).eval(),
        lambda lo, hi: hfmca_cost(lo, hi, reg=0.1),
    ):
        for got, want, bound in zip(_grads(cost_fn, low, high), expected, bounds):
            torch.testing.assert_close(got, want, rtol=0, atol=bound)


def _hand_filtered_gradient(steps, beta: float, reg: float):
    """Alg. 3 by hand: numpy EMA of J with bias correction, then the gradient of the trace surrogate."""
    ema = None
    results = []
    for k, (low, high) in enumerate(steps, start=1):
        r1, r2, cross = reference_group_moments(low, high)
        a = r1 + reg * np.eye(r1.shape[0])
        c = r2 + reg * np.eye(r2.shape[0])
        joint = np.block([[a, cross], [cross.T, c]])
        ema = (1 - beta) * joint if ema is None else beta * ema + (1 - beta) * joint
        joint_hat = ema / (1 - beta**k)
        k1 = r1.shape[0]
        inv_joint = torch.from_numpy(np.linalg.inv(joint_hat))
        inv_a = torch.from_numpy(np.linalg.inv(joint_hat[:k1, :k1]))
        inv_c = torch.from_numpy(np.linalg.inv(joint_hat[k1:, k1:]))

        def surrogate(lo, hi, inv_joint=inv_joint, inv_a=inv_a, inv_c=inv_c):
            groups, members, _ = lo.shape
            r1_t = lo.reshape(-1, lo.shape[-1]).T @ lo.reshape(-1, lo.shape[-1]) / (groups * members)
            r2_t = hi.T @ hi / groups
            p_t = lo.mean(1).T @ hi / groups
            a_t = r1_t + reg * torch.eye(r1_t.shape[0], dtype=torch.float64)
            c_t = r2_t + reg * torch.eye(r2_t.shape[0], dtype=torch.float64)
            j_t = torch.cat([torch.cat([a_t, p_t], 1), torch.cat([p_t.T, c_t], 1)], 0)
            return torch.trace(inv_joint @ j_t) - torch.trace(inv_a @ a_t) - torch.trace(inv_c @ c_t)

        results.append((joint_hat, _grads(surrogate, low, high)[1:]))
    return results


def test_adaptive_filter_matches_hand_computation_over_three_steps():
    beta, reg = 0.5, 1e-3
    steps = [_inputs(10, 9, 6, 5, seed=s) for s in (10, 11, 12)]
    module = HFMCACost(reg=reg, beta=beta)
    expected = _hand_filtered_gradient(steps, beta, reg)
    for k, ((low, high), (joint_hat, (grad_low, grad_high))) in enumerate(zip(steps, expected), start=1):
        cost, got_low, got_high = _grads(module, low, high)
        assert int(module.num_updates) == k
        # the EMA: k float64 blends of moments (sums of 90 terms), 2 gamma_90 ~ 2e-14 relative
        np.testing.assert_allclose((module.joint_ema / (1 - beta**k)).numpy(), joint_hat, rtol=1e-12)
        # gradients at the smoothed matrices (numpy's inverses of J_hat against the blocks of its factor): J_hat is a
        # mean of the steps' J, conditioned no worse than the worst of them, so the largest of their gradient bounds
        bound = 2 * max(gradient_error(*past, reg) for past in steps[:k])
        torch.testing.assert_close(got_low, grad_low, rtol=0, atol=bound)
        torch.testing.assert_close(got_high, grad_high, rtol=0, atol=bound)
        # The value is always the exact cost of the current batch, never the smoothed one: the same computation.
        assert cost.item() == pytest.approx(
            hfmca_cost(low, high, reg=reg).item(), rel=0, abs=cost_error(low, high, reg)
        )
    # After step 1 the smoothed gradient really differs from the exact one.
    exact_low = _grads(lambda lo, hi: hfmca_cost(lo, hi, reg=reg), *steps[2])[1]
    assert not torch.allclose(expected[2][1][0], exact_low, rtol=1e-3)  # a real difference, not rounding


def test_eval_mode_leaves_the_filter_untouched():
    module = HFMCACost(beta=0.5)
    low, high = _inputs(6, 3, 4, 4)
    module(low, high)
    before = module.joint_ema.clone()
    module.eval()
    module(_inputs(6, 3, 4, 4, seed=1)[0], high)
    assert int(module.num_updates) == 1
    torch.testing.assert_close(module.joint_ema, before)


def test_filter_buffers_round_trip_through_state_dict():
    steps = [_inputs(10, 9, 6, 5, seed=s) for s in (20, 21, 22)]
    trained = HFMCACost(reg=1e-3, beta=0.5)
    for low, high in steps[:2]:
        _grads(trained, low, high)
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    restored = HFMCACost(reg=1e-3, beta=0.5)
    assert restored.joint_ema.numel() == 0
    restored.load_state_dict(torch.load(buffer))
    torch.testing.assert_close(restored.joint_ema, trained.joint_ema, rtol=0, atol=0)
    assert int(restored.num_updates) == 2
    # Resumed and uninterrupted filters take the identical third step.
    for got, expected in zip(_grads(restored, *steps[2]), _grads(trained, *steps[2])):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_changing_feature_dimensions_between_steps_is_an_error():
    module = HFMCACost(beta=0.5)
    _grads(module, *_inputs(4, 2, 3, 3))
    with pytest.raises(ValueError, match="feature dimensions changed"):
        _grads(module, *_inputs(4, 2, 5, 3))


@pytest.mark.parametrize("size", [64, 128, 512, 520])
def test_cholesky_of_padded_sizes_is_the_plain_factor(size: int, monkeypatch: pytest.MonkeyPatch):
    """On CPUs matrices whose size is a multiple of 64 from 128 up are factored with an identity block appended (MKL
    is slow at those sizes; docs/conventions.md §2): the factor, its gradient and the failure column are those of the
    plain matrix."""
    from hfmca_lightning.losses.cholesky import _cholesky_ex

    torch.manual_seed(size)
    x = torch.randn(2 * size, size, dtype=torch.float64)
    matrix = (x.T @ x / size + 0.1 * torch.eye(size, dtype=torch.float64)).requires_grad_(True)
    factored, cholesky_ex = [], torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda a: factored.append(a.shape[-1]) or cholesky_ex(a))
    _cholesky_ex(matrix.detach()[None])
    assert factored == [size + 8 if size in (128, 512) else size]
    (factor,), info = _cholesky_ex(matrix[None])
    expected = torch.linalg.cholesky(matrix)
    assert factor.shape == (size, size) and int(info) == 0
    # LAPACK may block the padded and the plain factorisation differently: both are backward stable, so the factors
    # differ by at most ~ 2 inverse_error(M) ||L|| (a factor's perturbation is bounded like an inverse's)
    bound = 2 * inverse_error(matrix.detach()) * float(torch.linalg.matrix_norm(expected.detach(), 2))
    torch.testing.assert_close(factor, expected, rtol=0, atol=bound)
    weights = torch.randn(size, size, dtype=torch.float64)
    (got,) = torch.autograd.grad((factor * weights).sum(), matrix)
    (want,) = torch.autograd.grad((expected * weights).sum(), matrix)
    # the factor's gradient solves with L twice: the bound above times kappa(L) = sqrt(kappa(M)), times |weights|
    scale = float(torch.linalg.cond(matrix.detach())) ** 0.5 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=2 * inverse_error(matrix.detach()) * scale)
    broken = matrix.detach().clone()
    broken[size // 2, size // 2] = -1.0
    assert int(_cholesky_ex(broken[None])[1]) == int(torch.linalg.cholesky_ex(broken)[1]) > 0


@pytest.mark.parametrize("size", [8, 130])
def test_the_gpu_inverse_from_a_factor_equals_potri(size: int):
    """GPUs invert the Schur and C factors by one triangular solve and a product (torch.cholesky_inverse is
    launch-heavy there); it is LAPACK's potri to rounding."""
    from hfmca_lightning.losses.cholesky import _inverse_by_triangular_solve

    torch.manual_seed(size)
    x = torch.randn(size, 3 * size, dtype=torch.float64)
    factor = torch.linalg.cholesky(x @ x.T / size + 0.1 * torch.eye(size, dtype=torch.float64))
    inverse = _inverse_by_triangular_solve(factor)
    matrix = factor @ factor.T
    bound = 2 * inverse_error(matrix) * float(torch.linalg.matrix_norm(inverse, 2))  # two inverses, each within it
    torch.testing.assert_close(inverse, torch.cholesky_inverse(factor), rtol=0, atol=bound)
    # L^-T L^-1 as one product is symmetric up to the product's rounding: gamma_n |L^-T| |L^-1|
    symmetry = gamma(size, FLOAT64_UNIT) * float((factor.inverse().abs().T @ factor.inverse().abs()).max())
    assert bool(((inverse - inverse.T).abs() <= symmetry).all())


def _statistics(a: torch.Tensor, c: torch.Tensor, cross: torch.Tensor, reg: float = 0.1) -> CorrelationStatistics:
    """Statistics whose matrices are ``A = a``, ``C = c`` and ``P = cross`` at ``reg`` (one member, one group)."""
    one = torch.ones((), dtype=torch.float64)
    eye = torch.eye(a.shape[0], dtype=torch.float64)
    return CorrelationStatistics(a - reg * eye, c - reg * torch.eye(c.shape[0], dtype=torch.float64), cross, one, one)


@pytest.mark.parametrize(
    ("broken", "named", "column"),
    [("low", "low-level matrix A", 2), ("high", "high-level matrix C", 3), ("schur", "Schur complement", 1)],
)
def test_a_failed_factor_is_named(broken: str, named: str, column: int):
    """J and C are factored, then checked at once; the error names the first failed matrix in the order A, C, S
    (S <= C, so a C that is not positive definite fails S as well), with the column the factorisation stopped at."""
    eye = torch.eye(3, dtype=torch.float64)
    a, c, cross = eye.clone(), eye.clone(), torch.zeros(3, 3, dtype=torch.float64)
    if broken == "low":
        a[1, 1] = -1.0
    elif broken == "high":
        c[2, 2] = -1.0
    else:
        cross = 2.0 * eye  # S = C - P^T A^-1 P = -3 I, while A and C are fine
    with pytest.raises(
        CostFactorisationError,
        match=rf"HFMCA cost 'x': the {named}[^(]*\(3x3\) is not positive definite.*column {column}\)",
    ):
        HFMCACost(name="x").train().forward_statistics(_statistics(a, c, cross))


def _failing_statistics(k: int = 3) -> CorrelationStatistics:
    """Statistics whose A = R1 + reg I is not positive definite (a negative second moment)."""
    eye = torch.eye(k, dtype=torch.float64)
    low = eye.clone()
    low[1, 1] = -5.0
    one = torch.ones((), dtype=torch.float64)
    return CorrelationStatistics(low, eye.clone(), torch.zeros(k, k, dtype=torch.float64), one, one)


def _good_statistics(k: int = 3) -> CorrelationStatistics:
    eye = torch.eye(k, dtype=torch.float64)
    one = torch.ones((), dtype=torch.float64)
    return CorrelationStatistics(eye.clone(), eye.clone(), 0.1 * eye, one, one)


def test_costs_taken_together_report_the_first_failure_when_their_checks_are_read():
    """hfmca_costs computes every cost (a failed one does not stop the others, and nothing is raised); reading
    the checks raises the error that the cost alone raises, for the first failed cost in order."""
    with pytest.raises(CostFactorisationError) as alone:
        HFMCACost(name="first").forward_statistics(_failing_statistics())
    costs = [HFMCACost(name=name).train() for name in ("good", "first", "second")]
    values, checks = hfmca_costs([_good_statistics(), _failing_statistics(), _failing_statistics(4)], costs)
    assert len(values) == 3 and torch.isfinite(values[0])
    with pytest.raises(CostFactorisationError) as together:
        checks.raise_if_failed()
    assert str(together.value) == str(alone.value)
    assert "HFMCA cost 'first': the low-level matrix A" in str(together.value)
    values, checks = hfmca_costs([_good_statistics()], [HFMCACost()])
    checks.raise_if_failed()  # nothing failed: nothing raised
    assert torch.isfinite(values[0])


def test_costs_taken_together_read_nothing_until_their_checks_are_read():
    """No host read of a device value while the costs (values and gradients) are computed; one when the checks are
    read (each is a wait for the queue on a GPU), however many costs there are."""
    statistics = [
        dataclasses.replace(_good_statistics(), low_outer_sum=torch.eye(3, dtype=torch.float64).requires_grad_(True))
        for _ in range(5)
    ]
    with HostReads() as recorder:
        values, checks = hfmca_costs(statistics, [HFMCACost(beta=beta).train() for beta in (0.0, 0.5, 0.0, 0.5, 0.0)])
        torch.stack(values).sum().backward()
    assert recorder.reads == []
    with HostReads() as recorder:
        checks.raise_if_failed()
    assert len(recorder.reads) == 1, recorder.reads
    with HostReads() as recorder:
        for _ in range(5):
            HFMCACost().train().forward_statistics(_good_statistics())
    assert len(recorder.reads) == 5, recorder.reads  # one cost at a time, each read at once


def _filtered_cost_after_a_good_step() -> tuple[HFMCACost, torch.Tensor, int]:
    """A cost with the adaptive filter after one good step: the cost, its EMA and its update count then."""
    cost = HFMCACost(beta=0.5).train()
    cost.forward_statistics(_good_statistics())
    return cost, cost.joint_ema.clone(), int(cost.num_updates)


def _nan_statistics() -> CorrelationStatistics:
    return dataclasses.replace(
        _good_statistics(), low_outer_sum=torch.full((3, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    )


def test_a_failed_step_leaves_the_filter_state_as_it_was():
    """With the adaptive filter (beta > 0) the EMA takes in a step's J only if its factorisation succeeded, decided on
    the device, so a failed step cannot leave NaN in the filter, and its gradient is computed without an error."""
    cost, ema, updates = _filtered_cost_after_a_good_step()
    (value,), checks = hfmca_costs([_nan_statistics()], [cost])
    value.backward()
    assert torch.equal(cost.joint_ema, ema) and int(cost.num_updates) == updates
    with pytest.raises(CostFactorisationError, match=r"NaN or Inf"):
        checks.raise_if_failed()
    failing = dataclasses.replace(
        _failing_statistics(), low_outer_sum=_failing_statistics().low_outer_sum.requires_grad_(True)
    )
    (value,), checks = hfmca_costs([failing], [cost])
    value.backward()  # the inverses of a failed factor are taken of the identity: no LAPACK error
    assert torch.equal(cost.joint_ema, ema) and int(cost.num_updates) == updates
    with pytest.raises(CostFactorisationError, match="low-level matrix A"):
        checks.raise_if_failed()


def test_nan_statistics_stay_out_of_the_filter_when_the_factorisation_reports_success(monkeypatch):
    """CUDA's ``cholesky_ex`` returns ``info = 0`` for NaN input (a known PyTorch behaviour; LAPACK on the CPU reports
    a failure). Emulated here: the filter's EMA still takes nothing from a step whose statistics are not finite, and
    the checks name NaN."""
    from hfmca_lightning.losses import cholesky

    factor = cholesky.torch.linalg.cholesky_ex

    def cuda_like(matrices):
        factors, info = factor(matrices)
        return factors, torch.where(torch.isnan(matrices).flatten(1).any(1), torch.zeros_like(info), info)

    monkeypatch.setattr(cholesky.torch.linalg, "cholesky_ex", cuda_like)
    cost, ema, updates = _filtered_cost_after_a_good_step()
    (value,), checks = hfmca_costs([_nan_statistics()], [cost])
    assert torch.equal(cost.joint_ema, ema) and int(cost.num_updates) == updates
    assert bool(torch.isfinite(cost.joint_ema).all())
    with pytest.raises(CostFactorisationError, match=r"HFMCA cost 'hfmca': its statistics hold NaN or Inf"):
        checks.raise_if_failed()
