"""The HFMCA log-determinant dependence cost (paper Prop. 2, appendix Alg. 2 and 3; docs/conventions.md §1).

With ``A = R1 + reg I``, ``C = R2 + reg I`` and ``J = [[A, P], [P^T, C]]``,

    r = logdet J - logdet A - logdet C = sum_k log(1 - sigma_k)  <= 0,

where ``sigma_k`` is the eigenspectrum (:func:`hfmca_lightning.analysis.eigenspectrum`). The lower Cholesky
factor of ``J`` holds those of ``A`` and of the Schur complement ``S = C - P^T A^-1 P`` as blocks,
``L_J = [[L_A, 0], [W^T, L_S]]``, so ``logdet J - logdet A = logdet S`` and
``r = 2 sum log diag(L_S) - 2 sum log diag(L_C)``: two factorisations per cost, ``J`` and ``C``.
:func:`hfmca_costs` takes all costs of a step together: their matrices are factored in one batched call per
size, their gradients come from batched solves, and their failure checks stay on the device
(:class:`~hfmca_lightning.losses.cost_checks.CostChecks`). Everything is float64, outside autocast.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.cholesky import cholesky_by_size, identity_where, inverse_from_factor
from hfmca_lightning.losses.cost_checks import NONFINITE, CostChecks, CostFactorisationError, check_state
from hfmca_lightning.losses.distributed import all_reduce_statistics
from hfmca_lightning.losses.statistics import CorrelationStatistics, group_statistics

__all__ = [
    "hfmca_cost",
    "hfmca_costs",
    "cost_values",
    "CostValues",
    "FilterUpdate",
    "apply_filter_updates",
    "cost_from_statistics",
    "HFMCACost",
    "CostFactorisationError",
    "CostChecks",
]


def check_reg(reg: float) -> float:
    """Validate the regularisation constant (docs/conventions.md §1: ``reg <= 0`` is rejected)."""
    if isinstance(reg, bool) or not isinstance(reg, (int, float)) or not math.isfinite(reg) or reg <= 0:
        raise ConfigurationError(
            f"reg must be a finite number > 0 (it makes the correlation matrices invertible); got {reg!r}. "
            "Use 0.1 for self-supervised training and 1e-3 for spectrum analysis (paper appendix).",
            parameter="reg",
        )
    return float(reg)


class HFMCACost(nn.Module):
    """HFMCA cost with the optional adaptive filter of paper Alg. 3 (docs/conventions.md §1).

    In training mode (with gradients enabled) the returned tensor has the value of the exact cost
    ``r`` of the current batch and the gradient of the surrogate

        tr(J_hat^-1 J) - tr(A_hat^-1 A) - tr(C_hat^-1 C),

    where the hats are bias-corrected exponential moving averages (``R_hat = R_tilde / (1 - beta^k)``)
    of ``J``, ``A`` and ``C``, detached. ``beta = 0`` gives exactly the gradient of ``r``. Only the EMA
    of ``J`` is stored (``A`` and ``C`` are its diagonal blocks), in a buffer, so it is checkpointed and
    broadcast like BN statistics; a step whose factorisation fails leaves it as it was. In eval mode the EMA
    is left untouched and the exact cost is returned.

    Args:
        reg: ``> 0`` diagonal regulariser (0.1 for SSL training, 1e-3 for spectrum analysis).
        beta: EMA factor in ``[0, 1)`` (0 for SSL training, 0.5 for spectrum analysis).
        sync_dist: reduce statistics over ranks, see :func:`hfmca_cost`.
        name: the cost's name in its error messages (HFMCAModule logs its costs under fixed keys, ``cost/external``
            and ``cost/internal/<layer>``).

    Raises:
        ConfigurationError: when ``reg`` is not a finite number ``> 0`` or ``beta`` is not in ``[0, 1)``.

    Example::

        cost = HFMCACost(reg=0.1)
        value = cost(torch.randn(64, 9, 32), torch.randn(64, 16))  # 0-dim float64, <= 0
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
        """Cost between the members of each group and the group's feature (paper Prop. 2).

        Args:
            low: ``(M, L, K1)`` member features.
            high: ``(M, K2)`` group features.

        Returns:
            0-dim float64 tensor ``r <= 0``; in training mode with ``beta > 0`` its gradient is the adaptive
            filter's.

        Raises:
            ValueError: when ``low`` is not ``(M, L, K1)`` or ``high`` not ``(M, K2)`` with the same ``M``.
            CostFactorisationError: when a matrix of the cost is not positive definite.
        """
        return self.forward_statistics(group_statistics(low, high))

    def synchronise(self, stats: CorrelationStatistics) -> CorrelationStatistics:
        """The statistics of the global batch.

        Args:
            stats: this rank's statistics.

        Returns:
            ``stats`` summed over all ranks with ``sync_dist`` (differentiably, one collective), else ``stats``.
        """
        return all_reduce_statistics(stats) if self.sync_dist else stats

    def forward_statistics(self, stats: CorrelationStatistics, *, synchronised: bool = False) -> Tensor:
        """Cost from precomputed statistics, e.g. :func:`feature_map_statistics`.

        Args:
            stats: the statistics of one cost; local ones are synchronised first (:meth:`synchronise`).
            synchronised: ``stats`` are already those of the global batch (the output of :meth:`synchronise`).

        Returns:
            0-dim float64 tensor ``r <= 0``.

        Raises:
            CostFactorisationError: when a matrix of the cost is not positive definite (one host read;
                :func:`hfmca_costs` leaves the reading to the caller).
        """
        if not synchronised:
            stats = self.synchronise(stats)
        (cost,), checks = hfmca_costs([stats], [self])
        checks.raise_if_failed()
        return cost

    def filtering(self) -> bool:
        """Whether the next cost updates the adaptive filter and takes its gradient at the smoothed matrices.

        Returns:
            True with ``beta > 0``, in training mode, with gradients enabled.
        """
        return self.beta > 0 and self.training and torch.is_grad_enabled()

    def prepare_filter(self, stats: CorrelationStatistics) -> None:
        """Size the EMA buffer for ``stats`` on their first step (its size is known only then, or from a
        checkpoint); outside any compiled region, as it replaces the buffer.

        Args:
            stats: the statistics of the step.

        Raises:
            ValueError: when the feature dimensions differ from those the buffer was sized for.
        """
        size = stats.low_dim + stats.high_dim
        if self.joint_ema.shape == (size, size):
            return
        if self.joint_ema.numel() > 0:
            raise ValueError(
                f"HFMCA cost '{self.name}': feature dimensions changed from a {tuple(self.joint_ema.shape)} "
                f"joint matrix to {(size, size)} between steps; use one HFMCACost per layer pair"
            )
        self.joint_ema = torch.zeros(size, size, dtype=torch.float64, device=stats.low_outer_sum.device)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # The EMA's size is only known after the first step: take it from the checkpoint.
        key = prefix + "joint_ema"
        if key in state_dict and state_dict[key].shape != self.joint_ema.shape:
            self.joint_ema = torch.empty_like(state_dict[key], device=self.joint_ema.device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def hfmca_costs(
    statistics: Sequence[CorrelationStatistics], costs: Sequence[HFMCACost]
) -> tuple[list[Tensor], CostChecks]:
    """The costs ``costs[i]`` of ``statistics[i]`` (already synchronised), all together, and their checks.

    Each value is a 0-dim float64 tensor with the cost's value and (with gradients enabled) its gradient: the
    exact one, or the adaptive filter's (:class:`HFMCACost`). The matrices of all costs are factored with one
    batched call per matrix size and nothing is read on the host: a failed factorisation gives meaningless
    values, and the returned :class:`CostChecks` say so when read (:meth:`CostChecks.raise_if_failed`).
    """
    if len(statistics) != len(costs) or not costs:
        raise ValueError(
            f"need one cost module per statistics; got {len(statistics)} statistics and {len(costs)} costs"
        )
    for stats, cost in zip(statistics, costs):
        if cost.filtering():
            cost.prepare_filter(stats)
    values, state, filters = cost_values(statistics, costs)
    apply_filter_updates(costs, filters)
    checks = CostChecks(
        state,
        tuple(cost.name for cost in costs),
        tuple((stats.low_dim, stats.high_dim) for stats in statistics),
        tuple(cost.reg for cost in costs),
    )
    return values, checks


@dataclass
class _Group:
    """Costs of equal dimensions, regulariser and filter setting, stacked: their sums ``(n, ., .)`` as given (with
    their autograd history), their counts ``(n,)`` (detached), and the matrices to factor."""

    positions: list[int]
    k1: int
    sums: tuple[Tensor, Tensor, Tensor]
    counts: tuple[Tensor, Tensor]
    matrices: list[Tensor]  # J, C (, J_hat, C_hat)
    candidate_ema: Tensor | None = None


class FilterUpdate(NamedTuple):
    """A filtered cost's adaptive-filter update (paper Alg. 3 lines 4-6): the EMA with this step's ``J`` taken in,
    ``candidate (K, K)``, and whether it is ``accepted`` (0-dim bool: the step's statistics were finite and its
    matrices factored). :func:`apply_filter_updates` writes it into the cost's buffers."""

    candidate: Tensor
    accepted: Tensor


class CostValues(NamedTuple):
    """The result of :func:`cost_values`: each cost's ``values`` (0-dim float64), their ``(N, 7)`` checks ``state``
    (columns :data:`~hfmca_lightning.losses.cost_checks.CHECK_COLUMNS`) and each cost's ``filters`` update (None
    for costs not filtering this step)."""

    values: list[Tensor]
    state: Tensor
    filters: list[FilterUpdate | None]


def cost_values(statistics: Sequence[CorrelationStatistics], costs: Sequence[HFMCACost]) -> CostValues:
    """The tensor work of :func:`hfmca_costs`. Static shapes, no host reads, no data-dependent Python and no writes
    to the costs' buffers (it compiles with ``torch.compile(fullgraph=True)`` and CUDA graphs): the adaptive
    filters' updates are returned, for :func:`apply_filter_updates`. Filters must have been sized
    (:meth:`HFMCACost.prepare_filter`)."""
    device = statistics[0].low_outer_sum.device
    with torch.autocast(device_type=device.type, enabled=False), torch.profiler.record_function("hfmca_costs"):
        keys: dict[tuple[int, int, float, float], list[int]] = {}
        for position, (stats, cost) in enumerate(zip(statistics, costs)):
            beta = cost.beta if cost.filtering() else 0.0
            keys.setdefault((stats.low_dim, stats.high_dim, cost.reg, beta), []).append(position)
        groups = [
            _group(positions, [statistics[p] for p in positions], [costs[p] for p in positions], reg, beta)
            for (_, _, reg, beta), positions in keys.items()
        ]
        factors = iter(cholesky_by_size([matrix for group in groups for matrix in group.matrices]))
        values: list[Tensor | None] = [None] * len(costs)
        states: list[Tensor | None] = [None] * len(costs)
        filters: list[FilterUpdate | None] = [None] * len(costs)
        for group in groups:
            group_values, group_state, accepted = _group_costs(group, [next(factors) for _ in group.matrices])
            for row, position in enumerate(group.positions):
                values[position], states[position] = group_values[row], group_state[row]
                if group.candidate_ema is not None:
                    filters[position] = FilterUpdate(group.candidate_ema[row], accepted[row])
        return CostValues(
            [value for value in values if value is not None],
            torch.stack([state for state in states if state is not None]),
            filters,
        )


def apply_filter_updates(costs: Sequence[HFMCACost], filters: Sequence[FilterUpdate | None]) -> None:
    """Write each filtered cost's accepted update into its buffers (on the device: a rejected one leaves them as
    they were). Copies the candidates at once, so they may be outputs of a CUDA graph that the next replay
    overwrites."""
    for cost, update in zip(costs, filters):
        if update is not None:
            cost.joint_ema.copy_(torch.where(update.accepted, update.candidate, cost.joint_ema))
            cost.num_updates.add_(update.accepted.to(cost.num_updates.dtype))


def _stack(tensors: list[Tensor]) -> Tensor:
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _group(
    positions: list[int], statistics: list[CorrelationStatistics], costs: list[HFMCACost], reg: float, beta: float
) -> _Group:
    """Stack the group's statistics and build ``J = [[A, P], [P^T, C]]`` and ``C`` (and, filtered, the bias-corrected
    EMA ``J_hat`` of paper Alg. 3 lines 4-7 with this step's ``J`` taken in, and its block ``C_hat``)."""
    low, high, cross = (
        _stack([getattr(stats, field) for stats in statistics])
        for field in ("low_outer_sum", "high_outer_sum", "cross_sum")
    )
    members, groups = (
        _stack([getattr(stats, field).detach() for stats in statistics]) for field in ("member_count", "group_count")
    )
    a = low.detach() / members[:, None, None]
    a.diagonal(dim1=-2, dim2=-1).add_(reg)
    c = high.detach() / groups[:, None, None]
    c.diagonal(dim1=-2, dim2=-1).add_(reg)
    p = cross.detach() / groups[:, None, None]
    joint = torch.cat([torch.cat([a, p], dim=-1), torch.cat([p.mT, c], dim=-1)], dim=-2)
    group = _Group(positions, low.shape[-1], (low, high, cross), (members, groups), [joint, c])
    if beta > 0:
        ema = _stack([cost.joint_ema for cost in costs])
        updates = _stack([cost.num_updates for cost in costs]) + 1
        group.candidate_ema = ema * beta + joint * (1.0 - beta)
        joint_hat = group.candidate_ema / (1.0 - torch.pow(beta, updates.to(torch.float64)))[:, None, None]
        group.matrices += [joint_hat, joint_hat[:, group.k1 :, group.k1 :].contiguous()]
    return group


def _failures(joint_info: Tensor, high_info: Tensor, k1: int) -> tuple[Tensor, Tensor, Tensor]:
    """The columns at which A, C and S failed (0: they did not), from the infos of the factors of J and C: a
    failure in J's first ``k1`` columns is A's, a later one the Schur complement's."""
    zero = torch.zeros_like(joint_info)
    return (
        torch.where(joint_info <= k1, joint_info, zero),
        high_info,
        torch.where(joint_info > k1, joint_info - k1, zero),
    )


def _group_costs(group: _Group, factors: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """Values ``(n,)``, checks ``(n, 7)`` and, for the filter, whether each cost's step is accepted ``(n,)`` bool
    (finite statistics whose exact matrices factored: CUDA's ``cholesky_ex`` reports success for NaN input, so the
    factorisation's info alone would let NaN into the EMA), from the factors of the group's matrices."""
    k1 = group.k1
    (joint_factor, joint_info), (high_factor, high_info) = factors[:2]
    exact = 2.0 * (
        torch.log(torch.diagonal(joint_factor[:, k1:, k1:], dim1=-2, dim2=-1)).sum(-1)
        - torch.log(torch.diagonal(high_factor, dim1=-2, dim2=-1)).sum(-1)
    )
    low, high, cross = group.sums
    finite = (
        torch.isfinite(low).flatten(1).all(1)
        & torch.isfinite(high).flatten(1).all(1)
        & torch.isfinite(cross).flatten(1).all(1)
    )
    columns = dict(zip(("low", "high", "schur"), _failures(joint_info, high_info, k1)))
    failed = (joint_info > 0) | (high_info > 0)
    accepted = ~failed & finite
    if group.candidate_ema is not None:  # filtered: the gradient at the smoothed matrices
        (joint_factor, joint_hat_info), (high_factor, high_hat_info) = factors[2:]
        smoothed = _failures(joint_hat_info, high_hat_info, k1)
        columns.update(zip(("smoothed_low", "smoothed_high", "smoothed_schur"), smoothed))
        failed = failed | (joint_hat_info > 0) | (high_hat_info > 0)
    else:
        columns.update(dict.fromkeys(("smoothed_low", "smoothed_high", "smoothed_schur"), torch.zeros_like(joint_info)))
    columns[NONFINITE] = (~finite).to(joint_info.dtype)
    state = check_state(columns)
    if not (torch.is_grad_enabled() and any(total.requires_grad for total in group.sums)):
        return exact, state, accepted
    gradients = _gradients(identity_where(failed, joint_factor), identity_where(failed, high_factor), k1)
    members, groups = group.counts
    low, high, cross = (
        (gradient * total).sum(dim=(-2, -1)) / count
        for gradient, total, count in zip(gradients, group.sums, (members, groups, groups))
    )
    surrogate = low + high + cross
    return exact + (surrogate - surrogate.detach()), state, accepted


def _gradients(joint_factor: Tensor, high_factor: Tensor, k1: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``logdet J - logdet A - logdet C`` w.r.t. ``A``, ``C`` and ``P`` at the factored matrices
    (for the filter: of the surrogate ``tr(J_hat^-1 J) - tr(A_hat^-1 A) - tr(C_hat^-1 C)``, the same thing at the
    smoothed ones). By the block inverse of ``J``: with ``X = A^-1 P = L_A^-T W`` and ``Y = X S^-1``, they are
    ``Y X^T`` (A), ``S^-1 - C^-1`` (C) and ``-2 Y`` (P, which appears twice in ``J``): one triangular solve and two
    inverses of size K2 per cost, batched over the group."""
    low_factor, coupling, schur_factor = (
        joint_factor[:, :k1, :k1],
        joint_factor[:, k1:, :k1].mT,
        joint_factor[:, k1:, k1:],
    )
    low_inv_cross = torch.linalg.solve_triangular(low_factor.mT, coupling, upper=True)
    inv_schur = inverse_from_factor(schur_factor)
    weighted = low_inv_cross @ inv_schur
    return weighted @ low_inv_cross.mT, inv_schur - inverse_from_factor(high_factor), weighted * -2.0


def cost_from_statistics(stats: CorrelationStatistics, *, reg: float = 0.1, name: str = "hfmca") -> Tensor:
    """The cost ``r = logdet J - logdet A - logdet C`` from statistics (paper Prop. 2).

    Args:
        stats: the statistics of one cost (:func:`group_statistics`, :func:`feature_map_statistics`), taken as
            those of the whole batch (not synchronised).
        reg: ``> 0``, added to the diagonal of both marginal blocks and inside the joint.
        name: named in error messages.

    Returns:
        0-dim float64 tensor ``r <= 0``, differentiable.

    Raises:
        ConfigurationError: when ``reg`` is not a finite number ``> 0``.
        CostFactorisationError: when a matrix of the cost is not positive definite.
    """
    return HFMCACost(check_reg(reg), name=name).eval().forward_statistics(stats, synchronised=True)


def hfmca_cost(low: Tensor, high: Tensor, *, reg: float = 0.1, sync_dist: bool = False, name: str = "hfmca") -> Tensor:
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

    Raises:
        ConfigurationError: when ``reg`` is not a finite number ``> 0``.
        ValueError: when ``low`` is not ``(M, L, K1)`` or ``high`` not ``(M, K2)`` with the same ``M``.
        CostFactorisationError: when a matrix of the cost is not positive definite (``reg`` too small, or
            features holding NaN or Inf).

    Example::

        low, high = torch.randn(64, 9, 32), torch.randn(64, 16)  # 9 views of 64 images, their group features
        cost = hfmca_cost(low, high, reg=0.1)  # 0-dim float64, <= 0: minimise it
    """
    check_reg(reg)
    stats = group_statistics(low, high)
    if sync_dist:
        stats = all_reduce_statistics(stats)
    return cost_from_statistics(stats, reg=reg, name=name)
