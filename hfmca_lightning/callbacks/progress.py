"""``CostProgressBar``: the costs on the progress bar without waiting for the device; ``EpochLines``: a line per
epoch where a bar cannot be drawn (a log file, a pipe)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from torch import Tensor

from hfmca_lightning.diagnostics import host_buffer

__all__ = ["AsyncHostValues", "CostProgressBar", "EpochLines"]


class AsyncHostValues:
    """Device scalars brought to the host without a wait: each :meth:`push` starts a copy into pinned host memory
    (``non_blocking``) and records a CUDA event; :meth:`latest` gives the newest values whose copy has finished
    (``event.query()``, which never blocks), so on a GPU they trail the step being queued by the device's lag.
    Values on the CPU are available at once."""

    def __init__(self, keep: int = 16) -> None:
        self._pending: deque[tuple[list[str], Tensor, Any]] = deque(maxlen=keep)
        self._latest: dict[str, float] = {}

    def push_step(self, outputs: Any) -> None:
        """Start bringing a training step's ``"progress_bar"`` values to the host (nothing for other outputs)."""
        if isinstance(outputs, Mapping) and isinstance(outputs.get("progress_bar"), Mapping):
            self.push(outputs["progress_bar"])

    def push(self, values: Mapping[str, Tensor]) -> None:
        """Start bringing ``values`` (0-dim tensors, any device) to the host."""
        if not values:
            return
        names = list(values)
        stacked = torch.stack([values[name].detach().reshape(()).to(torch.float64) for name in names])
        if stacked.device.type != "cuda":  # on the host already
            self._pending.append((names, host_buffer(stacked), None))
            return
        host = host_buffer(torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True))
        host.copy_(stacked, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(stacked.device))
        self._pending.append((names, host, event))

    def latest(self) -> dict[str, float]:
        """The newest values that have arrived (an empty dict before the first)."""
        while self._pending and (self._pending[0][2] is None or self._pending[0][2].query()):
            names, host, _ = self._pending.popleft()
            self._latest = dict(zip(names, host.tolist()))
        return dict(self._latest)


class CostProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar that also shows the values a training step returns under ``"progress_bar"`` (the
    HFMCA modules return their external cost, or the total without one), brought to the host by
    :class:`AsyncHostValues`: on a GPU the bar shows the last value that has arrived, never waiting for the queue.
    Values logged with ``prog_bar=True`` show as usual (Lightning reads those on the host every step). The
    ``hfmca`` command adds this bar when standard output is a terminal (else :class:`EpochLines`), unless the
    trainer has another or ``enable_progress_bar: false``.

    Args:
        refresh_rate: as ``TQDMProgressBar``: update the bar every this many batches.
        process_position: as ``TQDMProgressBar``: the bar's line, for several bars at once.
        leave: as ``TQDMProgressBar``: keep each epoch's finished bar.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._values = AsyncHostValues()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._values.push_step(outputs)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return {**super().get_metrics(trainer, pl_module), **self._values.latest()}


class EpochLines(ProgressBar):
    """The progress of a run written to a log (a file or a pipe, where a bar's redraws pile up into one line): one line
    per training epoch, after its validation, with the epoch, the values a bar shows (the last step's cost from the
    step's ``"progress_bar"`` values, brought over as :class:`CostProgressBar` brings them; what is logged with
    ``prog_bar=True``, such as ``knn/top1``) and the epoch's seconds. The ``hfmca`` command uses it in place of the bar
    when standard output is not a terminal; nothing per step, nothing in ``validate`` and ``test`` (their table
    follows)."""

    def __init__(self) -> None:
        super().__init__()
        self._values = AsyncHostValues()
        self._enabled = True
        self._started = time.perf_counter()

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._enabled:
            self._values.push_step(outputs)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        metrics = {**self.get_metrics(trainer, pl_module), **self._values.latest()}
        metrics.pop("v_num", None)
        shown = ", ".join(
            f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}" for name, value in metrics.items()
        )
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        seconds = time.perf_counter() - self._started
        print(f"epoch {trainer.current_epoch + 1}{epochs}: {shown} ({seconds:.1f} s)", flush=True)
