"""``PreemptionCheckpoint``: Lightning's ``ModelCheckpoint`` that also saves when the run is told to stop."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.runtime.checkpoint_io import is_local
from hfmca_lightning.runtime.files import write_text_atomically

__all__ = ["NEWEST_NOTE", "PreemptionCheckpoint", "noted_checkpoint"]

# In the checkpoint folder of a PreemptionCheckpoint without save_last: the name of the newest file it saved.
NEWEST_NOTE = ".newest-checkpoint"


def noted_checkpoint(folder: str | Path) -> Path | None:
    """The newest checkpoint a :class:`PreemptionCheckpoint` without ``save_last`` saved into ``folder`` (on SIGTERM
    or as it saves; ``--ckpt_path last`` resumes it), or None where there is none (no note, or its file is gone)."""
    try:
        name = (Path(folder) / NEWEST_NOTE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    inside = Path(folder).resolve()
    path = (inside / name).resolve()
    if not name or inside not in path.parents or not path.is_file():  # a file of this folder (or below) only
        return None
    return Path(folder) / name


class PreemptionCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (all its arguments) that saves the state on SIGTERM (in ``last.ckpt`` with ``save_last``).

    SIGTERM is what SLURM, Kubernetes and spot instances send before they stop a job. Lightning's signal
    handler lets the current training step finish and then stops the run with ``SIGTERMException``; this
    callback saves at that point (``save_on_exception``), so ``--ckpt_path last`` continues exactly where
    the run stopped. Without ``save_last`` the checkpoint has the callback's ``filename``, and the folder's
    :data:`NEWEST_NOTE` names the newest checkpoint the callback saved (this one) for ``--ckpt_path last``. A
    SIGTERM between the micro-batches of an accumulated step (``accumulate_grad_batches > 1``) stops the run after
    that step's last micro-batch, once the optimiser has stepped: a checkpoint cannot hold half-accumulated
    gradients, and one written mid-step would resume without them. Unlike ``ModelCheckpoint(save_on_exception=True)``
    it saves on SIGTERM only: a run that fails (a ``CostFactorisationError`` after a NaN, an out-of-memory error)
    keeps its last good checkpoint instead of overwriting it with the state that failed.

    With ``save_last=True``, ``last.ckpt`` also holds the state at the end of every training epoch and when training
    ends between two ``every_n_train_steps`` saves (``ModelCheckpoint`` alone then leaves the last interval's state
    there): a resume point every ``every_n_train_steps`` steps and at every epoch's end.

    Args:
        *args: the arguments of ``ModelCheckpoint``, in its order (the seventh is ``save_on_exception``).
        save_on_exception: save when SIGTERM stops the run (``False``: do not).
        **kwargs: the keyword arguments of ``ModelCheckpoint`` (``dirpath``, ``every_n_train_steps``,
            ``save_last``, ...).
    """

    def __init__(self, *args: Any, save_on_exception: bool = True, **kwargs: Any) -> None:
        names = list(inspect.signature(ModelCheckpoint.__init__).parameters)[1:]
        if len(args) > len(names):
            raise TypeError(f"PreemptionCheckpoint takes at most {len(names)} positional arguments; got {len(args)}")
        positional = dict(zip(names, args))  # by name: a seventh one is save_on_exception, not a second value of it
        twice = sorted(positional.keys() & {*kwargs, *(["save_on_exception"] if save_on_exception is not True else [])})
        if twice:
            raise TypeError(f"PreemptionCheckpoint got {', '.join(twice)} twice, by position and by keyword")
        kwargs.update(positional, save_on_exception=positional.get("save_on_exception", save_on_exception))
        try:
            super().__init__(**kwargs)
        except MisconfigurationException as error:  # ModelCheckpoint's own checks: one line, as every setting's
            raise ConfigurationError(f"PreemptionCheckpoint: {error}") from None
        self._sigterm_deferred = False  # a SIGTERM came mid-accumulation: the run stops at the step's end

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Lightning stops the run after any batch that ends with SIGTERM received: here (just before its check), a
        SIGTERM received mid-accumulation is held back until the batch that ends the optimiser step (the epoch's last
        batch always does). Each process holds back its own signal alike (the processes step at the same batches)."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        signals = getattr(trainer, "_signal_connector", None)
        if signals is None or not self.save_on_exception:
            return
        if not trainer.fit_loop.epoch_loop._should_accumulate():  # this batch ended an optimiser step
            self._stop_if_deferred(trainer)
        elif signals.received_sigterm:
            signals.received_sigterm, self._sigterm_deferred = False, True

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._refresh_last(trainer)  # ModelCheckpoint does at an epoch's end only if it saved at that step
        self._stop_if_deferred(trainer)

    def _stop_if_deferred(self, trainer: Trainer) -> None:
        """The SIGTERM held back, received again: Lightning stops the run after this batch (or at the epoch's end,
        for a strategy that accumulates across it)."""
        signals = getattr(trainer, "_signal_connector", None)
        if self._sigterm_deferred and signals is not None:
            signals.received_sigterm, self._sigterm_deferred = True, False

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._refresh_last(trainer)  # ModelCheckpoint does at the end only if it never wrote last.ckpt

    def _refresh_last(self, trainer: Trainer) -> None:
        """Write ``last.ckpt`` unless this step is saved already (or nothing is saved: fast_dev_run, sanity checks,
        not fitting). Not with ``save_last="link"``: its ``last.ckpt`` links to the newest saved checkpoint."""
        if self.save_last is True and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved = trainer.global_step

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """On SIGTERM: the state in ``last.ckpt`` (``save_last=True``), or in a checkpoint of the callback's name
        (``last.ckpt`` linked to it with ``save_last="link"``; without ``save_last``, its name in the folder's
        :data:`NEWEST_NOTE`, where ``--ckpt_path last`` finds it), and one line saying where; a step saved already
        is not saved again, only said."""
        if not isinstance(exception, SIGTERMException) or not self.save_on_exception:
            return
        if not self._should_save_on_exception(trainer):  # this step is saved (or nothing is: fast_dev_run, sanity)
            path = self.last_model_path or self._last_checkpoint_saved
            if path and self._last_global_step_saved == trainer.global_step:
                rank_zero_info(f"SIGTERM: the state after step {trainer.global_step} is in {path}")
            return
        candidates = self._monitor_candidates(trainer)
        if self.save_last is True:
            self._save_last_checkpoint(trainer, candidates)
            path = self.last_model_path
        else:
            path = self.format_checkpoint_name(candidates)
            self._save_checkpoint(trainer, path)
            if self.save_last:  # "link": last.ckpt links to the file just written
                self._save_last_checkpoint(trainer, candidates)
        self._last_global_step_saved = trainer.global_step
        rank_zero_info(f"SIGTERM: saved the state after step {trainer.global_step} to {path}")

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """ModelCheckpoint's save; without ``save_last``, the file's name then goes into :data:`NEWEST_NOTE` beside it
        (process 0; a local folder): ``--ckpt_path last`` resumes the newest checkpoint saved, not a SIGTERM's that
        later saves have passed."""
        super()._save_checkpoint(trainer, filepath)
        if not self.save_last and trainer.is_global_zero and is_local(filepath):
            folder = Path(self.dirpath) if self.dirpath is not None else Path(filepath).parent
            name = os.path.relpath(filepath, folder)  # a filename with a sub-folder ("sub/{epoch}") keeps it
            write_text_atomically(folder / NEWEST_NOTE, f"{name}\n")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._sigterm_deferred = False  # a stop an earlier fit of this object held back is not this fit's
