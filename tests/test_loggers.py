"""W&B logging never needs an account or a network: offline runs are stored locally and resumed."""

from __future__ import annotations

import pytest

from hfmca_lightning.loggers import OfflineSafeWandbLogger, wandb_credentials_available
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
