"""The failure checks of a step's costs, kept on the device until the caller reads them (docs/conventions.md §1).

Reading a device value on the host waits for the device's queue; a training step that read each cost's
factorisation check waited once per cost, before the backward pass was even queued. :class:`CostChecks` holds
every check of a step in one small integer tensor that is read once, where the caller chooses (the training
module: just before the optimizer step, after an all-reduce under DDP so that every rank stops together).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CostChecks", "CostFactorisationError", "MATRICES", "merge_checks"]


class CostFactorisationError(RuntimeError):
    """A matrix of an HFMCA cost is not positive definite, so its log-determinant does not exist."""


# The matrices of one cost whose factorisation can fail, in the order their failures are reported: a failed A
# makes the Schur complement S meaningless, and S <= C, so a failed C fails S too. The smoothed ones (adaptive
# filter, paper Alg. 3) come after the exact ones.
MATRICES = (
    "low-level matrix A = R1 + reg I",
    "high-level matrix C = R2 + reg I",
    "Schur complement C - P^T A^-1 P of the joint matrix J = [[A, P], [P^T, C]]",
    "smoothed low-level matrix A_hat = R1 + reg I",
    "smoothed high-level matrix C_hat = R2 + reg I",
    "Schur complement C - P^T A^-1 P of the smoothed joint matrix J_hat = [[A, P], [P^T, C]]",
)
NONFINITE = len(MATRICES)  # the column of ``state`` that flags statistics holding NaN or Inf


@dataclass(frozen=True)
class CostChecks:
    """Checks of ``len(names)`` costs on the device.

    ``state`` is ``(N, 7)`` int64: for each cost and each matrix of :data:`MATRICES` the column at which its
    Cholesky factorisation failed (0: it did not), then 1 if the cost's statistics hold NaN or Inf. ``total``
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
        if not bool(packed.any()):
            return
        raise self.error(packed)

    def error(self, packed: Tensor) -> CostFactorisationError:
        """The error for checks ``packed`` as :meth:`packed` lays them out (at least one failed)."""
        values = packed.tolist()
        width = NONFINITE + 1
        for position, name in enumerate(self.names):
            row = values[position * width : (position + 1) * width]
            for matrix, column in enumerate(row[:NONFINITE]):
                if column:
                    return _factorisation_error(
                        name, matrix, column, self.sizes[position], self.regs[position], finite=not row[NONFINITE]
                    )
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


def _factorisation_error(
    name: str, matrix: int, column: int, sizes: tuple[int, int], reg: float, *, finite: bool
) -> CostFactorisationError:
    size = sizes[0] if matrix % 3 == 0 else sizes[1]
    if finite:
        hint = f"increase `reg` (now {reg}) or check that the features are not exploding"
    else:
        hint = (
            "the features contain NaN or Inf values; check the learning rate and the input data, "
            "and keep the feature maps in float32 or bf16 (not float16) under mixed precision"
        )
    return CostFactorisationError(
        f"HFMCA cost '{name}': the {MATRICES[matrix]} ({size}x{size}) is not positive definite, so its "
        f"log-determinant is undefined (Cholesky failed at column {column}); {hint}"
    )
