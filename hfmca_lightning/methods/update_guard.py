"""Updates guarded against non-finite losses and gradients, for methods without HFMCA's cost checks (the baselines).

A diverging run (a learning rate far too large) makes its loss or gradients NaN or Inf; one update then makes every
weight non-finite, and the checkpoints written after it, rotated over the good ones, hold nothing usable. Here each
optimizer step's loss and gradient norms are checked on the device, the update is skipped where they are not finite
(:class:`~hfmca_lightning.methods.deferred_checks.SkipUpdateIfFailed`), and the flag travels to the host by an
asynchronous copy, read once the next step is queued or before anything is saved or evaluated: the run then stops with
one line (:class:`NonFiniteStepError`), and no checkpoint is written after the failed step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from hfmca_lightning.losses.distributed import all_reduce_max
from hfmca_lightning.methods.deferred_checks import (
    NonFiniteStepError,
    SkipUpdateIfFailed,
    copy_to_host,
    nonfinite_gradients,
    training_stopped_at,
)

__all__ = ["NonFiniteStepError", "NonFiniteUpdateGuard", "raise_if_a_step_failed_in"]


def raise_if_a_step_failed_in(module: object) -> None:
    """Raise the error of ``module``'s first failed update since the last read, where the module reads them
    (``HFMCAModule``'s and the baselines' ``raise_if_a_step_failed``; other modules have none): callbacks call it
    before they decompose a step's features, so a failed step ends the run in one line, not in a decomposition."""
    read = getattr(module, "raise_if_a_step_failed", None)
    if callable(read):
        read()


class NonFiniteUpdateGuard:
    """The guard of one module's optimizer steps: :meth:`add_loss` in each training step, :meth:`before_update` in
    ``on_before_optimizer_step``, :meth:`after_update` after ``optimizer.step``, :meth:`raise_if_a_step_failed` before
    a checkpoint is written, validation starts or training ends."""

    def __init__(self, method: str) -> None:
        self.method = method
        self._losses: list[Tensor] = []
        self._pending: deque[tuple[int, int, Tensor, Any]] = deque()
        self._skip = SkipUpdateIfFailed()
        self._failed_at: tuple[int, int] | None = None  # (step, epoch) of the first failed update, once read

    def add_loss(self, loss: Tensor) -> None:
        """A micro-batch's loss (detached) of the step being taken."""
        self._losses.append(loss.detach())

    def before_update(self, optimizer: Optimizer, step: int, epoch: int, gradient_scaler: bool = False) -> None:
        """Read the previous steps' flags (raising the first failure), then guard this step's update: failed where a
        loss or, without a gradient scaler (which skips steps with non-finite gradients itself), a gradient is not
        finite, on any process. No device value is read on the host."""
        self.raise_if_a_step_failed()
        if not self._losses:
            return
        losses, self._losses = torch.cat([loss.float().reshape(-1) for loss in self._losses]), []
        flags = [(~torch.isfinite(losses)).any().to(torch.int32).reshape(1)]
        gradients = None if gradient_scaler else nonfinite_gradients(optimizer)
        if gradients is not None:
            flags.append(gradients)
        failed = all_reduce_max(torch.cat(flags).amax()).bool()
        self._pending.append((step, epoch, *copy_to_host(failed)))
        self._skip.arm(optimizer, failed, in_kernel=not gradient_scaler)

    def after_update(self) -> None:
        self._skip.finish()

    def raise_if_a_step_failed(self) -> None:
        """Read the flags of the steps taken since the last read (waiting for their copies, not for the device's
        queue); raise :class:`NonFiniteStepError` for the first that failed, and again at every later call (the failed
        step's forward pass may have left non-finite BatchNorm statistics: no later save may write them)."""
        failure = self._failed_at
        while self._pending:
            step, epoch, host, event = self._pending.popleft()
            if event is not None:
                event.synchronize()
            if failure is None and bool(host):
                failure = (step, epoch)
        if failure is not None:
            self._failed_at = step, epoch = failure
            raise NonFiniteStepError(
                f"{training_stopped_at(step, epoch)}: {self.method}'s loss or gradients are not finite "
                "(NaN or Inf) and its update was skipped. Checkpoints written before this step are intact: resume "
                "from one with a lower learning rate."
            )
