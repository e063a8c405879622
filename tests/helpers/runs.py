"""Runs of the ``hfmca`` command: in-process (``fit``, a shrunk demo config) and as a subprocess with real workers,
signals and files; the in-process Trainer settings most tests share."""

from __future__ import annotations

import copy
import csv
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from hfmca_lightning.cli import main

REPO = Path(__file__).resolve().parents[2]


DEMO = REPO / "configs" / "demo.yaml"


DEMO_TINY_MODEL = {
    "init_args": {
        "backbone": {"class_path": "hfmca_lightning.models.SmallConvNet", "init_args": {"width": 8, "num_stages": 2}},
        "projector": {
            "class_path": "hfmca_lightning.models.ViewProjector",
            "init_args": {"input_dim": 16, "output_dim": 16, "hidden_dim": 32},
        },
        "external_head": {
            "class_path": "hfmca_lightning.models.GridExternalHead",
            "init_args": {"feature_dim": 16, "grid_height": 2, "grid_width": 2, "hidden_dim": 16, "noise_channels": 0},
        },
    }
}


def tiny_overrides(tmp_path: Path, model: dict | None = None, **extra: object) -> Path:
    """Shrink a run to a few seconds: tiny data, one epoch, outputs under tmp_path; ``model`` overrides
    (default: a tiny version of the demo's model)."""
    config = {
        "trainer": {
            "max_epochs": 1,
            "max_steps": -1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "logs"), "name": "run"},
            },
            "callbacks": [
                {"class_path": "hfmca_lightning.callbacks.KNNEvaluation", "init_args": {"k": 20}},
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / "checkpoints"), "save_last": True},
                },
            ],
        },
        "model": copy.deepcopy(DEMO_TINY_MODEL if model is None else model),
        "data": {
            "init_args": {
                "source": {
                    "class_path": "hfmca_lightning.data.SyntheticShapes",
                    "init_args": {"num_classes": 4, "train_per_class": 8, "test_per_class": 3},
                },
                "batch_size": 8,
                "eval_batch_size": 64,
                "num_workers": 0,
            }
        },
    }
    for dotted, value in extra.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "overrides.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit(tmp_path: Path, *args: str, **extra: object) -> None:
    main(["fit", "--config", str(DEMO), "--config", str(tiny_overrides(tmp_path, **extra)), *args])


def interrupted_fit(tmp_path: Path, after_epochs: int, *args: str, **extra: object) -> None:
    overrides = tiny_overrides(tmp_path, **extra)
    config = yaml.safe_load(overrides.read_text())
    stop = {"class_path": "tests.helpers.StopAfterEpochs", "init_args": {"epochs": after_epochs}}
    config["trainer"]["callbacks"].append(stop)
    overrides.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(DEMO), "--config", str(overrides), *args])


def logged(tmp_path: Path, metric: str) -> list[float]:
    rows = list(csv.DictReader(open(next((tmp_path / "logs").glob("run/version_*/metrics.csv")))))
    return [float(row[metric]) for row in rows if row.get(metric)]


class StopAfterEpochs(Callback):
    """Interrupt a run after ``epochs`` epochs, as a crash or a time limit would (the schedule is unchanged)."""

    def __init__(self, epochs: int = 1) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


class LogsUselesslyAfterOneStep(Callback):
    """A callback with a bug Lightning raises a ``MisconfigurationException`` for, once training has begun."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if trainer.global_step >= 1:
            pl_module.log("x", 1.0, on_step=False, on_epoch=False)


HFMCA = Path(sys.executable).with_name("hfmca")


DISTRIBUTED_ENVIRONMENT = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
)


SHRUNK_DATA = {
    "source": {
        "class_path": "hfmca_lightning.data.SyntheticShapes",
        "init_args": {"num_classes": 4, "train_per_class": 16, "test_per_class": 3},
    },
    "batch_size": 8,
    "eval_batch_size": 64,
}


def write_overrides(folder: Path, name: str, overrides: dict) -> Path:
    """A second ``--config`` file that shrinks a shipped config (sizes only; callbacks and logger stay)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(overrides))
    return path


def start_hfmca(
    cwd: Path,
    *args: str,
    log_name: str = "hfmca.log",
    test_classes: bool = False,
    file_size_limit: int | None = None,
) -> subprocess.Popen:
    """Start ``hfmca <args>`` in ``cwd`` (relative paths of the shipped configs land there) in its own process
    group, output to ``cwd/<log_name>``; ``test_classes``: configs may name classes of this test suite
    (``tests.<module>.<class>``); ``file_size_limit``: the largest file in bytes the command may write
    (``RLIMIT_FSIZE``, as ``ulimit -f``; a write past it fails with EFBIG, as on a full disk; its log counts too)."""
    # A fresh shell's environment: a WANDB_SERVICE or MASTER_PORT inherited from this process (tests that ran
    # W&B or DDP in-process leave them behind) would make every subprocess share one W&B service or one
    # rendezvous port, unlike separate runs of the command.
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("WANDB_") and name not in DISTRIBUTED_ENVIRONMENT
    }
    # PYTHONFAULTHANDLER: a run that hangs is sent SIGABRT, and every process prints where it was.
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    if test_classes:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = open(cwd / log_name, "w")
    return subprocess.Popen(
        [str(HFMCA), *args],
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=None if file_size_limit is None else lambda: _limit_file_size(file_size_limit),
    )


def _limit_file_size(limit: int) -> None:
    """In the child before it runs the command: writes past ``limit`` bytes fail with EFBIG instead of killing it."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # stays ignored across exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


class HFMCATimeout(AssertionError):
    """An ``hfmca`` subprocess did not finish in time; the message ends with every process's Python stacks."""


def run_hfmca(
    cwd: Path,
    *args: str,
    timeout: float = 240,
    log_name: str = "hfmca.log",
    test_classes: bool = False,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """Run ``hfmca <args>`` to completion (``file_size_limit``: as :func:`start_hfmca`); returns the process with
    ``stdout`` = its whole output.

    On time-out every process of the run (DDP ranks, data-loader workers) gets SIGABRT, which makes it print
    its Python stacks (faulthandler), then SIGKILL; :class:`HFMCATimeout` carries the output."""
    process = start_hfmca(cwd, *args, log_name=log_name, test_classes=test_classes, file_size_limit=file_size_limit)
    return finish_hfmca(process, cwd, timeout=timeout, log_name=log_name)


def finish_hfmca(
    process: subprocess.Popen, cwd: Path, timeout: float = 240, log_name: str = "hfmca.log"
) -> subprocess.CompletedProcess:
    """Wait for a run started by :func:`start_hfmca` (as :func:`run_hfmca` does; a reference run started first
    and finished later overlaps its start-up with the test's other runs), then check that nothing in its process
    group (DDP ranks, data-loader workers) outlived it, whatever its exit status."""
    args = process.args[1:]  # type: ignore[index]
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGABRT)
        time.sleep(3)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise HFMCATimeout(
            f"hfmca {' '.join(args)} did not finish in {timeout} s:\n{(cwd / log_name).read_text()[-8000:]}"
        ) from None
    output = (cwd / log_name).read_text()
    assert_nothing_left(process, output)
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def group_processes(group: int) -> list[int]:
    """Pids of the live processes of a process group (a run started by :func:`start_hfmca` leads its own: the group
    id is its pid; its data-loader workers and DDP ranks join it); empty where there is no ``/proc``."""
    found = []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            found.append(int(entry.name))
    return found


def assert_nothing_left(process: subprocess.Popen, output: str = "") -> None:
    """Fail (after killing them) if processes of ``process``'s group are alive 30 s after it exited (a DDP rank
    other than 0 ends on its own after rank 0; a leaked worker never does)."""
    deadline = time.monotonic() + 30
    while group_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = group_processes(process.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # ended since the scan
            pass
    assert left == [], f"processes of the command still alive after it exited: {left}\n{output[-3000:]}"


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, timeout: float = 120) -> None:
    """Poll ``condition`` every 10 ms while ``process`` runs; fail if it ends or time runs out first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"hfmca ended (status {process.returncode}) before the awaited moment")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError("timed out waiting for the awaited moment")
        time.sleep(0.01)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (weights, buffers, optimiser state, callback states such as the online
    linear probe's), flattened by key path."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    tensors: dict[str, torch.Tensor] = {}

    def visit(node: object, key: str) -> None:
        if isinstance(node, torch.Tensor):
            tensors[key] = node
        elif isinstance(node, dict):
            for name, child in node.items():
                visit(child, f"{key}/{name}")
        elif isinstance(node, (list, tuple)):
            for index, child in enumerate(node):
                visit(child, f"{key}/{index}")

    visit(
        {
            "state_dict": checkpoint["state_dict"],
            "optimizer_states": checkpoint["optimizer_states"],
            "callbacks": checkpoint.get("callbacks", {}),
        },
        "",
    )
    return tensors


def quiet_trainer(**options: object) -> Trainer:
    """A ``Trainer`` for in-process tests: no logger, checkpoints, progress bar, model summary or sanity check, unless
    ``options`` say otherwise."""
    settings: dict = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return Trainer(**{**settings, **options})
