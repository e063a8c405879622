"""PreemptionCheckpoint: ``last.ckpt`` is a resume point every ``every_n_train_steps`` steps, at every epoch's end and
when training ends (docs/training.md, docs/resume.md); its SIGTERM save at a step's end, also when the signal comes
between the micro-batches of an accumulated step (the resumed runs: tests/integration/test_resume.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

from hfmca_lightning.callbacks import PreemptionCheckpoint
from hfmca_lightning.runtime.checkpoint_io import read_checkpoint
from tests.helpers import quiet_trainer

STEPS_PER_EPOCH, EVERY = 7, 5


def epochs_of_seven_steps(epochs: int, *callbacks: Callback, validate: bool = True) -> Trainer:
    """A quiet trainer of ``epochs`` epochs of 7 steps (one validation batch each, unless not ``validate``) that
    writes checkpoints."""
    return quiet_trainer(
        max_epochs=epochs,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=int(validate),
        enable_checkpointing=True,
        callbacks=list(callbacks),
    )


class LastAtEpochStart(Callback):
    """The step that ``last.ckpt`` holds when each epoch after the first starts."""

    def __init__(self, last: Path) -> None:
        self.last, self.steps = last, []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch > 0:
            self.steps.append(read_checkpoint(self.last)["global_step"])


def test_last_checkpoint_at_every_step_interval_epoch_end_and_train_end(tmp_path: Path) -> None:
    last = tmp_path / "last.ckpt"
    saved_steps = []

    class Recording(PreemptionCheckpoint):
        def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
            super()._save_checkpoint(trainer, filepath)
            saved_steps.append((Path(filepath).name, trainer.global_step))

    probe = LastAtEpochStart(last)
    checkpoint = Recording(dirpath=tmp_path, save_last=True, every_n_train_steps=EVERY)
    trainer = epochs_of_seven_steps(3, probe, checkpoint)
    trainer.fit(BoringModel())
    # each epoch starts from last.ckpt of the epoch before's end (7, 14), not of its last 5-step save (5, 10)
    assert probe.steps == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert read_checkpoint(last)["global_step"] == 3 * STEPS_PER_EPOCH
    lasts = [step for name, step in saved_steps if name == "last.ckpt"]
    assert lasts == [5, 7, 10, 14, 15, 20, 21]  # every 5 steps and every epoch's end, each step once


def test_a_linked_last_checkpoint_is_linked_once_per_save_and_not_refreshed(tmp_path: Path) -> None:
    """``save_last="link"``: ``last.ckpt`` links to the newest saved checkpoint; an epoch's end adds no copy of its own
    (the state there is not saved) and no second link."""
    links = []

    class Recording(PreemptionCheckpoint):
        def _link_checkpoint(self, trainer: Trainer, filepath: str, linkpath: str) -> None:
            super()._link_checkpoint(trainer, filepath, linkpath)
            links.append((Path(filepath).name, trainer.global_step))

    checkpoint = Recording(dirpath=tmp_path, save_last="link", every_n_train_steps=EVERY)
    trainer = epochs_of_seven_steps(2, checkpoint)
    trainer.fit(BoringModel())
    assert len(links) == len(set(links))  # each link made once
    assert (tmp_path / "last.ckpt").is_symlink()
    assert (tmp_path / "last.ckpt").resolve() == (tmp_path / "epoch=1-step=10.ckpt").resolve()


class SigtermAfterStep(Callback):
    """Raises what Lightning's SIGTERM handler raises, after optimizer step ``step`` and the saves it made."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise SIGTERMException()


@pytest.mark.parametrize(("save_last", "step"), [(True, 6), ("link", 6), (True, EVERY)])
def test_sigterm_leaves_the_state_where_last_finds_it_and_says_where(tmp_path, save_last, step, monkeypatch):
    """``last.ckpt`` (a file, or with ``"link"`` a link to the checkpoint just written) holds the step the run stopped
    after, whether or not that step had just been saved; one line says where."""
    said: list[str] = []
    monkeypatch.setattr("hfmca_lightning.callbacks.checkpoint.rank_zero_info", said.append)
    checkpoint = PreemptionCheckpoint(dirpath=tmp_path, save_last=save_last, every_n_train_steps=EVERY)
    trainer = epochs_of_seven_steps(2, SigtermAfterStep(step), checkpoint, validate=False)
    with pytest.raises(SIGTERMException):
        trainer.fit(BoringModel())
    assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == step
    assert (tmp_path / "last.ckpt").is_symlink() == (save_last == "link")
    assert len(said) == 1 and said[0].startswith("SIGTERM:"), said
    assert f"after step {step}" in said[0] and str(tmp_path) in said[0], said


def test_positional_arguments_reach_model_checkpoint_by_name(tmp_path: Path) -> None:
    """Positional arguments keep ``ModelCheckpoint``'s order: a seventh one is ``save_on_exception`` (once, not a
    second value of it); left out, it is on; a name given twice is refused."""
    six = PreemptionCheckpoint(str(tmp_path), "{step}", "loss", False, True, 2)
    assert (six.dirpath, six.save_last, six.save_top_k, six.save_on_exception) == (str(tmp_path), True, 2, True)
    seven = PreemptionCheckpoint(str(tmp_path), "{step}", "loss", False, True, 2, False, True)
    assert (seven.save_on_exception, seven.save_weights_only) == (False, True)
    with pytest.raises(TypeError, match="save_last twice"):
        PreemptionCheckpoint(str(tmp_path), "{step}", None, False, True, save_last=False)


def test_a_setting_model_checkpoint_refuses_is_one_configuration_error(tmp_path: Path) -> None:
    """``ModelCheckpoint``'s own checks come as one ``ConfigurationError`` (one ``hfmca: error:`` line), not as
    Lightning's ``MisconfigurationException`` (a traceback in the CLI)."""
    from hfmca_lightning.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="PreemptionCheckpoint: Invalid value for every_n_train_steps=-1"):
        PreemptionCheckpoint(dirpath=tmp_path, every_n_train_steps=-1)


def test_save_on_exception_given_by_position_and_by_keyword_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="save_on_exception twice"):
        PreemptionCheckpoint(str(tmp_path), None, "loss", False, True, 1, True, save_on_exception=False)


class SigtermAtBatch(Callback):
    """Sends this process a real SIGTERM as training batch ``batch_idx`` starts, as SLURM's would arrive while the
    batch computes (Lightning's handler is installed during ``fit``; without it the test fails, it does not die)."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if batch_idx == self.batch_idx:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("batch_idx", [4, 5])  # the first micro-batch of step 3; its last
def test_sigterm_between_micro_batches_stops_after_the_step(tmp_path, batch_idx, monkeypatch):
    """``accumulate_grad_batches=2``: a SIGTERM during step 3's first micro-batch (batch 4) is held back until its
    second (batch 5) has stepped the optimiser, so the checkpoint holds no half-accumulated step: after step 3, with
    6 batches done, as for a SIGTERM during batch 5."""
    said: list[str] = []
    monkeypatch.setattr("hfmca_lightning.callbacks.checkpoint.rank_zero_info", said.append)
    checkpoint = PreemptionCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = quiet_trainer(
        max_epochs=2,
        limit_train_batches=8,
        limit_val_batches=0,
        accumulate_grad_batches=2,
        enable_checkpointing=True,
        callbacks=[SigtermAtBatch(batch_idx), checkpoint],
    )
    with pytest.raises(SIGTERMException):
        trainer.fit(BoringModel())
    saved = read_checkpoint(tmp_path / "last.ckpt")
    assert saved["global_step"] == 3
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"] == 6
    assert said == [f"SIGTERM: saved the state after step 3 to {tmp_path / 'last.ckpt'}"]
