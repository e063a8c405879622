"""One process of a two-process DDP run fails alone: every process stops within seconds, one line names it, and the
checkpoints written before stay on disk to continue from (hfmca_lightning.runtime.ranks), as ``hfmca fit`` runs it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.helpers import DEMO, run_hfmca, tiny_overrides


@pytest.mark.integration
@pytest.mark.parametrize("rank", [pytest.param(1, marks=pytest.mark.extended), pytest.param(0, marks=pytest.mark.slow)])
def test_one_failing_process_stops_every_process_with_one_line(rank: int, tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(checkpoints), "save_last": True, "every_n_train_steps": 1},
        },
        {"class_path": "tests.helpers.RaiseAtStep", "init_args": {"step": 2, "rank": rank}},
    ]
    overrides = tiny_overrides(
        tmp_path, **{"trainer.callbacks": callbacks, "trainer.limit_val_batches": 0, "trainer.max_epochs": 5}
    )
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    began = time.monotonic()
    done = run_hfmca(
        tmp_path, "fit", "--config", str(DEMO), "--config", str(overrides), *ddp, timeout=120, test_classes=True
    )
    seconds = time.monotonic() - began
    errors = [line for line in done.stdout.splitlines() if line.startswith("hfmca: error: ")]
    assert done.returncode == 1, done.stdout[-3000:]
    assert errors == [
        f"hfmca: error: process {rank} of 2 failed: OSError: image 17 of the batch is unreadable (simulated on "
        f"process {rank}); continue from the last checkpoint with the same command and `--ckpt_path last`."
    ], done.stdout[-3000:]
    assert "Traceback" not in done.stdout, done.stdout[-3000:]
    assert seconds < 60, seconds  # start-up and two steps, then the observer's poll of a few seconds
    assert torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 2
