"""Callbacks the tests insert into runs (configs name them ``tests.helpers.<Class>``): simulated failures, host-read
counters and a pause mid-training."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer

from hfmca_lightning.diagnostics import HostReads


class PoisonWeightsAtStep(Callback):
    """Simulates a diverging run: sets the first backbone weight to NaN before training step ``step`` (on process
    ``rank`` only, when given)."""

    def __init__(self, step: int = 5, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            with torch.no_grad():
                next(pl_module.backbone.parameters()).fill_(float("nan"))


class RaiseAtStep(Callback):
    """Simulates one process failing alone (a corrupt image, out of memory): raises before training step ``step`` on
    process ``rank``."""

    def __init__(self, step: int = 2, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            raise OSError(f"image 17 of the batch is unreadable (simulated on process {self.rank})")


class PoisonBatchAt(Callback):
    """NaN images in the batch of step ``step``; records the weights after every step and which steps ran."""

    def __init__(self, step: int) -> None:
        self.step, self.weights, self.steps_started = step, [], []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.steps_started.append(trainer.global_step)
        if trainer.global_step == self.step:
            batch[0].fill_(float("nan"))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.weights.append([p.detach().clone() for p in pl_module.parameters()])


class PoisonGradientAt(Callback):
    """One NaN in the first backbone gradient of step ``step``, after a backward pass whose loss was finite (a
    gradient that overflows on its own)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step == self.step:
            gradient = next(p.grad for p in pl_module.backbone.parameters() if p.grad is not None)
            gradient.view(-1)[0] = float("nan")


COUNTED_STEPS = range(2, 5)  # after the first steps' one-off work (caches, lazy buffers)


class CountHostReads(Callback):
    """Records host reads in steps ``COUNTED_STEPS``: ``until_optimizer`` from the start of each step (before
    ``training_step``) to the optimizer step (a callback's ``on_before_optimizer_step`` runs before the module's);
    ``whole`` from the start of the first counted step to the start of the step after the last (the module, every
    callback, the progress bar, Lightning's loop)."""

    def __init__(self) -> None:
        self.until_optimizer: list[str] = []
        self.whole = HostReads()
        self._step = HostReads()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if batch_idx == COUNTED_STEPS.start:
            self.whole.__enter__()
        elif batch_idx == COUNTED_STEPS.stop:
            self.whole.__exit__(None, None, None)
        if batch_idx in COUNTED_STEPS:
            self._step = HostReads()
            self._step.__enter__()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx in COUNTED_STEPS:
            self._step.__exit__(None, None, None)
            self.until_optimizer += self._step.reads or ["(none)"]


class PauseBeforeStep(Callback):
    """Holds the run before training step ``step`` until the file ``resume`` exists (a test acts on a run known to be
    mid-training, then lets it go on); creates ``<resume>.waiting`` when it starts to wait."""

    def __init__(self, resume: str, step: int = 1, timeout_s: float = 120.0) -> None:
        self.resume, self.step, self.timeout_s = Path(resume), step, timeout_s

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.global_step != self.step or self.resume.exists():
            return
        self.resume.with_name(self.resume.name + ".waiting").touch()
        deadline = time.monotonic() + self.timeout_s
        while not self.resume.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
