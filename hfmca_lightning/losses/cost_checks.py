"""The failure checks of a step's costs, kept on the device until the caller reads them (docs/conventions.md §1).

Reading a device value on the host waits for the device's queue; a training step that read each cost's
factorisation check waited once per cost, before the backward pass was even queued. :class:`CostChecks` holds
every check of a step in one small integer tensor that is read once, where the caller chooses (the training
module: max-reduced over processes on the device, where it guards the update, then copied to the host
asynchronously and read once the next step is queued, or before a checkpoint, validation or the end of training).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "CHECK_COLUMNS",
    "CheckedMatrix",
    "CostChecks",
    "CostFactorisationError",
    "MATRICES",
    "NONFINITE",
    "check_state",
    "merge_checks",
]


class CostFactorisationError(RuntimeError):
    """A matrix of an HFMCA cost is not positive definite, so its log-determinant does not exist."""


@dataclass(frozen=True)
class CheckedMatrix:
    """A matrix of one cost whose factorisation can fail: its ``column`` in the checks, what it is (for messages)
    and which of the cost's dimensions (``low``: K1, ``high``: K2) it has."""

    column: str
    description: str
    dimension: Literal["low", "high"]


# In the order their failures are reported: a failed A makes the Schur complement S meaningless, and S <= C, so a
# failed C fails S too. The smoothed ones (adaptive filter, paper Alg. 3) come after the exact ones.
MATRICES = (
    CheckedMatrix("low", "low-level matrix A = R1 + reg I", "low"),
    CheckedMatrix("high", "high-level matrix C = R2 + reg I", "high"),
    CheckedMatrix("schur", "Schur complement C - P^T A^-1 P of the joint matrix J = [[A, P], [P^T, C]]", "high"),
    CheckedMatrix("smoothed_low", "smoothed low-level matrix A_hat = R1 + reg I", "low"),
    CheckedMatrix("smoothed_high", "smoothed high-level matrix C_hat = R2 + reg I", "high"),
    CheckedMatrix(
        "smoothed_schur",
        "Schur complement C - P^T A^-1 P of the smoothed joint matrix J_hat = [[A, P], [P^T, C]]",
        "high",
    ),
)
NONFINITE = "nonfinite"  # 1 where the cost's statistics hold NaN or Inf
CHECK_COLUMNS = (*(matrix.column for matrix in MATRICES), NONFINITE)
"""The columns of :attr:`CostChecks.state`, by name: each matrix's failed Cholesky column (0: it did not fail), then
the non-finite flag."""


def check_state(columns: Mapping[str, Tensor]) -> Tensor:
    """``(N, len(CHECK_COLUMNS))`` int64 checks of ``N`` costs from their columns by name (each ``(N,)``)."""
    if set(columns) != set(CHECK_COLUMNS):
        raise ValueError(f"need the check columns {CHECK_COLUMNS}; got {sorted(columns)}")
    return torch.stack([columns[name] for name in CHECK_COLUMNS], dim=1).to(torch.int64)


@dataclass(frozen=True)
class CostChecks:
    """Checks of ``len(names)`` costs on the device.

    ``state`` is ``(N, 7)`` int64 with the columns :data:`CHECK_COLUMNS`: for each cost and each matrix of
    :data:`MATRICES` the column at which its Cholesky factorisation failed (0: it did not), then 1 if the cost's
    statistics hold NaN or Inf (:func:`check_state` builds it by column name). ``total``
    is ``()`` int64, 1 if the total the costs were added into is not finite (``None``: no total checked).
    ``sizes`` are each cost's ``(K1, K2)``, ``regs`` its regulariser (for the messages).
    """

    state: Tensor
    names: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...]
    regs: tuple[float, ...]
    total: Tensor | None = None

    def with_total(self, total: Tensor) -> CostChecks:
        """These checks and the finiteness of ``total`` (0-dim), the sum the costs were added into."""
        flag = (~torch.isfinite(total)).to(torch.int64).reshape(())
        return CostChecks(self.state, self.names, self.sizes, self.regs, flag)

    def packed(self) -> Tensor:
        """Every check as one flat int64 tensor (what :meth:`raise_if_failed` reads, and all-reduces with max)."""
        parts = [self.state.reshape(-1)]
        if self.total is not None:
            parts.append(self.total.reshape(1))
        return torch.cat(parts)

    def raise_if_failed(self, reduce: Callable[[Tensor], Tensor] | None = None) -> None:
        """One host read of the checks (after ``reduce``, e.g. a max over all ranks); raise the
        :class:`CostFactorisationError` of the first failure, cost by cost, in the order of :data:`MATRICES`."""
        packed = self.packed()
        if reduce is not None:
            packed = reduce(packed)
        values = packed.tolist()  # the one host read
        if any(values):
            raise self.error(values)

    def error(self, packed: Tensor | Sequence[int]) -> CostFactorisationError:
        """The error for checks ``packed`` as :meth:`packed` lays them out (at least one failed), a tensor or its
        values."""
        values = packed.tolist() if isinstance(packed, Tensor) else list(packed)
        width = len(CHECK_COLUMNS)
        for position, name in enumerate(self.names):
            row = dict(zip(CHECK_COLUMNS, values[position * width : (position + 1) * width]))
            for matrix in MATRICES:
                if row[matrix.column]:
                    return _factorisation_error(
                        name,
                        matrix,
                        row[matrix.column],
                        self.sizes[position],
                        self.regs[position],
                        finite=not row[NONFINITE],
                    )
            if row[NONFINITE]:  # a device whose factorisation reports success on NaN input (CUDA)
                return CostFactorisationError(f"HFMCA cost '{name}': its statistics hold NaN or Inf; {_NONFINITE_HINT}")
        return CostFactorisationError("the total cost is not finite (features or weights hold NaN or Inf)")


def merge_checks(checks: Sequence[CostChecks]) -> CostChecks:
    """Several steps' checks of the same costs as one (gradient accumulation): a failure in any of them."""
    first = checks[0]
    if len(checks) == 1:
        return first
    state = torch.stack([check.state for check in checks]).amax(dim=0)
    totals = [check.total for check in checks if check.total is not None]
    total = torch.stack(totals).amax() if totals else None
    return CostChecks(state, first.names, first.sizes, first.regs, total)


_NONFINITE_HINT = (
    "the features contain NaN or Inf values; check the learning rate and the input data, "
    "and keep the feature maps in float32 or bf16 (not float16) under mixed precision"
)


def _factorisation_error(
    name: str, matrix: CheckedMatrix, column: int, sizes: tuple[int, int], reg: float, *, finite: bool
) -> CostFactorisationError:
    size = sizes[0] if matrix.dimension == "low" else sizes[1]
    hint = f"increase `reg` (now {reg}) or check that the features are not exploding" if finite else _NONFINITE_HINT
    return CostFactorisationError(
        f"HFMCA cost '{name}': the {matrix.description} ({size}x{size}) is not positive definite, so its "
        f"log-determinant is undefined (Cholesky failed at column {column}); {hint}"
    )
