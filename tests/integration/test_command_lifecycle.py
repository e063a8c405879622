"""Every ``hfmca`` subcommand ends promptly and cleanly, as a user runs it: a subprocess on the shrunk demo with the
shipped config's data-loader workers (2, persistent), its exit status, no traceback, nothing of it left alive (which
``finish_hfmca`` checks after each run it waits for, whatever its exit status); Ctrl-C (SIGINT to the process group,
as a terminal sends it) ends ``analyze``, ``compare`` and ``fit`` mid-way and every other command as it starts with
one line and exit status 130, SIGTERM ends ``analyze`` with one line and 143; the commands that train nothing print
no Lightning banner or advertisement; ``-q`` and ``-v`` do what they say."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import DEMO, HFMCA, finish_hfmca, start_hfmca, tiny_overrides, wait_for

WORKERS = {"data.init_args.num_workers": 2, "data.init_args.persistent_workers": True}  # as configs/demo.yaml ships


def timed_run(folder: Path, arguments: list[str], log: str) -> tuple[subprocess.CompletedProcess, float]:
    """``hfmca <arguments>`` in ``folder`` (nothing of it left afterwards: ``finish_hfmca``), and the seconds from its
    last output to its exit."""
    result = finish_hfmca(start_hfmca(folder, *arguments, log_name=log), folder, timeout=240, log_name=log)
    return result, time.time() - (folder / log).stat().st_mtime


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, tuple[subprocess.CompletedProcess, float]]:
    """A run of the shrunk demo (2 epochs, persistent workers, its progress reported): its folder, last checkpoint and
    the run itself (the ``fit`` case of the lifecycle test)."""
    folder = tmp_path_factory.mktemp("run")
    arguments = ["fit", "--config", str(DEMO), "--config", str(tiny_overrides(folder, **WORKERS))]
    run = timed_run(
        folder, [*arguments, "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "true"], "fit.log"
    )
    assert run[0].returncode == 0, run[0].stdout[-3000:]
    return folder, folder / "checkpoints" / "last.ckpt", run


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
    quiet = ["analyze", "--ckpt_path", str(checkpoint), "--out", str(folder / "quiet"), "--num_images", "2"]
    return {
        "validate": ["validate", *config, "--ckpt_path", str(checkpoint)],
        "test": ["test", *config, "--ckpt_path", str(checkpoint)],
        "analyze": ["analyze", "--ckpt_path", str(checkpoint), "--out", str(folder / "analysis"), "--num_images", "2"],
        "compare": ["compare", "--ckpt_a", str(checkpoint), "--ckpt_b", str(checkpoint), "--out", str(folder / "cmp")],
        "linear": ["linear", "--ckpt_path", str(checkpoint), "--epochs", "2", "--device", "cpu"],
        "knn": ["knn", "--ckpt_path", str(checkpoint), "--k", "5", "--device", "cpu"],
        "export": ["export", "--ckpt_path", str(checkpoint), "--out", str(folder / "export"), "--embeddings", "test"],
        "dashboard": ["dashboard", "--entity", "e", "--project", "p", "--config", str(DEMO), "--dry-run"],
        # the verbosity options, before the command
        "-v validate": ["-v", "validate", *config, "--ckpt_path", str(checkpoint)],
        "-q analyze": ["-q", *quiet],
    }


@pytest.mark.parametrize(
    "command",
    [
        *("fit", "analyze", "linear", "export", "test"),
        # each command once more in CI: the same checks, the same start-up and shut-down code
        *(pytest.param(name, marks=pytest.mark.extended) for name in ("validate", "-v validate", "compare", "knn")),
        *(pytest.param(name, marks=pytest.mark.extended) for name in ("dashboard", "-q analyze")),
    ],
)
def test_each_command_ends_promptly_and_cleanly(trained, command):
    """Exit status 0 within seconds of the last output, no traceback, nothing left alive; Lightning's banners (``GPU
    available``) only in ``fit`` and with ``-v``, its advertisements never; ``-q`` leaves no progress line but the
    results; ``validate`` and ``test`` print their metrics."""
    folder, checkpoint, fit_run = trained
    if command == "fit":  # the fixture's run
        result, silent = fit_run
    else:
        log = f"{command.replace(' ', '-').lstrip('-')}.log"  # -v validate: v-validate.log
        result, silent = timed_run(folder, commands(folder, checkpoint)[command], log)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Traceback" not in result.stdout and "Exception ignored" not in result.stdout, result.stdout[-3000:]
    assert silent < 5, f"exited {silent:.1f} s after its last output"
    lines = result.stdout.lower().splitlines()
    assert not [line for line in lines if "litlogger" in line], result.stdout[-2000:]
    banners = [line for line in lines if "gpu available" in line]
    assert bool(banners) == (command in ("fit", "-v validate")), result.stdout[-2000:]
    if command == "fit":  # output to a file: a line per epoch, no bar's redraws; where the last checkpoint is
        epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
        assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"], result.stdout[-2000:]
        assert all(re.search(r"knn/top1 [\d.]+.*cost/external -?[\d.]+ \([\d.]+ s\)$", line) for line in epochs)
        assert "it/s" not in result.stdout and "\r" not in result.stdout, result.stdout[-2000:]
        assert f"hfmca: last checkpoint: {checkpoint}" in result.stdout, result.stdout[-2000:]
    if command.endswith(("validate", "test")):  # a table of the metrics, each once
        stage = command.split()[-1]
        header = re.search(rf"^{stage} metric +value$", result.stdout, re.M)
        assert header, result.stdout[-2000:]
        table = result.stdout[header.end() :].split("\n\n")[0].split()[::2]
        names = table
        assert any(name.startswith("knn/") for name in names) and len(names) == len(set(names)), result.stdout[-2000:]
        assert "dataloader" not in result.stdout.lower() and "it/s" not in result.stdout, result.stdout[-2000:]
        assert ("restoring states" in result.stdout.lower()) == command.startswith("-v"), result.stdout[-2000:]
        assert "deprecated" not in result.stdout, result.stdout[-2000:]
    if command == "-q analyze":
        progress = [line for line in lines if line.startswith("hfmca:") and not line.startswith("hfmca: warning")]
        assert not progress and "wrote" in result.stdout, result.stdout[-2000:]  # warnings and the result only
        assert (folder / "quiet" / "index.html").is_file(), sorted(path.name for path in (folder / "quiet").iterdir())
    elif command == "analyze":
        assert [line for line in lines if line.startswith("hfmca:")], result.stdout[-2000:]  # its stage lines


@pytest.mark.parametrize(
    ("command", "signal_number"),
    [
        *(pytest.param(name, signal.SIGINT, marks=pytest.mark.extended) for name in ("analyze", "compare", "fit")),
        ("analyze", signal.SIGTERM),
    ],
    ids=["analyze", "compare", "fit", "analyze-sigterm"],
)
def test_ctrl_c_and_sigterm_end_the_command_with_one_line(trained, command, signal_number):
    """SIGINT to the whole process group mid-way (the command, its workers), as Ctrl-C in a terminal: one line, exit
    status 130, no traceback, nothing left; ``fit`` after Lightning's graceful shutdown, its line saying how to
    continue. SIGTERM (as ``kill`` or a scheduler sends it) to a command that trains nothing: one line, status 143.
    (SIGTERM to ``fit``: tests/integration/test_resume.py.)"""
    folder, checkpoint, _ = trained
    arguments = commands(folder, checkpoint).get(command, [])
    log = f"interrupted-{command}-{signal_number.name}.log"
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
        arguments[arguments.index("--out") + 1] = str(folder / log.removesuffix(".log"))  # a folder of its own
        if command == "compare":  # compare reads model A's data from its checkpoint: give it one with the larger data
            arguments[arguments.index("--ckpt_a") + 1] = str(larger_checkpoint(folder, config, checkpoint))
        ready = lambda: "statistics of" in (folder / log).read_text()  # noqa: E731
    else:  # a run of its own (the first checkpoint: training is under way)
        arguments = ["fit", "--config", str(DEMO), "--config", str(tiny_overrides(folder / "long", **WORKERS))]
        arguments += ["--trainer.max_epochs", "200"]
        ready = (folder / "long" / "checkpoints" / "last.ckpt").is_file
    process = start_hfmca(folder, *arguments, log_name=log)
    wait_for(ready, process, timeout=180)
    # SIGTERM at once, as the stage's loader starts its workers: a signal that cuts the construction of a DataLoader
    # iterator short still gives one line (its finaliser fails quietly, hfmca_lightning.cli.console)
    time.sleep(0.0 if signal_number == signal.SIGTERM else 1.0)
    os.killpg(process.pid, signal_number)
    result = finish_hfmca(process, folder, timeout=60, log_name=log)
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    if signal_number == signal.SIGTERM:
        assert result.returncode == 143, result.stdout[-3000:]
        stopped = [line for line in result.stdout.splitlines() if line.startswith("hfmca: stopped by SIGTERM")]
        assert stopped == ["hfmca: stopped by SIGTERM; nothing was written."], result.stdout[-3000:]
        return
    assert result.returncode == 130, result.stdout[-3000:]
    interrupted = [line for line in result.stdout.splitlines() if line.startswith("hfmca: interrupted")]
    assert len(interrupted) == 1, result.stdout[-3000:]
    if command == "fit":
        assert "attempting graceful shutdown" in result.stdout, result.stdout[-3000:]  # Lightning's, then ours
        assert "--ckpt_path last" in interrupted[0]
        # the checkpoint to continue from is still a whole, loadable one after the shutdown
        assert torch.load(folder / "long" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] > 0


@pytest.mark.parametrize("command", ["validate", "test", "linear", "knn", "export", "dashboard"])
def test_ctrl_c_while_a_command_starts_ends_it_with_one_line(trained, command):
    """README: Ctrl-C ends any command with one line and status 130; here the commands not interrupted mid-way above,
    a second after they start (importing what they need, before any work)."""
    folder, checkpoint, _ = trained
    log = f"starting-{command}.log"
    process = start_hfmca(folder, *commands(folder, checkpoint)[command], log_name=log)
    time.sleep(1.0)
    os.killpg(process.pid, signal.SIGINT)
    result = finish_hfmca(process, folder, timeout=60, log_name=log)
    assert result.returncode == 130, result.stdout[-3000:]
    assert [line for line in result.stdout.splitlines() if line.strip()] == ["hfmca: interrupted."], result.stdout


def on_a_terminal(folder: Path, arguments: list[str], columns: int) -> tuple[int, str]:
    """``hfmca <arguments>`` with a pseudo-terminal of ``columns`` x 24 as its standard input, output and error, as
    a shell runs it; its exit status and everything it drew."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    process = subprocess.Popen(
        [str(HFMCA), *arguments], cwd=folder, stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True
    )
    os.close(terminal)
    output = bytearray()
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: the command has exited
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    return process.wait(timeout=120), output.decode(errors="replace")


@pytest.mark.extended
def test_a_command_on_a_terminal_draws_progress_bars_and_lines_where_it_cannot(trained):
    """docs/getting-started.md: a progress bar per long stage when standard error is a terminal, one line per stage
    otherwise: also on a terminal of zero columns (a pseudo-terminal nobody sized), where a bar would draw nothing."""
    folder, checkpoint, _ = trained
    arguments = commands(folder, checkpoint)["analyze"]
    arguments[arguments.index("--out") + 1] = str(folder / "analysis-on-a-terminal")
    status, drawn = on_a_terminal(folder, [*arguments, "--overwrite"], columns=80)
    assert status == 0, drawn[-3000:]
    # tqdm redraws its bar in place: carriage returns, a count and a rate of batches
    bars = [part for part in drawn.split("\r") if part.startswith("hfmca: statistics of") and "batch/s" in part]
    assert bars and "statistics of the training groups ..." not in drawn, repr(drawn[-3000:])
    status, drawn = on_a_terminal(folder, [*arguments, "--overwrite"], columns=0)
    assert status == 0, drawn[-3000:]
    lines = drawn.replace("\r\n", "\n").splitlines()
    assert "hfmca: statistics of the training groups ..." in lines, drawn[-3000:]
    assert any(
        re.fullmatch(r"hfmca: statistics of the training groups: \d+ batch(es)? in [\d.]+ s", line) for line in lines
    )
