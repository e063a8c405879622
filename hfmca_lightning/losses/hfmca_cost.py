"""The HFMCA log-determinant dependence cost (paper Prop. 2, appendix Alg. 2 and 3; docs/conventions.md §1).

With ``A = R1 + reg I``, ``C = R2 + reg I`` and ``J = [[A, P], [P^T, C]]``,

    r = logdet J - logdet A - logdet C = sum_k log(1 - sigma_k)  <= 0,

where ``sigma_k`` is the eigenspectrum (:func:`hfmca_lightning.analysis.eigenspectrum`). ``J`` is factored
block by block, ``L_J = [[L_A, 0], [W^T, L_S]]`` with ``W = L_A^-1 P`` and ``S = C - W^T W``, so
``logdet J - logdet A = logdet S`` and ``r = 2 sum log diag(L_S) - 2 sum log diag(L_C)``; ``J`` itself is
never assembled. Everything is float64, outside autocast.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.distributed import all_reduce_statistics
from hfmca_lightning.losses.statistics import CorrelationStatistics, group_statistics, joint_matrix, marginal_blocks

__all__ = ["hfmca_cost", "cost_from_statistics", "HFMCACost", "CostFactorisationError", "deferred_checks", "check_later"]


class CostFactorisationError(RuntimeError):
    """A matrix of an HFMCA cost is not positive definite, so its log-determinant does not exist."""


def check_reg(reg: float) -> float:
    """Validate the regularisation constant (docs/conventions.md §1: ``reg <= 0`` is rejected)."""
    if isinstance(reg, bool) or not isinstance(reg, (int, float)) or not math.isfinite(reg) or reg <= 0:
        raise ConfigurationError(
            f"reg must be a finite number > 0 (it makes the correlation matrices invertible); got {reg!r}. "
            "Use 0.1 for self-supervised training and 1e-3 for spectrum analysis (paper appendix).",
            parameter="reg",
        )
    return float(reg)


def _factorisation_error(matrix: Tensor, info: Tensor, *, what: str, cost_name: str, reg: float) -> CostFactorisationError:
    """The clear error for a matrix whose Cholesky factorisation failed (``info > 0``)."""
    if not bool(torch.isfinite(matrix).all()):
        hint = (
            "the features contain NaN or Inf values; check the learning rate and the input data, "
            "and keep the feature maps in float32 or bf16 (not float16) under mixed precision"
        )
    else:
        hint = f"increase `reg` (now {reg}) or check that the features are not exploding"
    return CostFactorisationError(
        f"HFMCA cost '{cost_name}': the {what} ({matrix.shape[0]}x{matrix.shape[1]}) is not positive "
        f"definite, so its log-determinant is undefined (Cholesky failed at column {int(info.max())}); "
        + hint
    )


Check = tuple[Tensor, Callable[[], Exception]]  # (a bool tensor: failed?, the error to raise if so)
_PENDING_CHECKS: ContextVar[list[Check] | None] = ContextVar("hfmca_pending_checks", default=None)


@contextmanager
def deferred_checks() -> Iterator[None]:
    """Test the failure checks of everything computed inside the block together, when it ends: the Cholesky
    factorisations of every cost and what callers add with :func:`check_later`. Reading a check's result from
    a GPU waits for its queue, so a step with nine costs waited nine times (and the GPU idled while the host
    queued the next kernels); inside this block it waits once. The first failure, in the order the checks were
    made (cost by cost; A, C, S within one), is raised, the same error the undeferred cost raises. Values
    computed from a failed factor are NaN or meaningless until then; an error that linear algebra raises on
    one (``cholesky_inverse`` of a zero pivot) is replaced by the factorisation's error."""
    pending: list[Check] = []
    token = _PENDING_CHECKS.set(pending)
    try:
        yield
    except RuntimeError:
        _raise_first_failure(pending)
        raise
    finally:
        _PENDING_CHECKS.reset(token)
    _raise_first_failure(pending)


def check_later(checks: list[Check]) -> None:
    """Inside :func:`deferred_checks`, keep ``checks`` for its end; elsewhere test them now (one wait)."""
    pending = _PENDING_CHECKS.get()
    if pending is None:
        _raise_first_failure(checks)
    else:
        pending.extend(checks)


def _raise_first_failure(checks: list[Check]) -> None:
    """Raise the error of the first failed check; one host-device wait when none failed."""
    if not checks:
        return
    failed = torch.stack([flag.reshape(()) for flag, _ in checks])
    if bool(failed.any()):
        raise checks[int(failed.to(torch.uint8).argmax())][1]()


def _cholesky_ex(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.cholesky_ex``; on CPUs of ``[[M, 0], [0, I_8]]`` when the size is a multiple of 64 (the
    factor's leading block is M's): MKL's Cholesky runs 1.5x to 3x slower at those sizes (2.0 ms at 512 against
    0.8 ms at 520 on two cores), and feature dimensions usually are such multiples."""
    size = matrix.shape[-1]
    if matrix.device.type != "cpu" or size < 128 or size % 64:
        return torch.linalg.cholesky_ex(matrix)
    padded = F.pad(matrix, (0, 8, 0, 8))
    padded.diagonal()[size:] = 1.0
    factor, info = torch.linalg.cholesky_ex(padded)
    return factor[:size, :size], info


def _logdet_from_factor(factor: Tensor) -> Tensor:
    return 2.0 * torch.log(torch.diagonal(factor)).sum()


@dataclass(frozen=True)
class _BlockFactors:
    """Cholesky factors of ``J = [[A, P], [P^T, C]]`` by blocks, and of ``C``: ``L_J = [[L_A, 0], [W^T, L_S]]``
    with ``W = L_A^-1 P`` and ``S = C - W^T W`` (the Schur complement of ``A`` in ``J``)."""

    low: Tensor  # L_A  (K1, K1)
    coupling: Tensor  # W  (K1, K2)
    schur: Tensor  # L_S  (K2, K2)
    high: Tensor  # L_C  (K2, K2)

    def cost(self) -> Tensor:
        """``r = logdet J - logdet A - logdet C = logdet S - logdet C``."""
        return _logdet_from_factor(self.schur) - _logdet_from_factor(self.high)


def _block_factors(a: Tensor, c: Tensor, cross: Tensor, *, name: str, reg: float, smoothed: bool = False, defer: bool = True) -> _BlockFactors:
    """Factor ``J`` block by block (what LAPACK does inside, without assembling the ``(K1+K2)^2`` matrix):
    two Cholesky factors of size K1 and K2 instead of one of K1 + K2, and one of ``C``. Differentiable.

    The three factorisations are checked together (:func:`check_later`: now, or at the end of
    :func:`deferred_checks`; now in any case without ``defer``); a failure is reported for the first failed
    matrix in the order A, C, S (a failed ``L_A`` makes ``S`` meaningless, and ``S <= C``, so C failing fails S
    too)."""
    label = "smoothed " if smoothed else ""
    hat = "_hat" if smoothed else ""
    low, low_info = _cholesky_ex(a)
    coupling = torch.linalg.solve_triangular(low, cross, upper=False)
    schur_matrix = torch.addmm(c, coupling.T, coupling, alpha=-1.0)
    schur, schur_info = _cholesky_ex(schur_matrix)
    high, high_info = _cholesky_ex(c)
    (check_later if defer else _raise_first_failure)([
        (info != 0, partial(_factorisation_error, matrix, info, what=what, cost_name=name, reg=reg))
        for matrix, info, what in (
            (a, low_info, f"{label}low-level matrix A{hat} = R1 + reg I"),
            (c, high_info, f"{label}high-level matrix C{hat} = R2 + reg I"),
            (schur_matrix, schur_info, f"Schur complement C - P^T A^-1 P of the {label}joint matrix J{hat} = [[A, P], [P^T, C]]"),
        )
    ])
    return _BlockFactors(low, coupling, schur, high)


def _inverse_from_factor(factor: Tensor) -> Tensor:
    """``(L L^T)^-1`` from the lower factor ``L``: LAPACK's ``potri`` on CPUs; on GPUs ``L^-T L^-1`` from one
    triangular solve and one product (``torch.cholesky_inverse`` costs ~0.5 ms of host time per call there,
    and the internal step is launch-bound on GPUs)."""
    return torch.cholesky_inverse(factor) if factor.device.type == "cpu" else _inverse_by_triangular_solve(factor)


def _inverse_by_triangular_solve(factor: Tensor) -> Tensor:
    """``(L L^T)^-1 = L^-T L^-1`` (the GPU path of :func:`_inverse_from_factor`)."""
    identity = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    inverse_factor = torch.linalg.solve_triangular(factor, identity, upper=False)
    return inverse_factor.T @ inverse_factor


def _surrogate_gradients(factors: _BlockFactors) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``tr(J_hat^-1 J) - tr(A_hat^-1 A) - tr(C_hat^-1 C)`` w.r.t. ``A``, ``C`` and ``P``.

    By the block inverse of ``J_hat``: with ``X = A_hat^-1 P = L_A^-T W`` and ``Y = X S^-1``, the gradients are
    ``Y X^T`` (A), ``S^-1 - C_hat^-1`` (C) and ``-2 Y`` (P, which appears twice in ``J``). At ``J_hat = J`` this
    is the gradient of ``r`` itself. One triangular solve and two small inverses instead of inverting
    ``J_hat``, ``A_hat`` and ``C_hat``.
    """
    low_inv_cross = torch.linalg.solve_triangular(factors.low.T, factors.coupling, upper=True)
    inv_schur = _inverse_from_factor(factors.schur)
    weighted = low_inv_cross @ inv_schur
    return weighted @ low_inv_cross.T, inv_schur.sub_(_inverse_from_factor(factors.high)), weighted.mul_(-2.0)


class _FilteredCost(torch.autograd.Function):
    """Value ``r`` of the current statistics, gradient of the trace surrogate at the given factors (paper
    Alg. 3), straight to the statistics' sums: ``dr/d(low sum) = G_A / n_members`` and so on. One node instead
    of the dozen elementwise passes over ``(K1+K2)^2`` matrices that autograd would record."""

    @staticmethod
    def forward(ctx, low_outer_sum: Tensor, high_outer_sum: Tensor, cross_sum: Tensor, cost: Tensor, member_count: Tensor, group_count: Tensor, factors: _BlockFactors) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(*_surrogate_gradients(factors), member_count, group_count)
        return cost.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_low, grad_high, grad_cross, member_count, group_count = ctx.saved_tensors
        per_member, per_group = grad / member_count, grad / group_count  # scalars: one pass per matrix
        return grad_low * per_member, grad_high * per_group, grad_cross * per_group, None, None, None, None


def cost_from_statistics(stats: CorrelationStatistics, *, reg: float = 0.1, name: str = "hfmca") -> Tensor:
    """``r = logdet J - logdet A - logdet C`` (0-dim float64, differentiable) from statistics."""
    check_reg(reg)
    with torch.autocast(device_type=stats.low_outer_sum.device.type, enabled=False):
        return _block_factors(*marginal_blocks(stats, reg), name=name, reg=reg).cost()


def hfmca_cost(
    low: Tensor, high: Tensor, *, reg: float = 0.1, sync_dist: bool = False, name: str = "hfmca"
) -> Tensor:
    """HFMCA cost between ``L`` members per group and the group's feature (paper Prop. 2).

    Args:
        low: ``(M, L, K1)`` member features (e.g. the L view features of M images).
        high: ``(M, K2)`` group features (e.g. the external head output).
        reg: ``> 0``, added to the diagonal of both marginal blocks and inside the joint.
        sync_dist: reduce the statistics over all ranks (differentiably) when ``torch.distributed`` is
            initialised, so the cost is the cost of the global batch.
        name: named in error messages.

    Returns:
        0-dim float64 tensor ``r <= 0``; lower means stronger dependence.
    """
    check_reg(reg)
    stats = group_statistics(low, high)
    if sync_dist:
        stats = all_reduce_statistics(stats)
    return cost_from_statistics(stats, reg=reg, name=name)


class HFMCACost(nn.Module):
    """HFMCA cost with the optional adaptive filter of paper Alg. 3 (docs/conventions.md §1).

    In training mode (with gradients enabled) the returned tensor has the value of the exact cost
    ``r`` of the current batch and the gradient of the surrogate

        tr(J_hat^-1 J) - tr(A_hat^-1 A) - tr(C_hat^-1 C),

    where the hats are bias-corrected exponential moving averages (``R_hat = R_tilde / (1 - beta^k)``)
    of ``J``, ``A`` and ``C``, detached. ``beta = 0`` gives exactly the gradient of ``r``. Only the EMA
    of ``J`` is stored (``A`` and ``C`` are its diagonal blocks), in a buffer, so it is checkpointed and
    broadcast like BN statistics. In eval mode the EMA is left untouched and the exact cost is returned.

    Args:
        reg: ``> 0`` diagonal regulariser (0.1 for SSL training, 1e-3 for spectrum analysis).
        beta: EMA factor in ``[0, 1)`` (0 for SSL training, 0.5 for spectrum analysis).
        sync_dist: reduce statistics over ranks, see :func:`hfmca_cost`.
        name: the cost's name in error messages and logs.
    """

    joint_ema: Tensor
    num_updates: Tensor

    def __init__(self, reg: float = 0.1, beta: float = 0.0, sync_dist: bool = False, name: str = "hfmca") -> None:
        super().__init__()
        self.reg = check_reg(reg)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ConfigurationError(
                f"beta (the adaptive-filter smoothing of paper Alg. 3) must be in [0, 1); got {beta!r}. "
                "Use 0 for self-supervised training and 0.5 for spectrum analysis (paper appendix).",
                parameter="beta",
            )
        self.beta = float(beta)
        self.sync_dist = sync_dist
        self.name = name
        self.register_buffer("joint_ema", torch.zeros(0, 0, dtype=torch.float64))
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long))

    def extra_repr(self) -> str:
        return f"name={self.name!r}, reg={self.reg}, beta={self.beta}, sync_dist={self.sync_dist}"

    def forward(self, low: Tensor, high: Tensor) -> Tensor:
        """Cost between ``low (M, L, K1)`` members and ``high (M, K2)`` group features."""
        return self.forward_statistics(group_statistics(low, high))

    def synchronise(self, stats: CorrelationStatistics) -> CorrelationStatistics:
        """The statistics of the global batch: ``stats`` summed over all ranks with ``sync_dist`` (differentiably,
        one collective), else ``stats``."""
        return all_reduce_statistics(stats) if self.sync_dist else stats

    def forward_statistics(self, stats: CorrelationStatistics, *, synchronised: bool = False) -> Tensor:
        """Cost from precomputed statistics, e.g. :func:`feature_map_statistics`; local ones are synchronised
        first (pass ``synchronised=True`` for the output of :meth:`synchronise`)."""
        if not synchronised:
            stats = self.synchronise(stats)
        if not (self.training and torch.is_grad_enabled()):
            return cost_from_statistics(stats, reg=self.reg, name=self.name)
        # A labelled range in profiles (torch.profiler, benchmarks/internal_cost_breakdown.py).
        with torch.autocast(device_type=stats.low_outer_sum.device.type, enabled=False), torch.profiler.record_function("HFMCACost.factorise"):
            return self._filtered_cost(stats)

    def _update_ema(self, joint: Tensor) -> Tensor:
        """Alg. 3 lines 4-7: update the EMA of J and return its bias-corrected value ``J_hat``."""
        if self.joint_ema.shape != joint.shape:
            if int(self.num_updates) > 0:
                raise ValueError(
                    f"HFMCA cost '{self.name}': feature dimensions changed from a {tuple(self.joint_ema.shape)} "
                    f"joint matrix to {tuple(joint.shape)} between steps; use one HFMCACost per layer pair"
                )
            self.joint_ema = torch.zeros_like(joint)
        self.joint_ema.mul_(self.beta).add_(joint, alpha=1.0 - self.beta)
        self.num_updates += 1
        return self.joint_ema / (1.0 - self.beta ** int(self.num_updates))

    def _filtered_cost(self, stats: CorrelationStatistics) -> Tensor:
        k1 = stats.low_dim
        with torch.no_grad():
            a, c, cross = marginal_blocks(stats.detach(), self.reg)
            # With the filter, checked before the EMA takes in this step's J: a failed step leaves the filter's state as it was.
            factors = _block_factors(a, c, cross, name=self.name, reg=self.reg, defer=self.beta == 0)
            exact = factors.cost()
            if self.beta > 0:
                joint_hat = self._update_ema(joint_matrix(a, c, cross))
                factors = _block_factors(
                    joint_hat[:k1, :k1], joint_hat[k1:, k1:], joint_hat[:k1, k1:], name=self.name, reg=self.reg, smoothed=True
                )
        return _FilteredCost.apply(stats.low_outer_sum, stats.high_outer_sum, stats.cross_sum, exact, stats.member_count, stats.group_count, factors)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[no-untyped-def]
        # The EMA's size is only known after the first step: take it from the checkpoint.
        key = prefix + "joint_ema"
        if key in state_dict and state_dict[key].shape != self.joint_ema.shape:
            self.joint_ema = torch.empty_like(state_dict[key], device=self.joint_ema.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
