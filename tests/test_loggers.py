"""W&B logging never needs an account or a network: offline runs are stored locally and resumed; a resumed run's
metrics.csv goes on in the folder of the run it resumes; metrics.csv is replaced whole, never rewritten in place, when
a new column appears."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.callbacks.run_state import RunState
from hfmca_lightning.loggers import OfflineSafeWandbLogger, continue_csv_log, wandb_credentials_available
from tests.helpers import fit, interrupted_fit

wandb = pytest.importorskip("wandb")


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "home").mkdir()
    wandb.teardown()  # forget settings cached by earlier runs in this process
    yield
    wandb.finish()


def test_without_an_api_key_the_logger_is_offline(no_wandb_account, tmp_path):
    assert not wandb_credentials_available()
    assert OfflineSafeWandbLogger(save_dir=str(tmp_path), project="p")._offline


@pytest.mark.integration  # a subprocess or a training run
def test_offline_run_is_stored_locally_and_resume_keeps_the_run_id(no_wandb_account, tmp_path):
    logger = {
        "class_path": "hfmca_lightning.loggers.OfflineSafeWandbLogger",
        "init_args": {"save_dir": str(tmp_path / "wb"), "project": "hfmca-test"},
    }
    interrupted_fit(tmp_path, 1, "--trainer.max_epochs", "2", **{"trainer.logger": logger})
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), "the offline run must be stored on disk"
    run_id = runs[0].name.split("-")[-1]
    wandb.finish()
    fit(tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "last", **{"trainer.logger": logger})
    resumed_ids = {path.name.split("-")[-1] for path in (tmp_path / "wb" / "wandb").glob("offline-run-*")}
    assert resumed_ids == {run_id}


@pytest.mark.integration  # a subprocess or a training run
def test_wandb_offline_run_holds_the_figures_eigenvalue_series_and_histograms(no_wandb_account, tmp_path):
    from lightning.pytorch import Trainer

    from hfmca_lightning.callbacks import DensityRatioHeatmapCallback, EigenspectrumCallback
    from tests.helpers import tiny_data, tiny_spectrum_module

    logger = OfflineSafeWandbLogger(save_dir=str(tmp_path), project="hfmca-test")
    trainer = Trainer(
        max_epochs=1,
        logger=logger,
        callbacks=[
            EigenspectrumCallback(every_n_steps=1, min_groups=1),
            DensityRatioHeatmapCallback(num_images=2, statistics_images=9),
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    trainer.fit(tiny_spectrum_module(), tiny_data())
    wandb.finish()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    images = sorted(path.name.split("_")[0] for path in (run / "files" / "media" / "images").glob("*.png"))
    assert images == ["density", "layer", "learning"]
    history = next(run.glob("*.wandb")).read_bytes()
    for key in (
        b"eigenvalues/external/01",
        b"eigenvalues/internal/L9/01",
        b"spectrum/internal/L3/num_above_0.5",
        b"cost/internal/L1",
    ):
        assert key in history, key
    # The whole spectrum of every pair as a W&B histogram (W&B draws those as distributions over time).
    for name in (b"external", b"internal/L1", b"internal/L9"):
        assert b"spectrum/" + name + b"/eigenvalues" in history, name
    assert b'"histogram"' in history


@pytest.mark.integration  # a subprocess or a training run
def test_a_key_without_network_falls_back_to_offline_instead_of_failing(no_wandb_account, tmp_path, monkeypatch):
    # An API key, but the W&B server is unreachable (a closed port on this machine).
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    logger = OfflineSafeWandbLogger(save_dir=str(tmp_path), project="p", init_timeout=3)
    assert not logger._offline
    with pytest.warns(UserWarning, match="(?s)could not start an online run.*continuing offline"):
        run = logger.experiment
    logger.log_metrics({"cost/external": -1.0}, step=0)
    assert logger._offline and run is not None
    wandb.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*/*.wandb"))


# --- a resumed run's metrics.csv -------------------------------------------------------------------------------------


def _write_metrics(folder: Path, rows: list[dict[str, object]]) -> None:
    folder.mkdir(parents=True)
    keys = sorted({key for row in rows for key in row})
    with (folder / "metrics.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def _rows(folder: Path, name: str = "metrics.csv") -> list[dict[str, str]]:
    with (folder / name).open(newline="") as file:
        return list(csv.DictReader(file))


def test_a_continued_csv_log_keeps_the_rows_before_the_checkpoint_and_appends(tmp_path):
    """Rows of steps 0-5 (an epoch's end at step 3) from a run whose checkpoint is at global step 4: the rows of the
    steps before 4 stay (a training step's row is written under ``global_step - 1``), those of steps 4 and 5 go (the
    resumed run logs them again), and the resumed run's rows, with a key the file did not have, are appended."""
    folder = tmp_path / "logs" / "run" / "version_0"
    old = [{"step": step, "epoch": step // 4, "cost": float(step)} for step in range(6)]
    _write_metrics(folder, [*old[:4], {"step": 3, "epoch": 0, "knn": 0.5}, *old[4:]])
    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    assert continue_csv_log(logger, [str(folder)], from_step=4) == str(folder)
    assert logger.version == 0 and logger.log_dir == str(folder)
    assert [(row["step"], row["cost"], row["knn"]) for row in _rows(folder)] == [
        ("0", "0.0", ""), ("1", "1.0", ""), ("2", "2.0", ""), ("3", "3.0", ""), ("3", "", "0.5")
    ]  # fmt: skip
    logger.log_metrics({"cost": 40.0, "health": 1.0}, step=4)
    logger.save()
    rows = _rows(folder)
    assert len(rows) == 6 and (rows[-1]["step"], rows[-1]["cost"], rows[-1]["health"]) == ("4", "40.0", "1.0")
    assert rows[0]["health"] == "" and [path.name for path in folder.parent.iterdir()] == ["version_0"]
    # the dropped rows are kept beside it (a resume from an older checkpoint loses no history), a second resume from
    # the same step keeping the first's
    assert [(row["step"], row["cost"]) for row in _rows(folder, "metrics-after-step-4.csv")] == [
        ("4", "4.0"), ("5", "5.0")
    ]  # fmt: skip
    continue_csv_log(CSVLogger(str(tmp_path / "logs"), name="run"), [str(folder)], from_step=4)
    assert [row["cost"] for row in _rows(folder, "metrics-after-step-4-v1.csv")] == ["40.0"]
    assert [row["cost"] for row in _rows(folder, "metrics-after-step-4.csv")] == ["4.0", "5.0"]


def test_a_metrics_file_that_is_not_csv_is_moved_aside_with_a_warning(tmp_path):
    """A row with more fields than the header, or bytes that are not UTF-8: the resume goes on with a new file and
    says where the old one went, instead of a traceback."""
    from hfmca_lightning.errors import HFMCAWarning

    for name, content in (("extra", b"step,cost\n0,1.0\n1,2.0,3.0\n"), ("bytes", b"step,cost\n0,\xff\xfe\n")):
        folder = tmp_path / name / "run" / "version_0"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_bytes(content)
        logger = CSVLogger(str(tmp_path / name), name="run")
        with pytest.warns(HFMCAWarning, match="cannot be read as CSV"):
            continue_csv_log(logger, [str(folder)], from_step=1)
        (aside,) = folder.glob("metrics-unreadable-*.csv")
        assert aside.read_bytes() == content and not (folder / "metrics.csv").exists()
        logger.log_metrics({"cost": 5.0}, step=1)
        logger.save()
        assert [row["cost"] for row in _rows(folder)] == ["5.0"]


def test_a_csv_log_of_another_folder_or_a_named_version_is_handled(tmp_path):
    """A stored folder under another ``save_dir`` is not continued (a new version folder, as without a checkpoint);
    a named version (``version: my_run``) is continued under its name."""
    _write_metrics(tmp_path / "logs" / "run" / "version_0", [{"step": 0, "cost": 1.0}])
    elsewhere = CSVLogger(str(tmp_path / "other"), name="run")
    assert continue_csv_log(elsewhere, [str(tmp_path / "logs" / "run" / "version_0")], from_step=1) is None
    assert elsewhere.version == 0 and not Path(elsewhere.log_dir).exists()
    named = tmp_path / "logs" / "run" / "my_run"
    _write_metrics(named, [{"step": 0, "cost": 1.0}, {"step": 1, "cost": 2.0}])
    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    assert continue_csv_log(logger, [str(named)], from_step=1) == str(named)
    assert logger.version == "my_run" and [row["step"] for row in _rows(named)] == ["0"]


def test_rows_logged_straight_to_a_csv_logger_are_on_disk_with_the_checkpoint(tmp_path):
    """Lightning writes its own rows at once; rows a callback logs straight to the logger (the spectra) wait for the
    flush interval, so a SIGKILL after the checkpoint would lose them: ``RunState`` writes them when it is saved."""
    logger = CSVLogger(str(tmp_path), name="run")
    logger.log_metrics({"spectrum/top": 0.5}, step=3)
    assert not (Path(logger.log_dir) / "metrics.csv").exists()
    RunState().on_save_checkpoint(SimpleNamespace(loggers=[logger]), None, {})  # type: ignore[arg-type]
    assert [(row["step"], row["spectrum/top"]) for row in _rows(Path(logger.log_dir))] == [("3", "0.5")]


@pytest.mark.integration  # a subprocess or a training run
@pytest.mark.parametrize("quiet", [False, True])
def test_wandb_says_nothing_under_quiet_and_never_warns_of_anonymous(no_wandb_account, tmp_path, monkeypatch, quiet):
    """``hfmca -q fit`` leaves W&B's lines out (the run is still stored); without ``-q`` they are there, but never
    wandb's warning of the ``anonymous`` setting that Lightning passes unset."""
    import subprocess

    from tests.helpers import DEMO, HFMCA, tiny_overrides

    monkeypatch.delenv("WANDB_SILENT")  # the fixture's; the command decides
    logger = {"class_path": "hfmca_lightning.loggers.OfflineSafeWandbLogger", "init_args": {"save_dir": str(tmp_path)}}
    overrides = tiny_overrides(tmp_path, **{"trainer.logger": logger, "trainer.callbacks": []})
    command = [str(HFMCA), *(["-q"] if quiet else []), "fit", "--config", str(DEMO), "--config", str(overrides)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert list((tmp_path / "wandb").glob("offline-run-*/*.wandb")), "the offline run must be stored on disk"
    wandb_lines = [line for line in output.splitlines() if "wandb" in line.lower() and "W&B: no API key" not in line]
    assert bool(wandb_lines) != quiet, output[-3000:]
    assert "anonymous" not in output, output[-3000:]


class LinkMetricsBeforeValidation(Callback):
    """Hard-links the run's metrics.csv to ``link`` as the first validation starts (before its columns appear): a
    file rewritten in place shows through the link; one replaced whole leaves the link the old file."""

    def __init__(self, link: str) -> None:
        self.link = link

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not os.path.exists(self.link):
            os.link(os.path.join(trainer.log_dir or "", "metrics.csv"), self.link)


@pytest.mark.parametrize("resumed", [False, True])
def test_a_new_column_replaces_metrics_csv_whole(tmp_path, resumed):
    """Rows on disk after every step (a checkpoint each), then validation adds ``knn/top1``: Lightning's writer would
    truncate the file and write it again (a kill in between loses the run's history); the run's writer, new or
    continuing a resumed run, writes a new file and renames it over the old one, and the old file is left whole."""
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}
    checkpoint["init_args"] = {"dirpath": str(tmp_path / "checkpoints"), "save_last": True, "every_n_train_steps": 1}
    knn = {"class_path": "hfmca_lightning.callbacks.KNNEvaluation", "init_args": {"k": 20}}
    link = {"class_path": "tests.test_loggers.LinkMetricsBeforeValidation"}
    link["init_args"] = {"link": str(tmp_path / "before_validation.csv")}
    settings: dict[str, object] = {"trainer.callbacks": [checkpoint, knn, link], "trainer.log_every_n_steps": 1}
    if resumed:  # epoch 0 without the evaluation, then epoch 1 resumed with it
        fit(tmp_path, **{**settings, "trainer.callbacks": [checkpoint]})
        fit(tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "last", **settings)
    else:
        fit(tmp_path, **settings)
    (log_dir,) = (tmp_path / "logs" / "run").iterdir()
    before = _rows(tmp_path, "before_validation.csv")
    after = _rows(log_dir)
    steps = 8 if resumed else 4
    assert "knn/top1" not in before[0], "metrics.csv was rewritten in place"
    assert "knn/top1" in after[0]
    assert [int(row["step"]) for row in before] == list(range(steps))  # every step's row, as validation started
    assert [row["train/loss"] for row in after[:steps]] == [row["train/loss"] for row in before]
