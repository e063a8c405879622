"""Exact resume the way runs really stop.

``hfmca fit`` runs as a subprocess on the shipped configs (shrunk: tiny data and model, a few epochs; their
callbacks, logger and data-loader workers as shipped), is killed with SIGKILL after an end-of-epoch or a
mid-epoch checkpoint, or stopped with SIGTERM sent to its whole process group (as SLURM does), and is
continued with ``--ckpt_path last``. Every tensor of the final checkpoint (weights, buffers, optimiser state)
must equal that of an uninterrupted run, with atol 0.
"""

from __future__ import annotations

import copy
import csv
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from tests.helpers import (
    DEMO,
    REPO,
    SHRUNK_DATA,
    checkpoint_tensors,
    finish_hfmca,
    run_hfmca,
    start_hfmca,
    wait_for,
    write_cifar,
    write_overrides,
)

CIFAR10 = REPO / "configs" / "cifar10_ss.yaml"

# Noise channels (model randomness) and beta > 0 (EMA buffers) make the comparison sensitive to lost state.
TINY_NOISY_MODEL = {
    "backbone": {"class_path": "hfmca_lightning.models.SmallConvNet", "init_args": {"width": 8, "num_stages": 2}},
    "projector": {
        "class_path": "hfmca_lightning.models.ViewProjector",
        "init_args": {"input_dim": 16, "output_dim": 16, "hidden_dim": 32},
    },
    "external_cost": {
        "class_path": "hfmca_lightning.losses.HFMCACost",
        "init_args": {"reg": 0.1, "beta": 0.5, "name": "external"},
    },
}


def demo_overrides(folder: Path) -> Path:
    """configs/demo.yaml shrunk: 64 images (8 steps per epoch), 3 epochs, a tiny model, a row of metrics.csv per
    step; 2 persistent workers as shipped."""
    model = copy.deepcopy(TINY_NOISY_MODEL)
    model["external_head"] = {
        "class_path": "hfmca_lightning.models.GridExternalHead",
        "init_args": {"feature_dim": 16, "grid_height": 2, "grid_width": 2, "hidden_dim": 16, "noise_channels": 3},
    }
    overrides = {
        "trainer": {"max_epochs": 3, "enable_progress_bar": False, "log_every_n_steps": 1},
        "model": {"init_args": model},
        "data": {"init_args": SHRUNK_DATA},
    }
    return write_overrides(folder, "shrink.yaml", overrides)


def cifar_overrides(folder: Path, every_n_train_steps: int, data_path: str = "batched-workers") -> Path:
    """configs/cifar10_ss.yaml shrunk: 100 CIFAR images on disk (12 steps of 8 x 9 views per epoch), 2 epochs, a tiny
    model with a warm-up schedule, its shipped callbacks with checkpoints every ``every_n_train_steps`` steps,
    workers not persistent; the shipped 9 SimCLR views drawn by ``BatchedDrawer`` in 2 workers (``batched-workers``),
    after the transfer by the batched drawer (``batched-on-device``), by the shipped drawer (``shipped``:
    ``ResidentDrawer``, 8 batches per call, bf16 channels-last views; the device being the CPU here), from the
    training split kept on the device in chunks of 3 batches (``images-on-device``); or 2 global and 7 local crops
    (``multi-crop``) or lightly's ``MMCRTransform`` (``user-transform``), drawn by ``TorchvisionDrawer``; or
    stable-pretraining's convention (``stable-pretraining``): the example's SimCLR module, which takes plain dicts
    only, on ``batch_format: dict`` batches of 2 views drawn in the workers, with one evaluation loader.
    (The default torchvision drawer on SimCLR views: the demo's resume tests.)"""
    write_cifar(folder / "data", "cifar10", per_class=2)
    shipped = yaml.safe_load(CIFAR10.read_text())
    callbacks = shipped["trainer"]["callbacks"]
    for callback in callbacks:
        if callback["class_path"].endswith("PreemptionCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = every_n_train_steps
    model = copy.deepcopy(TINY_NOISY_MODEL)
    model["external_head"] = {
        "class_path": "hfmca_lightning.models.GridExternalHead",
        "init_args": {"feature_dim": 16, "grid_height": 3, "grid_width": 3, "hidden_dim": 16, "noise_channels": 3},
    }
    # A per-step warm-up schedule: its length comes from Trainer.estimated_stepping_batches, which makes
    # Lightning build the training loader before it restores the checkpoint (Lightning issue #20550).
    model["warmup_epochs"] = 1.0
    data = {
        "source": {"class_path": "hfmca_lightning.data.CIFAR", "init_args": {"root": "data", "verify": False}},
        "batch_size": 8,
        "eval_batch_size": 64,
        "num_workers": 2,
        "persistent_workers": False,
    }
    torchvision = {"class_path": "hfmca_lightning.data.TorchvisionDrawer"}
    if data_path == "batched-workers":  # float32 views in the workers (the shipped drawer's bf16 is for the device)
        data["drawer"] = {
            "class_path": "hfmca_lightning.data.BatchedDrawer",
            "init_args": {"on": "workers", "output_dtype": "float32", "channels_last": False},
        }
    elif data_path == "batched-on-device":
        data["drawer"] = {"class_path": "hfmca_lightning.data.BatchedDrawer", "init_args": {"on": "device"}}
    elif data_path == "images-on-device":
        data["drawer"] = {"class_path": "hfmca_lightning.data.ResidentDrawer", "init_args": {"batches_per_call": 3}}
    elif data_path == "multi-crop":  # 9 views for the 3x3 head: 2 global crops, 7 local ones of 16 px
        data["views"] = {"class_path": "hfmca_lightning.data.MultiCrop", "init_args": {"local_crops": 7}}
        data["drawer"] = torchvision
    elif data_path == "user-transform":  # lightly's MMCRTransform, seeded from each sample's seed
        transform = {"class_path": "lightly.transforms.MMCRTransform", "init_args": {"k": 9, "input_size": 32}}
        data["views"] = {"class_path": "hfmca_lightning.data.TransformViews", "init_args": {"transform": transform}}
        data["drawer"] = torchvision
    overrides: dict[str, Any] = {
        "trainer": {"max_epochs": 2, "enable_progress_bar": False, "callbacks": callbacks},
        "model": {"init_args": model},
        "data": {"init_args": data},
    }
    if data_path == "stable-pretraining":
        overrides["model"] = {"class_path": "tests.helpers.stable_pretraining.SPTSimCLR"}
        data["views"] = {"class_path": "hfmca_lightning.data.SimCLRViews", "init_args": {"count": 2}}
        data.update(batch_format="dict", evaluation_loaders="queries")
    return write_overrides(folder, "shrink.yaml", overrides)


SLOW_DATA_PATHS = ("batched-workers", "images-on-device", "batched-on-device", "multi-crop", "user-transform")


def fit_args(config: Path, overrides: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(config), "--config", str(overrides), *extra]


def assert_same_tensors(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)


def saved_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


class ReferenceRun:
    """An uninterrupted run, started in the background so that its start-up (a few seconds of imports) overlaps
    the interrupted run's; :meth:`result` waits for it and gives every tensor of its last checkpoint and its step."""

    def __init__(self, folder: Path, args: list[str], last: Path, test_classes: bool = False) -> None:
        self.folder, self.last = folder, last  # (and the run's metrics.csv, under folder / "runs")
        self.process = start_hfmca(folder, *args, test_classes=test_classes)
        self._result: tuple[dict[str, torch.Tensor], int] | None = None

    def result(self) -> tuple[dict[str, torch.Tensor], int]:
        if self._result is None:
            finished = finish_hfmca(self.process, self.folder)
            assert finished.returncode == 0, finished.stdout[-3000:]
            self._result = checkpoint_tensors(self.last), saved_step(self.last)
        return self._result

    def stop(self) -> None:
        if self.process.poll() is None:  # a test failed before it waited for the run
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module")
def demo_uninterrupted(tmp_path_factory) -> Iterator[ReferenceRun]:
    folder = tmp_path_factory.mktemp("demo_uninterrupted")
    run = ReferenceRun(
        folder, fit_args(DEMO, demo_overrides(folder)), folder / "runs" / "demo" / "checkpoints" / "last.ckpt"
    )
    yield run
    run.stop()


def test_sigkill_after_the_first_epoch_checkpoint_then_resume_is_exact(tmp_path, demo_uninterrupted):
    args = fit_args(DEMO, demo_overrides(tmp_path))
    checkpoints = tmp_path / "runs" / "demo" / "checkpoints"
    process = start_hfmca(tmp_path, *args)
    wait_for(lambda: (checkpoints / "last.ckpt").is_file(), process)  # written right after epoch=0-step=8.ckpt
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    expected, final_step = demo_uninterrupted.result()
    stopped_at = saved_step(checkpoints / "last.ckpt")
    assert 0 < stopped_at < final_step, "the kill came after the run had finished"

    logs = tmp_path / "runs" / "demo" / "logs"
    killed_rows = csv_rows(logs)  # written with the checkpoint: the run's flush interval is 100 steps
    assert killed_rows and max(int(row["step"]) for row in killed_rows) == stopped_at - 1, killed_rows[-1]

    resumed = run_hfmca(tmp_path, *args, "--ckpt_path", "last", log_name="resumed.log")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert any("LinearProbe" in key for key in expected), "the shipped online linear probe's state is compared too"
    assert_same_tensors(expected, checkpoint_tensors(checkpoints / "last.ckpt"))
    # One metrics.csv, continued in the killed run's folder, row for row the uninterrupted run's.
    assert [path.name for path in logs.iterdir()] == ["version_0"]
    assert csv_rows(logs) == csv_rows(demo_uninterrupted.folder / "runs" / "demo" / "logs")


def csv_rows(logs: Path) -> list[dict[str, str]]:
    """The rows of the one metrics.csv under ``logs``."""
    (path,) = logs.glob("version_*/metrics.csv")
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize(
    "data_path",
    [
        # make test: the demo's SIGKILL run; CI's make test-extended: its SIGTERM run, the shipped CIFAR data path
        # (the training set on the device) and stable-pretraining's dict batches here
        *(pytest.param(path, marks=pytest.mark.slow) for path in SLOW_DATA_PATHS),
        pytest.param("shipped", marks=pytest.mark.extended),
        pytest.param("stable-pretraining", marks=pytest.mark.extended),
    ],
)
def test_sigkill_after_a_mid_epoch_checkpoint_then_resume_is_exact(tmp_path, data_path):
    steps_per_epoch, every = 12, 5
    folder = tmp_path / "straight"
    user_module = data_path == "stable-pretraining"
    straight = ReferenceRun(
        folder,
        fit_args(CIFAR10, cifar_overrides(folder, every, data_path)),
        folder / "runs" / "cifar10_ss" / "checkpoints" / "last.ckpt",
        test_classes=user_module,
    )

    interrupted = tmp_path / "interrupted"
    args = fit_args(CIFAR10, cifar_overrides(interrupted, every, data_path))
    checkpoints = interrupted / "runs" / "cifar10_ss" / "checkpoints"
    try:
        process = start_hfmca(interrupted, *args, test_classes=user_module)
        wait_for(lambda: (checkpoints / "last.ckpt").is_file(), process)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        stopped_at = saved_step(checkpoints / "last.ckpt")
        assert stopped_at % every == 0 and stopped_at % steps_per_epoch != 0, (
            f"not a mid-epoch checkpoint: step {stopped_at}"
        )
        expected, final_step = straight.result()
    finally:
        straight.stop()
    assert final_step == 2 * steps_per_epoch

    resumed = run_hfmca(interrupted, *args, "--ckpt_path", "last", log_name="resumed.log", test_classes=user_module)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert any("LinearProbe" in key for key in expected)
    assert_same_tensors(expected, checkpoint_tensors(checkpoints / "last.ckpt"))


@pytest.mark.extended
def test_sigterm_to_the_process_group_writes_a_checkpoint_and_resume_is_exact(tmp_path, demo_uninterrupted):
    expected, final_step = demo_uninterrupted.result()
    args = fit_args(DEMO, demo_overrides(tmp_path))
    checkpoints = tmp_path / "runs" / "demo" / "checkpoints"
    process = start_hfmca(tmp_path, *args)
    wait_for(lambda: (checkpoints / "last.ckpt").is_file(), process)
    first_checkpoint = saved_step(checkpoints / "last.ckpt")
    os.killpg(process.pid, signal.SIGTERM)  # main process and data-loader workers, as SLURM signals a job
    output = finish_hfmca(process, tmp_path, timeout=120).stdout  # and nothing of it left
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "hfmca: stopped by SIGTERM" in output and "Traceback" not in output
    stopped_at = saved_step(checkpoints / "last.ckpt")
    assert first_checkpoint <= stopped_at < final_step
    # the state when the signal came, in last.ckpt; the preemption line: saved now, or (a signal just after a
    # periodic save) where that save is
    said = (f"SIGTERM: saved the state after step {stopped_at}", f"SIGTERM: the state after step {stopped_at} is in")
    assert any(line in output for line in said), output[-3000:]
    assert "Received SIGTERM" not in output and "SIGTERMException" not in output, output[-3000:]  # one line each

    resumed = run_hfmca(tmp_path, *args, "--ckpt_path", "last", log_name="resumed.log")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert_same_tensors(expected, checkpoint_tensors(checkpoints / "last.ckpt"))
    # the resume is exact, its folder this run's own: none of Lightning's warnings that say otherwise
    for warning in ("ended before the epoch ended", "exists and is not empty"):
        assert warning not in resumed.stdout, resumed.stdout[-3000:]


class SigtermToTheGroupAtBatch(Callback):
    """Sends SIGTERM to the run's process group (main process and data-loader workers, as SLURM signals a job) as
    training batch ``at_batch`` of the run (counted over epochs from 0) starts: the signal arrives while it computes."""

    def __init__(self, at_batch: int) -> None:
        self.at_batch = at_batch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            os.killpg(os.getpgid(0), signal.SIGTERM)


def accumulating_overrides(folder: Path, sigterm_at_batch: int | None = None) -> Path:
    """demo_overrides with ``accumulate_grad_batches: 2`` (8 batches, 4 optimiser steps per epoch) and the demo's
    callbacks, plus a SIGTERM to the process group as batch ``sigterm_at_batch`` starts."""
    overrides = yaml.safe_load(demo_overrides(folder).read_text())
    callbacks = yaml.safe_load(DEMO.read_text())["trainer"]["callbacks"]
    if sigterm_at_batch is not None:
        here = "tests.integration.test_resume.SigtermToTheGroupAtBatch"
        callbacks.append({"class_path": here, "init_args": {"at_batch": sigterm_at_batch}})
    overrides["trainer"].update(accumulate_grad_batches=2, callbacks=callbacks)
    return write_overrides(folder, "accumulate.yaml", overrides)


@pytest.mark.extended
def test_sigterm_between_the_micro_batches_of_a_step_then_resume_is_exact(tmp_path):
    """A SIGTERM during the first micro-batch of step 3 (batch 4): the run stops once step 3 is complete (a checkpoint
    holds no half-accumulated gradients), and resumed with ``--ckpt_path last`` it ends with every tensor of a run
    never interrupted."""
    folder = tmp_path / "straight"
    last = Path("runs") / "demo" / "checkpoints" / "last.ckpt"
    straight = ReferenceRun(folder, fit_args(DEMO, accumulating_overrides(folder)), folder / last, test_classes=True)
    interrupted = tmp_path / "interrupted"
    args = fit_args(DEMO, accumulating_overrides(interrupted, sigterm_at_batch=4))
    try:
        stopped = run_hfmca(interrupted, *args, test_classes=True)
        expected, final_step = straight.result()
    finally:
        straight.stop()
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stdout[-3000:]
    saved = torch.load(interrupted / last, map_location="cpu", weights_only=True)

    resumed = run_hfmca(interrupted, *args, "--ckpt_path", "last", log_name="resumed.log", test_classes=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert final_step == 3 * 4
    assert_same_tensors(expected, checkpoint_tensors(interrupted / last))
    # stopped after step 3's second micro-batch: 6 batches of 8 images seen, and said so
    assert saved["global_step"] == 3 and saved["MultiViewDataModule"]["position"]["samples_seen"] == 6 * 8
    assert "SIGTERM: saved the state after step 3" in stopped.stdout, stopped.stdout[-3000:]
