"""The health callback in real (tiny) fits: what it logs is HealthStatistics of the embeddings of the window's steps
(HFMCA's outputs, a baseline's backbone, a user module's outputs), it resumes exactly mid-window, ModelCheckpoint can
monitor it, the collapse alarm rings (and stops the run before a checkpoint) when a representation collapses and not
when it trains, and its settings are checked."""

from __future__ import annotations

import csv
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.callbacks import CollapseError, HealthMetrics, LinearProbe
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule
from hfmca_lightning.methods.baselines import SimCLR
from hfmca_lightning.models import GridExternalHead, SmallConvNet, ViewProjector
from tests.helpers import quiet_trainer
from tests.helpers.health import (
    HEALTH_NAMES,
    HealthProbe,
    RecordEmbeddings,
    assert_health_equal,
    gaussian_views,
    health_images,
    logged_health,
    record_health,
    window_steps,
)

COLLAPSE_LINE = (
    r"^the representation is collapsing: its effective rank fell to \S+ at step (\d+), below 0\.4 of its best"
)


# HealthProbe trains only: the data module's kNN loaders go unused.
pytestmark = pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: one thread is as fast, and far faster on a loaded 2-core machine (no spinning threads). The
    suite's fixture restores the count."""
    torch.set_num_threads(1)
    yield


def tiny_hfmca(width: int = 8) -> HFMCAModule:
    torch.manual_seed(0)
    return HFMCAModule(
        SmallConvNet(width=width, num_stages=1),
        projector=ViewProjector(width, 8, 8),
        external_head=GridExternalHead(8, 2, 2, 8, noise_channels=0),
        external_cost=HFMCACost(reg=0.1, name="external"),
    )


def windows(logged: dict[int, dict[str, float]], every: int, window: int, calls: dict[int, list[torch.Tensor]], stack):
    """``{logged step: the (B, L, D) embeddings of its window's steps}``, from the steps' recorded calls."""
    return {
        step: torch.cat([stack(calls[s]) for s in range(step - window + 1, step + 1)])
        for step in logged
        if step % every == 0
    }


# --- what is logged ---------------------------------------------------------------------------------------------------


def test_an_hfmca_module_logs_the_health_of_its_features():
    """HFMCA: the embeddings are the steps' ``outputs["features"]`` ((B * L, D), a sample's 4 views together).
    8-dim features, 4 samples a step: an estimate of 2 * 8 samples sums the 4 steps up to each logged one."""
    module = tiny_hfmca()
    records = record_health(module)
    backbone = RecordEmbeddings(module.backbone)  # the test's own hook on the same embeddings
    window = window_steps(2, 8, 4)
    assert window == 4
    trainer = quiet_trainer(max_steps=10, callbacks=[HealthMetrics(every_n_steps=5), backbone], limit_val_batches=0)
    trainer.fit(module, datamodule=health_images(batch_size=4, views=4))
    logged = logged_health(records)
    assert sorted(logged) == [5, 10]  # every 5 steps, no other
    expected = windows(logged, 5, window, backbone.calls, lambda calls: torch.cat(calls).reshape(4, 4, -1))
    for step, embeddings in expected.items():
        assert embeddings.shape == (16, 4, 8)
        assert_health_equal(logged[step], embeddings)


@pytest.mark.parametrize("probe_first", [False, True], ids=["health-first", "linear-probe-first"])
def test_a_baseline_logs_the_health_of_its_backbone(probe_first):
    """SimCLR returns no features: the callback hooks the backbone, called once per view (2 calls of (B, D)); the
    online linear probe's own pass through the backbone (eval mode, no gradients) is not a view, whatever the order
    of the callbacks."""
    torch.manual_seed(0)
    module = SimCLR(SmallConvNet(width=4, num_stages=1), hidden_dim=8, output_dim=8)
    records = record_health(module)
    backbone = RecordEmbeddings(module.backbone)
    window = window_steps(2, 4, 4)
    assert window == 2
    callbacks = [HealthMetrics(every_n_steps=3), backbone]
    if probe_first:
        callbacks = [LinearProbe(feature_dim=4), *callbacks]
    trainer = quiet_trainer(max_steps=9, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(module, datamodule=health_images(batch_size=4, views=2))
    logged = logged_health(records)
    assert sorted(logged) == [3, 6, 9]
    # the step's two views: the probe's pass (after the step, when it comes first) is not one
    expected = windows(logged, 3, window, backbone.calls, lambda calls: torch.stack(calls[:2], dim=1))
    for step, embeddings in expected.items():
        assert embeddings.shape == (8, 2, 4)
        assert_health_equal(logged[step], embeddings)


def test_a_user_module_that_returns_loss_and_features_is_measured():
    """A plain LightningModule returning ``{"loss", "features"}`` and no ``backbone``: a window of 2 steps of 8
    samples before every third step; the steps between windows are not summed."""
    module = HealthProbe(dim=8, inputs=8)
    encoder = RecordEmbeddings(module.encoder)
    trainer = quiet_trainer(max_steps=9, callbacks=[HealthMetrics(every_n_steps=3), encoder], limit_val_batches=0)
    trainer.fit(module, train_dataloaders=gaussian_views(dim=8, batch_size=8))
    logged = logged_health(module.health)
    assert sorted(logged) == [3, 6, 9]
    expected = windows(logged, 3, 2, encoder.calls, lambda calls: calls[0].reshape(8, 2, -1))
    for step, embeddings in expected.items():
        assert embeddings.shape == (16, 2, 8)
        assert_health_equal(logged[step], embeddings)


def test_an_embedding_key_the_steps_do_not_return_is_one_line_not_a_silent_hook():
    """A named ``embedding_key`` is the user's choice of embeddings: where the steps return none under it, the run
    stops at the first collected step, instead of measuring the backbone's output in its place."""
    module = HealthProbe(dim=8, inputs=8)
    trainer = quiet_trainer(
        max_steps=3, callbacks=[HealthMetrics(every_n_steps=3, embedding_key="z")], limit_val_batches=0
    )
    with pytest.raises(ConfigurationError, match="HealthMetrics: embedding_key 'z' names no"):
        trainer.fit(module, train_dataloaders=gaussian_views(dim=8, batch_size=8))


# --- exact resume -----------------------------------------------------------------------------------------------------


def health_run(tmp_path: Path, max_steps: int, ckpt_path: Path | None = None, **checkpoint) -> HealthProbe:
    """A HealthProbe (6-dim, trained) on 32 images, 4 a step: 3-step windows before every 4th step."""
    module = HealthProbe(dim=6, lr=0.05)
    callbacks = [HealthMetrics(every_n_steps=4)]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, **checkpoint))
    trainer = quiet_trainer(
        max_steps=max_steps, callbacks=callbacks, limit_val_batches=0, enable_checkpointing=bool(checkpoint)
    )
    trainer.fit(module, datamodule=health_images(batch_size=4, views=2), ckpt_path=ckpt_path)
    return module


# MultiViewDataModule resumes mid-epoch exactly (its own state_dict), which Lightning's check does not see
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_run_resumed_mid_window_logs_what_an_uninterrupted_run_logs(tmp_path):
    """12 steps in one go, or 6 (a checkpoint at step 6, after the first of the window of steps 6..8) and 6 more
    resumed from it: the same values at the same steps, to the bit. Resumed without the callback's state, the
    window's first step is missing, and the estimate waits."""
    window = window_steps(2, 6, 4)
    assert window == 3
    whole = logged_health(health_run(tmp_path / "whole", max_steps=12).health)
    assert sorted(whole) == [4, 8, 12]

    first = health_run(tmp_path / "parts", max_steps=6, every_n_train_steps=6)
    checkpoint = tmp_path / "parts" / "epoch=0-step=6.ckpt"
    state = torch.load(checkpoint, weights_only=False)
    (key,) = [key for key in state["callbacks"] if key.startswith("HealthMetrics")]
    assert state["callbacks"][key]["sums"] is not None  # mid-window: the partial sums are in the checkpoint
    assert float(state["callbacks"][key]["sums"][0]) == 4  # one step of the window of step 8
    resumed = health_run(tmp_path / "parts", max_steps=12, ckpt_path=checkpoint)
    assert logged_health(first.health) == {4: whole[4]}
    assert logged_health(resumed.health) == {8: whole[8], 12: whole[12]}

    del state["callbacks"][key]
    torch.save(state, tmp_path / "stateless.ckpt")
    forgetful = logged_health(
        health_run(tmp_path / "stateless", max_steps=12, ckpt_path=tmp_path / "stateless.ckpt").health
    )
    assert forgetful.get(8) != whole[8]


def test_the_state_key_follows_the_settings():
    assert HealthMetrics(every_n_steps=4).state_key == HealthMetrics(every_n_steps=4).state_key
    keys = {
        HealthMetrics(every_n_steps=4).state_key,
        HealthMetrics(every_n_steps=5).state_key,
        HealthMetrics(every_n_steps=4, samples_per_dim=3).state_key,
    }
    assert len(keys) == 3
    assert all(key.startswith("HealthMetrics") for key in keys)


# --- monitoring -------------------------------------------------------------------------------------------------------


def csv_column(folder: Path, name: str) -> dict[int, float]:
    """``{global step: value}`` of a metrics.csv column. Lightning writes a training step's metrics under the count of
    steps before it (``global_step - 1``)."""
    (path,) = folder.glob("**/metrics.csv")
    return {int(row["step"]) + 1: float(row[name]) for row in csv.DictReader(path.open()) if row.get(name)}


def test_model_checkpoint_keeps_the_step_with_the_best_effective_rank(tmp_path):
    """Embeddings most spread at step 5 (HealthProbe's ``peak``), health every 2 steps, a checkpoint every 2 steps,
    the best one by ``health/effective_rank`` kept: it is the step whose logged value is the largest."""
    module = HealthProbe(dim=None, inputs=8, peak=5)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints",
        monitor="health/effective_rank",
        mode="max",
        every_n_train_steps=2,
        save_top_k=1,
    )
    trainer = quiet_trainer(
        max_steps=10,
        callbacks=[HealthMetrics(every_n_steps=2), checkpoint],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=True,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=gaussian_views(dim=8, batch_size=8))
    logged = logged_health(module.health)
    assert sorted(logged) == [2, 4, 6, 8, 10]
    column = csv_column(tmp_path, "health/effective_rank")
    for step, values in logged.items():  # the CSV holds each step's own value (as float32)
        assert column[step] == pytest.approx(values["effective_rank"], rel=2**-23)
    ranks = {step: column[step] for step in logged}
    best = max(ranks, key=ranks.get)
    assert best not in (2, 10)  # the peak is inside the run: neither the first nor the last checkpoint is the best
    (kept,) = (tmp_path / "checkpoints").glob("*.ckpt")
    assert torch.load(kept, weights_only=False)["global_step"] == best
    assert float(checkpoint.best_model_score) == pytest.approx(ranks[best], rel=2**-23)


def test_each_estimate_is_one_row_of_the_log_at_its_own_step(tmp_path):
    """Health every 2 steps, a row of metrics.csv at every step: the health columns are filled in the rows of the
    steps that computed an estimate only (never a stale estimate again at the steps between: a resumed run, whose
    Lightning starts with an empty cache, would not repeat it), once each, with the value computed there."""
    module = HealthProbe(dim=None, inputs=8, peak=5)
    trainer = quiet_trainer(
        max_steps=9,
        callbacks=[HealthMetrics(every_n_steps=2)],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=gaussian_views(dim=8, batch_size=8))
    logged = logged_health(module.health)
    assert sorted(logged) == [2, 4, 6, 8]
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    for name in HEALTH_NAMES:
        filled = [int(row["step"]) + 1 for row in rows if row.get(f"health/{name}")]
        assert filled == [2, 4, 6, 8], (name, filled)
        column = csv_column(tmp_path, f"health/{name}")
        assert column == {step: values[name] for step, values in logged.items()}
    assert float(trainer.callback_metrics["health/effective_rank"]) == pytest.approx(logged[8]["effective_rank"])


# --- the collapse alarm -----------------------------------------------------------------------------------------------

ALARM = dict(every_n_steps=2, collapse_fraction=0.4)
ALARM_BY = 8  # steps: dimensions 1..7 of the collapsing module shrink by 2 every step


def collapsing() -> HealthProbe:
    """8-dim embeddings (a trained linear map of Gaussian vectors) whose dimensions 1..7 are multiplied by
    ``0.5 ** step``: by step 8 their variance is ``2^-14`` of dimension 0's, the effective rank ~ 1."""
    return HealthProbe(dim=8, inputs=8, decay=0.5, lr=0.01)


def test_a_collapsing_representation_rings_the_alarm_once():
    module = collapsing()
    trainer = quiet_trainer(max_steps=2 * ALARM_BY, callbacks=[HealthMetrics(**ALARM)], limit_val_batches=0)
    with pytest.warns(HFMCAWarning, match="the representation is collapsing") as caught:
        trainer.fit(module, train_dataloaders=gaussian_views(dim=8, batch_size=8, samples=256))
    lines = [str(warning.message) for warning in caught if "collapsing" in str(warning.message)]
    assert len(lines) == 1, lines  # once, not at every later estimate
    (line,) = lines
    assert "\n" not in line
    step = int(re.match(COLLAPSE_LINE, line).group(1))
    assert step <= ALARM_BY
    ranks = {s: values["effective_rank"] for s, values in logged_health(module.health).items()}
    assert ranks[step] < 0.4 * max(rank for s, rank in ranks.items() if s < step)
    assert all(rank >= 0.4 * max(ranks[t] for t in ranks if t <= s) for s, rank in ranks.items() if s < step)


def test_stop_on_collapse_raises_before_the_checkpoint_of_the_alarm_step(tmp_path):
    """``stop_on_collapse``: one line (CollapseError, which the command turns into exit 1), and the newest checkpoint
    (one every step) is from the step before the alarm."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = quiet_trainer(
        max_steps=2 * ALARM_BY,
        callbacks=[HealthMetrics(**ALARM, stop_on_collapse=True), checkpoint],
        enable_checkpointing=True,
        limit_val_batches=0,
    )
    with pytest.raises(CollapseError) as caught:
        trainer.fit(collapsing(), train_dataloaders=gaussian_views(dim=8, batch_size=8, samples=256))
    line = str(caught.value)
    assert "\n" not in line and line.endswith("the run stops, its last checkpoint is from before")
    step = int(re.match(COLLAPSE_LINE, line).group(1))
    assert step <= ALARM_BY
    saved = sorted(torch.load(path, weights_only=False)["global_step"] for path in tmp_path.glob("*.ckpt"))
    assert saved == list(range(1, step))


def test_a_resumed_run_keeps_the_best_and_the_alarm(tmp_path):
    """The best effective rank and the alarm are checkpointed: resumed after the best (step 2) and before the alarm,
    the run rings at the same step against the same best (one that had forgotten the best would take its first
    estimate, already collapsed, as its best, and never ring); resumed after the alarm, it does not ring again."""

    def run(max_steps: int, ckpt_path: Path | None = None, **checkpoint) -> list[str]:
        callbacks = [HealthMetrics(**ALARM)]
        if checkpoint:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, **checkpoint))
        trainer = quiet_trainer(
            max_steps=max_steps, callbacks=callbacks, limit_val_batches=0, enable_checkpointing=bool(checkpoint)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", HFMCAWarning)
            # the project's data module: it resumes exactly where the checkpoint was written
            module = HealthProbe(dim=8, decay=0.5, lr=0.01)
            trainer.fit(module, datamodule=health_images(batch_size=8), ckpt_path=ckpt_path)
        return [str(warning.message) for warning in caught if issubclass(warning.category, HFMCAWarning)]

    (uninterrupted,) = run(2 * ALARM_BY)
    assert int(re.match(COLLAPSE_LINE, uninterrupted).group(1)) > 4  # the alarm rings after the checkpoint
    assert run(4, every_n_train_steps=4) == []
    assert run(2 * ALARM_BY, ckpt_path=tmp_path / "epoch=0-step=4.ckpt") == [uninterrupted]
    # resumed after the alarm, it does not ring again
    assert run(8, every_n_train_steps=8) == [uninterrupted]
    (after,) = tmp_path.glob("*-step=8.ckpt")
    assert run(2 * ALARM_BY, ckpt_path=after) == []


def test_a_healthy_hfmca_run_never_rings_the_alarm():
    """A tiny HFMCA run over the same steps, the same alarm: no warning (the suite turns any HFMCAWarning into an
    error). The alarm could ring: its threshold is above the effective rank's floor of 1."""
    module = tiny_hfmca()
    records = record_health(module)
    callback = HealthMetrics(**ALARM, samples_per_dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFMCAWarning)
        trainer = quiet_trainer(max_steps=ALARM_BY, callbacks=[callback], limit_val_batches=0)
        trainer.fit(module, datamodule=health_images(batch_size=4, views=4))
    ranks = [values["effective_rank"] for values in logged_health(records).values()]
    assert len(ranks) == ALARM_BY // 2
    assert not callback.alarmed
    assert 0.4 * max(ranks) > 1


# --- settings ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "parameter"),
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"samples_per_dim": 0}, "samples_per_dim"),
        ({"collapse_fraction": 1.0}, "collapse_fraction"),
        ({"collapse_fraction": -0.1}, "collapse_fraction"),
        ({"collapse_fraction": 0.0, "stop_on_collapse": True}, "collapse_fraction"),  # an alarm that never rings
    ],
)
def test_settings_out_of_range_are_refused_in_one_line(settings, parameter):
    with pytest.raises(ConfigurationError) as caught:
        HealthMetrics(**settings)
    assert caught.value.parameter == parameter
    message = str(caught.value)
    assert "\n" not in message and parameter in message and str(next(iter(settings.values()))) in message


class StepFailed(RuntimeError):
    pass


def test_a_failed_step_ends_the_run_with_its_own_error_before_any_decomposition(monkeypatch):
    """A module whose update failed (HFMCA's and the baselines' ``raise_if_a_step_failed``) stops the run with that
    error at the first logging step, before its NaN features reach a decomposition."""
    module = HealthProbe(dim=8, inputs=8)
    failed_at: list[int] = []

    def raise_if_a_step_failed() -> None:
        failed_at.append(module.global_step)
        raise StepFailed("step 1 failed")

    module.raise_if_a_step_failed = raise_if_a_step_failed  # type: ignore[attr-defined]
    decomposed = []
    monkeypatch.setattr(
        "hfmca_lightning.analysis.health.HealthStatistics.metrics", lambda self: decomposed.append(self) or {}
    )
    trainer = quiet_trainer(max_steps=8, callbacks=[HealthMetrics(every_n_steps=2)], limit_val_batches=0)
    with pytest.raises(StepFailed):
        trainer.fit(module, train_dataloaders=gaussian_views(dim=8, batch_size=8, samples=256))
    assert failed_at and not decomposed


class ConcatenatedViews(HealthProbe):
    """A user module with a ``backbone`` that it calls once over the views concatenated view after view
    (``torch.cat(views)``, as lightly's examples do) and a step that returns the loss alone."""

    def __init__(self) -> None:
        super().__init__(dim=8, inputs=8)
        self.backbone = self.encoder

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        views = batch[0]
        embeddings = self.backbone(torch.cat(views.unbind(dim=1)))  # (L * B, D), view after view
        first, second = embeddings.chunk(2)
        return (first - second).pow(2).mean() - embeddings.var(dim=0).mean()


@pytest.mark.parametrize("views_first", [True, False])
def test_one_backbone_call_over_all_views_is_read_as_views_first_says(views_first):
    """One hooked call of ``(L * B, D)`` rows: ``views_first`` says how they group into samples, so LiDAR (which
    compares a sample's views) sees each sample's own views with ``True`` and mixes samples with ``False``."""
    module = ConcatenatedViews()
    records = record_health(module)
    backbone = RecordEmbeddings(module.backbone)
    health = HealthMetrics(every_n_steps=3, views_first=views_first)
    trainer = quiet_trainer(max_steps=6, callbacks=[health, backbone], limit_val_batches=0)
    trainer.fit(module, train_dataloaders=gaussian_views(dim=8, batch_size=8))
    logged = logged_health(records)
    assert sorted(logged) == [3, 6]

    def grouped(calls: list[torch.Tensor]) -> torch.Tensor:
        rows = calls[0]
        return rows.reshape(2, 8, -1).transpose(0, 1) if views_first else rows.reshape(8, 2, -1)

    for step, embeddings in windows(logged, 3, 2, backbone.calls, grouped).items():
        assert_health_equal(logged[step], embeddings)
