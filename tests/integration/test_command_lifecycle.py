"""Every ``hfmca`` subcommand ends promptly and cleanly, as a user runs it: a subprocess on the shrunk demo with the
shipped config's data-loader workers (2, persistent), its exit status, no traceback, nothing of it left alive; Ctrl-C
(SIGINT to the process group, as a terminal sends it) ends ``analyze``, ``compare`` and ``fit`` with one line and exit
status 130; and the commands that train nothing print no Lightning banner or advertisement."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import DEMO, finish_hfmca, run_hfmca, start_hfmca, tiny_overrides, wait_for

WORKERS = {"data.init_args.num_workers": 2, "data.init_args.persistent_workers": True}  # as configs/demo.yaml ships


def session_processes(session: int) -> list[int]:
    """Pids of the live processes of a session (a subprocess started with ``start_new_session``: its own id)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # fields: state, ppid, pgrp, session, ...
            found.append(int(entry.name))
    return found


def assert_nothing_left(process) -> None:
    deadline = time.monotonic() + 5
    while session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = session_processes(process.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes of the command still alive after it exited: {left}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A run of the shrunk demo (2 epochs, persistent workers): its folder and last checkpoint."""
    folder = tmp_path_factory.mktemp("run")
    result = run_hfmca(
        folder,
        "fit",
        "--config",
        str(DEMO),
        "--config",
        str(tiny_overrides(folder, **WORKERS)),
        "--trainer.max_epochs",
        "2",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return folder, folder / "checkpoints" / "last.ckpt"


def merged(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` applied key by key (dictionaries merged, other values replaced)."""
    result = dict(base)
    for key, value in overrides.items():
        result[key] = (
            merged(result[key], value) if isinstance(value, dict) and isinstance(result.get(key), dict) else value
        )
    return result


def larger_checkpoint(folder: Path, config: Path, checkpoint: Path) -> Path:
    """``checkpoint`` with ``config`` stored in it instead of its run's (commands read the data from there)."""
    import torch

    state = torch.load(checkpoint, weights_only=False)
    state["callbacks"]["StoredConfig"] = {"config": config.read_text()}
    path = folder / "larger.ckpt"
    torch.save(state, path)
    return path


def commands(folder: Path, checkpoint: Path) -> dict[str, list[str]]:
    config = [
        "--config",
        str(DEMO),
        "--config",
        str(tiny_overrides(folder / "again", **WORKERS)),
    ]
    return {
        "fit": ["fit", *config],
        "validate": ["validate", *config, "--ckpt_path", str(checkpoint)],
        "test": ["test", *config, "--ckpt_path", str(checkpoint)],
        "analyze": ["analyze", "--ckpt_path", str(checkpoint), "--out", str(folder / "analysis"), "--num_images", "2"],
        "compare": ["compare", "--ckpt_a", str(checkpoint), "--ckpt_b", str(checkpoint), "--out", str(folder / "cmp")],
        "linear": ["linear", "--ckpt_path", str(checkpoint), "--epochs", "2", "--device", "cpu"],
        "knn": ["knn", "--ckpt_path", str(checkpoint), "--k", "5", "--device", "cpu"],
        "export": ["export", "--ckpt_path", str(checkpoint), "--out", str(folder / "export"), "--embeddings", "test"],
        "dashboard": ["dashboard", "--entity", "e", "--project", "p", "--config", str(DEMO), "--dry-run"],
    }


TRAIN_NOTHING = ("analyze", "compare", "linear", "knn", "export", "dashboard")


@pytest.mark.parametrize(
    "command", ["fit", "validate", "test", "analyze", "compare", "linear", "knn", "export", "dashboard"]
)
def test_each_command_ends_promptly_and_cleanly(trained, command):
    folder, checkpoint = trained
    log = f"{command}.log"
    process = start_hfmca(folder, *commands(folder, checkpoint)[command], log_name=log)
    result = finish_hfmca(process, folder, timeout=240, log_name=log)
    ended = time.time()
    last_output = (folder / log).stat().st_mtime
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Traceback" not in result.stdout and "Exception ignored" not in result.stdout, result.stdout[-3000:]
    assert ended - last_output < 5, f"exited {ended - last_output:.1f} s after its last output"
    assert_nothing_left(process)
    if command in TRAIN_NOTHING:
        lines = result.stdout.lower().splitlines()
        assert not [line for line in lines if "litlogger" in line or "gpu available" in line], result.stdout[-2000:]
    else:
        assert "litlogger" not in result.stdout.lower()


@pytest.mark.parametrize("command", ["analyze", "compare", "fit"])
def test_ctrl_c_ends_the_command_with_one_line_and_exit_status_130(trained, command):
    """SIGINT to the whole process group mid-way (the command, its workers), as Ctrl-C in a terminal: one line, exit
    status 130, no traceback, nothing left; ``fit`` after Lightning's graceful shutdown."""
    folder, checkpoint = trained
    arguments = commands(folder, checkpoint)[command]
    log = f"interrupted-{command}.log"
    if command in ("analyze", "compare"):
        # the run's config with 2,000 training and 1,000 test images, and statistics that would take long
        larger = tiny_overrides(
            folder / "larger",
            **WORKERS,
            **{
                "data.init_args.source.init_args.train_per_class": 500,
                "data.init_args.source.init_args.test_per_class": 250,
            },
        )
        config = folder / "larger.yaml"
        config.write_text(yaml.safe_dump(merged(yaml.safe_load(DEMO.read_text()), yaml.safe_load(larger.read_text()))))
        option = "--config" if command == "analyze" else None
        arguments += ["--groups_per_feature", "100000"] + ([option, str(config)] if option else [])
        if command == "compare":  # compare reads model A's data from its checkpoint: give it one with the larger data
            arguments[arguments.index("--ckpt_a") + 1] = str(larger_checkpoint(folder, config, checkpoint))
        ready = lambda: "statistics of" in (folder / log).read_text()  # noqa: E731
    else:  # a run of its own (the first checkpoint: training is under way)
        arguments = ["fit", "--config", str(DEMO), "--config", str(tiny_overrides(folder / "long", **WORKERS))]
        arguments += ["--trainer.max_epochs", "200"]
        ready = (folder / "long" / "checkpoints" / "last.ckpt").is_file
    process = start_hfmca(folder, *arguments, log_name=log)
    wait_for(ready, process, timeout=180)
    time.sleep(1.0)
    os.killpg(process.pid, signal.SIGINT)
    result = finish_hfmca(process, folder, timeout=60, log_name=log)
    assert result.returncode == 130, result.stdout[-3000:]
    interrupted = [line for line in result.stdout.splitlines() if line.startswith("hfmca: interrupted")]
    assert len(interrupted) == 1, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    assert_nothing_left(process)
