"""A training step that fails its checks is skipped on the device and reported a step later, so that no training step
waits for the device (docs/conventions.md §1, failures).

Reading a step's checks before its optimizer step would drain the GPU's queue once per step. Instead the update
is made conditional on the device (:class:`SkipUpdateIfFailed`), the checks travel to the host by an asynchronous
copy (:class:`DeferredChecks`), and they are read once the next step has been queued, or before anything is saved or
evaluated: a failed step then still ends the run with its one-line error, and no checkpoint is written after it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from hfmca_lightning.diagnostics import host_buffer
from hfmca_lightning.losses.cost_checks import CostChecks, CostFactorisationError

__all__ = [
    "DeferredChecks",
    "FailedStep",
    "NonFiniteStepError",
    "SkipUpdateIfFailed",
    "copy_to_host",
    "nonfinite_gradients",
    "training_stopped_at",
]


class NonFiniteStepError(RuntimeError):
    """A training step's loss or gradients were NaN or Inf (its update was skipped)."""


@dataclass
class FailedStep:
    """The first failed step among those read: its optimizer step and epoch and the error its checks give."""

    step: int
    epoch: int
    error: CostFactorisationError | NonFiniteStepError


@dataclass
class _Pending:
    step: int
    epoch: int
    checks: CostChecks
    host: Tensor
    event: Any
    gradient_flag: bool


def training_stopped_at(step: int, epoch: int) -> str:
    """Where a failed step stopped training, as the user reads it elsewhere: the epoch counted from 1, as the progress
    lines count it, and from 0, as checkpoint names (``epoch=0-step=5.ckpt``) and Lightning's bar count it."""
    return f"training stopped at step {step}, in epoch {epoch + 1} (epoch={epoch} in checkpoint names)"


def nonfinite_gradients(optimizer: Optimizer) -> Tensor | None:
    """``(1,)`` int32 on the gradients' device: 1 where a gradient of ``optimizer``'s parameters holds NaN or Inf
    (from the gradients' largest magnitude, which is finite wherever their values are: a 2-norm of finite float16
    values can overflow); None without gradients. Nothing is read on the host."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
    if not gradients:
        return None
    largest = torch.nn.utils.get_total_norm(gradients, float("inf"))
    return (~torch.isfinite(largest)).to(torch.int32).reshape(1)


def copy_to_host(value: Tensor) -> tuple[Tensor, Any]:
    """``(host, event)``: an asynchronous copy of a CUDA tensor into pinned memory and the CUDA event after which
    ``host`` holds it (``event.synchronize()`` waits for the copy, not for the device's queue); on other devices the
    value itself and no event."""
    if value.device.type != "cuda":
        return host_buffer(value), None
    host = host_buffer(torch.empty(value.shape, dtype=value.dtype, pin_memory=True))
    host.copy_(value, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(value.device))
    return host, event


class DeferredChecks:
    """Checks of optimizer steps on their way to the host: :meth:`push` starts an asynchronous copy of a step's
    packed checks (``non_blocking`` into pinned memory, with a CUDA event; on other devices the values are on the
    host already), :meth:`first_failure` waits for the copies pushed so far (the events, not the device's queue)
    and decodes them."""

    def __init__(self) -> None:
        self._pending: deque[_Pending] = deque()
        self._failure: FailedStep | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, checks: CostChecks, packed: Tensor, step: int, epoch: int, gradient_flag: bool = False) -> None:
        """Start bringing ``packed`` (``checks.packed()``, possibly reduced over processes; with ``gradient_flag``
        followed by the flag of :func:`nonfinite_gradients`) to the host."""
        host, event = copy_to_host(packed)
        self._pending.append(_Pending(step, epoch, checks, host, event, gradient_flag))

    def first_failure(self) -> FailedStep | None:
        """Read every pushed step's checks (waiting for their copies only) and forget them; the first failed step, or
        None. A failure, once read, is given at every later read too: the failed step's forward pass may have left
        non-finite BatchNorm statistics, so nothing after it (a save on exception) may write the model's state."""
        failure = self._failure
        while self._pending:
            pending = self._pending.popleft()
            if pending.event is not None:
                pending.event.synchronize()
            values = pending.host.tolist()
            gradients_failed = pending.gradient_flag and bool(values.pop())
            if failure is None and any(values):
                failure = FailedStep(pending.step, pending.epoch, pending.checks.error(values))
            elif failure is None and gradients_failed:
                error = NonFiniteStepError("the gradients are not finite (NaN or Inf) although every cost is")
                failure = FailedStep(pending.step, pending.epoch, error)
        self._failure = failure
        return failure


class SkipUpdateIfFailed:
    """Makes an optimizer step leave the parameters and the optimizer's state as they were where a device flag says
    the step failed, without reading the flag on the host.

    :meth:`arm` (after the backward pass, before the update) and :meth:`finish` (after ``optimizer.step``) bracket the
    update. torch's fused optimizers (``fused=True``: SGD, Adam, AdamW, Adagrad) skip it in their own kernel, from the
    ``found_inf`` tensor mixed precision's gradient scaler uses; any other optimizer's parameters and state tensors
    are copied before the update and copied back where the flag is set (one copy of the model and its state per
    step). What such an optimizer keeps on the host (Adam's step count without ``capturable``) and the state its first
    step creates are not restored: a failed step ends the run a step later, before anything is saved.
    """

    def __init__(self) -> None:
        self._optimizer: Optimizer | None = None
        self._failed: Tensor | None = None
        self._saved: list[tuple[Tensor, Tensor]] = []

    @staticmethod
    def skips_in_kernel(optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` is a torch fused optimizer, which skips its update on a ``found_inf`` tensor."""
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
            group.get("fused", False) for group in optimizer.param_groups
        )

    def arm(self, optimizer: Optimizer, failed: Tensor, in_kernel: bool = True) -> None:
        """Guard the next ``optimizer.step()`` by ``failed`` (0-dim bool, on the parameters' device). ``in_kernel``:
        use the fused optimizers' ``found_inf`` (off where something else sets it, such as a gradient scaler)."""
        self.finish()
        self._optimizer, self._failed = optimizer, failed
        if in_kernel and self.skips_in_kernel(optimizer):
            optimizer.found_inf = failed.to(torch.float32)  # type: ignore[attr-defined]  # read by the fused step
            return
        tensors = [
            tensor
            for group in optimizer.param_groups
            for parameter in group["params"]
            if parameter.grad is not None
            for tensor in (parameter, *optimizer.state.get(parameter, {}).values())
            if isinstance(tensor, Tensor) and tensor.device == failed.device and tensor.is_floating_point()
        ]
        self._saved = list(zip(tensors, torch._foreach_mul(tensors, 1.0))) if tensors else []

    def finish(self) -> None:
        """After the guarded step: restore what a failed step changed; disarm."""
        optimizer, failed = self._optimizer, self._failed
        if optimizer is not None and hasattr(optimizer, "found_inf"):
            del optimizer.found_inf
        if failed is not None and self._saved:
            with torch.no_grad():
                for tensor, saved in self._saved:
                    tensor.copy_(torch.where(failed, saved, tensor))
        self._optimizer, self._failed, self._saved = None, None, []
