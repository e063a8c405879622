"""``PreemptionCheckpoint``: Lightning's ``ModelCheckpoint`` that also saves when the run is told to stop."""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from hfmca_lightning.errors import ConfigurationError

__all__ = ["PreemptionCheckpoint"]


class PreemptionCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (all its arguments) that saves the state on SIGTERM (in ``last.ckpt`` with ``save_last``).

    SIGTERM is what SLURM, Kubernetes and spot instances send before they stop a job. Lightning's signal
    handler lets the current training step finish and then stops the run with ``SIGTERMException``; this
    callback saves at that point (``save_on_exception``), so ``--ckpt_path last`` continues exactly where
    the run stopped. Unlike ``ModelCheckpoint(save_on_exception=True)`` it saves on SIGTERM only: a run
    that fails (a ``CostFactorisationError`` after a NaN, an out-of-memory error) keeps its last good
    checkpoint instead of overwriting it with the state that failed.

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

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._refresh_last(trainer)  # ModelCheckpoint does at an epoch's end only if it saved at that step

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
        (``last.ckpt`` linked to it with ``save_last="link"``), and one line saying where; a step saved already is
        not saved again, only said."""
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
