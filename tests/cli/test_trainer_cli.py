"""``hfmca fit`` and its run folders: one run per checkpoint folder at a time (a live run's folder refused, a killed
run's lock taken over, also while its orphaned data-loader workers live on), ``--ckpt_path last`` from this run's
folder only (``last.ckpt``, or the checkpoint a ``PreemptionCheckpoint`` without ``save_last`` wrote on SIGTERM), a
weights-only checkpoint refused by ``fit --ckpt_path`` in one line, ``config.yaml`` replaced whole."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from hfmca_lightning.callbacks.checkpoint import NEWEST_NOTE
from hfmca_lightning.cli import main
from tests.helpers import DEMO, finish_hfmca, fit, run_hfmca, start_hfmca, tiny_overrides, wait_for
from tests.helpers.runs import group_processes


def fit_args(folder: Path, **extra: object) -> list[str]:
    return ["fit", "--config", str(DEMO), "--config", str(tiny_overrides(folder, **extra))]


def paused_run_args(folder: Path, step: int, max_epochs: int = 1, **extra: object) -> list[str]:
    """The tiny demo (4 steps per epoch), held before training step ``step`` until ``folder / "go"`` exists."""
    callbacks = yaml.safe_load((tiny_overrides(folder)).read_text())["trainer"]["callbacks"]
    pause = {"class_path": "tests.helpers.PauseBeforeStep", "init_args": {"resume": str(folder / "go"), "step": step}}
    return fit_args(folder, **{"trainer.callbacks": [*callbacks, pause], "trainer.max_epochs": max_epochs, **extra})


def step_of(checkpoint: Path) -> int:
    return int(torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"])


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("hfmca: error: ")]


@pytest.mark.extended
@pytest.mark.integration  # subprocess runs
def test_a_second_fit_into_a_running_runs_folder_is_refused_and_the_first_finishes(tmp_path):
    args = paused_run_args(tmp_path, step=2)
    first = start_hfmca(tmp_path, *args, log_name="first.log", test_classes=True)
    try:
        wait_for((tmp_path / "go.waiting").exists, first)  # mid-training, its folder locked
        assert (tmp_path / ".checkpoints.lock").is_file()
        second = run_hfmca(tmp_path, *args, log_name="second.log", test_classes=True, timeout=120)
    finally:
        (tmp_path / "go").touch()
    first_run = finish_hfmca(first, tmp_path, log_name="first.log")

    assert second.returncode == 2, second.stdout[-3000:]
    [line] = error_lines(second.stdout)
    assert f"checkpoint folder {tmp_path / 'checkpoints'} is in use by another `hfmca fit` (pid {first.pid}" in line
    assert "Traceback" not in second.stdout
    assert first_run.returncode == 0, first_run.stdout[-3000:]
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 4  # the whole epoch, undisturbed
    assert [path.name for path in (tmp_path / "logs" / "run").iterdir()] == ["version_0"]  # the second wrote nothing


@pytest.mark.extended
@pytest.mark.integration  # subprocess runs
@pytest.mark.parametrize("killed_alone", [False, True])
def test_the_lock_of_a_killed_run_is_taken_over_by_its_resume(tmp_path, killed_alone):
    """SIGKILL to the run's process group, or to its main process alone (the OOM killer's choice), whose 2 persistent
    data-loader workers live on for seconds: the resume started at once takes the folder over."""
    workers = {"data.init_args.num_workers": 2, "data.init_args.persistent_workers": True} if killed_alone else {}
    # held after the first epoch's checkpoint (step 4)
    args = paused_run_args(tmp_path, step=6, max_epochs=2, **workers)
    killed = start_hfmca(tmp_path, *args, log_name="killed.log", test_classes=True)
    wait_for((tmp_path / "go.waiting").exists, killed)
    workers = [pid for pid in group_processes(killed.pid) if pid != killed.pid]
    assert bool(workers) == killed_alone  # (persistent workers of the training and evaluation loaders)
    if killed_alone:
        os.kill(killed.pid, signal.SIGKILL)
    else:
        os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert (tmp_path / ".checkpoints.lock").read_text().split()[0] == str(killed.pid)  # left behind
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 4

    (tmp_path / "go").touch()
    resumed = run_hfmca(tmp_path, *args, "--ckpt_path", "last", log_name="resumed.log", test_classes=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert error_lines(resumed.stdout) == []
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 8


@pytest.mark.extended
@pytest.mark.integration  # a subprocess run
def test_resume_with_last_reads_only_this_runs_folder(tmp_path):
    """Run A keeps its best checkpoints in a folder that run B, of another model, writes its ``last.ckpt`` into;
    B's newer ``last.ckpt`` there is not A's to resume."""
    shared = tmp_path / "shared"
    run_a = tmp_path / "a"
    own = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}
    own["init_args"]["dirpath"] = str(run_a / "checkpoints")
    best = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(shared), "filename": "a-{epoch}", "every_n_train_steps": 4},
    }
    fit(run_a, **{"trainer.callbacks": [own, best]})  # one epoch
    assert step_of(run_a / "checkpoints" / "last.ckpt") == 4
    other = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(shared)}}
    other["init_args"]["save_last"] = True
    smaller = {"width": 4, "num_stages": 3}  # another architecture, with the same feature size
    fit(
        tmp_path / "b",
        "--trainer.max_epochs",
        "2",
        **{"trainer.callbacks": [other], "model.init_args.backbone.init_args": smaller},
    )
    assert step_of(shared / "last.ckpt") == 8
    assert (shared / "last.ckpt").stat().st_mtime > (run_a / "checkpoints" / "last.ckpt").stat().st_mtime

    a_args = fit_args(run_a, **{"trainer.callbacks": [own, best], "trainer.max_epochs": 2})  # one epoch more
    resumed = run_hfmca(tmp_path, *a_args, "--ckpt_path", "last", log_name="resumed.log")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert step_of(run_a / "checkpoints" / "last.ckpt") == 8  # A's epoch 2, trained from A's step 4
    assert step_of(shared / "last.ckpt") == 8 and list(shared.glob("a-epoch=1*.ckpt"))


@pytest.mark.filterwarnings("ignore:Experiment logs directory .* exists and is not empty")
def test_config_yaml_is_replaced_whole(tmp_path):
    """The run's ``config.yaml`` is a new file renamed over the old one, never the old file rewritten in place (what a
    kill mid-write would leave truncated): a hard link to the old file keeps the old text."""
    log_dir = tmp_path / "logs" / "run" / "fixed"
    log_dir.mkdir(parents=True)
    (log_dir / "config.yaml").write_text("old: true\n")
    os.link(log_dir / "config.yaml", tmp_path / "old_config.yaml")
    fit(tmp_path, **{"trainer.logger.init_args.version": "fixed"})
    written = yaml.safe_load((log_dir / "config.yaml").read_text())
    assert written["model"]["init_args"]["backbone"]["init_args"]["width"] == 8
    assert (tmp_path / "old_config.yaml").read_text() == "old: true\n"
    assert [path.name for path in log_dir.iterdir() if path.name.endswith(".partial")] == []


def test_last_is_the_newest_last_or_versioned_last_in_this_runs_last_folders(tmp_path):
    """``--ckpt_path last`` (docs/resume.md): the newest of ``last.ckpt`` and ``last-vN.ckpt`` in the folders of the
    callbacks with ``save_last``; not a newer best checkpoint beside them, nor a newer ``last.ckpt`` in a folder this
    run only keeps its best checkpoints in; None when there is none."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hfmca_lightning.cli.trainer_cli import newest_last_checkpoint
    from tests.helpers import quiet_trainer

    own, best_only = tmp_path / "own", tmp_path / "best"
    trainer = quiet_trainer(
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=own, save_last=True), ModelCheckpoint(dirpath=best_only, monitor="loss")],
    )
    assert newest_last_checkpoint(trainer) is None
    own.mkdir()
    best_only.mkdir()
    for age, path in enumerate(
        [own / "last.ckpt", own / "last-v1.ckpt", own / "last-v2.ckpt.partial", own / "epoch=3-step=8.ckpt"]
        + [best_only / "last.ckpt", own / "lastly.ckpt"]
    ):
        path.write_bytes(b"")
        os.utime(path, (1_000 + age, 1_000 + age))  # each newer than the one before
    assert newest_last_checkpoint(trainer) == own / "last-v1.ckpt"


def test_last_as_a_dangling_link_resumes_from_the_newest_checkpoint_of_its_folder(tmp_path):
    """``save_last: link``: Lightning deletes the checkpoint ``last.ckpt`` links to before it links the next, so a kill
    in between leaves the link dangling. ``--ckpt_path last`` then goes on from the newest checkpoint of that folder,
    with a warning naming it, instead of starting over."""
    checkpoints = tmp_path / "checkpoints"
    linked = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(checkpoints), "save_last": "link", "save_top_k": -1, "every_n_train_steps": 2},
    }
    fit(tmp_path, **{"trainer.callbacks": [linked]})  # one epoch: 4 steps
    assert os.readlink(checkpoints / "last.ckpt") == "epoch=0-step=4.ckpt"
    (checkpoints / "epoch=0-step=4.ckpt").unlink()
    with pytest.warns(Warning, match=r"last.ckpt links to epoch=0-step=4.ckpt, which is gone .* epoch=0-step=2.ckpt"):
        fit(tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "last", **{"trainer.callbacks": [linked]})
    # trained on from step 2: step 4 redone, and the newest last (Lightning names it last-v1.ckpt) at step 8
    assert (checkpoints / "epoch=0-step=4.ckpt").is_file()
    assert max(step_of(path) for path in checkpoints.glob("last*.ckpt")) == 8


@pytest.mark.parametrize(
    ("level", "terminal", "bar"),
    [("default", True, "CostProgressBar"), ("default", False, "EpochLines"), ("quiet", True, None)],
)
def test_the_progress_report_follows_the_output_and_the_verbosity(tmp_path, monkeypatch, level, terminal, bar):
    """docs/getting-started.md: a bar on a terminal, a line per epoch in a log file or a pipe, nothing with -q."""
    import hfmca_lightning.cli.verbosity as verbosity
    from hfmca_lightning.cli.trainer_cli import HFMCACLI

    monkeypatch.setattr(verbosity, "draws_bars", lambda stream: terminal)
    monkeypatch.setattr(verbosity, "_level", level)
    monkeypatch.chdir(tmp_path)
    cli = HFMCACLI(args=fit_args(tmp_path, **{"trainer.enable_progress_bar": True})[1:], run=False)
    shown = cli.trainer.progress_bar_callback
    assert (type(shown).__name__ if shown is not None else None) == bar


class SigtermAtBatch(Callback):
    """Sends this process a real SIGTERM as training batch ``at_batch`` of the run (counted over epochs from 0)
    starts, as a cluster's would arrive while the batch computes (once: a resumed run starts after it)."""

    def __init__(self, at_batch: int) -> None:
        self.at_batch = at_batch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_without_save_last_is_resumed_by_last(tmp_path, capsys):
    """A ``PreemptionCheckpoint`` without ``save_last`` saves the SIGTERM's state under its ``filename``; the advised
    ``--ckpt_path last`` resumes that checkpoint (the same run: its metrics.csv goes on in version_0), not a new
    run from step 0."""
    checkpoints = tmp_path / "checkpoints"
    preemption = {"class_path": "hfmca_lightning.callbacks.PreemptionCheckpoint"}
    preemption["init_args"] = {"dirpath": str(checkpoints)}
    sigterm = {"class_path": "tests.cli.test_trainer_cli.SigtermAtBatch", "init_args": {"at_batch": 2}}
    callbacks = {"trainer.callbacks": [preemption, sigterm], "trainer.log_every_n_steps": 1}
    with pytest.raises(SystemExit) as stopped:
        fit(tmp_path, **callbacks)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "continue with the same command and `--ckpt_path last`" in capsys.readouterr().err
    assert sorted(path.name for path in checkpoints.glob("*.ckpt")) == ["epoch=0-step=3.ckpt"]

    callbacks["trainer.callbacks"] = [preemption]  # no second SIGTERM, whatever the run starts from
    fit(tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "last", **callbacks)
    out = capsys.readouterr().out
    assert "no last checkpoint" not in out, out
    assert [path.name for path in (tmp_path / "logs" / "run").iterdir()] == ["version_0"]  # the same run, continued
    rows = list(csv.DictReader((tmp_path / "logs" / "run" / "version_0" / "metrics.csv").open()))
    steps = [int(row["step"]) for row in rows if row.get("train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 7, steps  # each step once, to the end of epoch 2
    # the note follows the saves: `last` is the newest checkpoint now, not the SIGTERM's older (deleted) one
    newest = max(checkpoints.glob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    assert newest.name != "epoch=0-step=3.ckpt" and (checkpoints / NEWEST_NOTE).read_text() == f"{newest.name}\n"


def test_last_finds_a_noted_checkpoint_only_in_this_runs_preemption_folders(tmp_path):
    """``--ckpt_path last`` takes the checkpoint the note names in the folder of a ``PreemptionCheckpoint`` without
    ``save_last`` (when newer than any ``last.ckpt``), never a note in another callback's folder (nor one that writes
    ``last.ckpt``), nor one that names a file that is gone or outside the folder."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hfmca_lightning.callbacks import PreemptionCheckpoint
    from hfmca_lightning.cli.trainer_cli import newest_last_checkpoint
    from tests.helpers import quiet_trainer

    preempted, other, silent, own = tmp_path / "preempted", tmp_path / "other", tmp_path / "silent", tmp_path / "own"
    trainer = quiet_trainer(
        enable_checkpointing=True,
        callbacks=[
            PreemptionCheckpoint(dirpath=preempted),
            ModelCheckpoint(dirpath=other),  # not a PreemptionCheckpoint
            PreemptionCheckpoint(dirpath=silent, save_last=True, every_n_train_steps=3),  # writes last.ckpt
            ModelCheckpoint(dirpath=own, save_last=True, every_n_train_steps=5),
        ],
    )
    for age, (folder, name) in enumerate(
        [(own, "last.ckpt"), (preempted, "epoch=0-step=3.ckpt"), (other, "x.ckpt"), (silent, "y.ckpt")]
    ):
        folder.mkdir()
        (folder / name).write_bytes(b"")
        (folder / NEWEST_NOTE).write_text(f"{name}\n")
        os.utime(folder / name, (1_000 + age, 1_000 + age))  # each newer than the one before
    assert newest_last_checkpoint(trainer) == preempted / "epoch=0-step=3.ckpt"
    (preempted / NEWEST_NOTE).write_text("../other/x.ckpt\n")
    assert newest_last_checkpoint(trainer) == own / "last.ckpt"
    (preempted / NEWEST_NOTE).write_text("gone.ckpt\n")
    assert newest_last_checkpoint(trainer) == own / "last.ckpt"
    (preempted / "sub").mkdir()  # a filename with a sub-folder ("sub/{epoch}"): noted from the callback's dirpath
    (preempted / "sub" / "z.ckpt").write_bytes(b"")
    (preempted / NEWEST_NOTE).write_text("sub/z.ckpt\n")
    assert newest_last_checkpoint(trainer) == preempted / "sub" / "z.ckpt"


def test_fit_from_a_weights_only_checkpoint_is_one_line_and_validate_takes_it(tmp_path, capsys):
    """A checkpoint written with ``save_weights_only`` has no optimiser state or loop position: ``fit --ckpt_path``
    (its path, or ``last``) ends with one line before training (Lightning's own resume: a KeyError traceback);
    ``validate`` scores it."""
    checkpoints = tmp_path / "checkpoints"
    weights_only = {"class_path": "hfmca_lightning.callbacks.PreemptionCheckpoint"}
    weights_only["init_args"] = {"dirpath": str(checkpoints), "save_last": True, "save_weights_only": True}
    knn = {"class_path": "hfmca_lightning.callbacks.KNNEvaluation", "init_args": {"k": 20}}
    callbacks = {"trainer.callbacks": [knn, weights_only]}
    fit(tmp_path, **callbacks)
    capsys.readouterr()
    for ckpt_path in (str(checkpoints / "last.ckpt"), "last"):
        with pytest.raises(SystemExit) as exit_info:
            fit(tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", ckpt_path, **callbacks)
        assert exit_info.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"hfmca: error: {checkpoints / 'last.ckpt'} holds the weights only"), line
        assert "save_weights_only" in line
    main(["validate", "--config", str(DEMO), "--config", str(tiny_overrides(tmp_path, **callbacks)),
          "--ckpt_path", str(checkpoints / "last.ckpt")])  # fmt: skip
    assert "knn/top1" in capsys.readouterr().out
