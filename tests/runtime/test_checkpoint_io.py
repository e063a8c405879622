"""Checkpoint files survive kills: a process SIGKILLed while saving leaves the previous complete file."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.runtime.checkpoint_io import AtomicCheckpointIO, read_checkpoint
from hfmca_lightning.runtime.files import partial_path

# Saves a ~16 MB checkpoint to argv[1] over and over, with the writer named in argv[2].
WRITER = """
import sys, torch
from hfmca_lightning.runtime.checkpoint_io import AtomicCheckpointIO
path, writer = sys.argv[1], sys.argv[2]
state = {"state_dict": {"weight": torch.randn(4_000_000)}, "pytorch-lightning_version": "2", "global_step": 0}
save = AtomicCheckpointIO().save_checkpoint if writer == "atomic" else torch.save
while True:
    state["global_step"] += 1
    save(state, path)
"""


def kill_while_saving(folder: Path, writer: str, rounds: int) -> list[bool]:
    """SIGKILL ``rounds`` processes that each save in a loop to ``folder/round<i>/last.ckpt``, each at a random
    moment after its first save; whether each file was readable after its kill. The processes start together
    (their imports overlap) and are killed one after another."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    rng = random.Random(0)
    paths = [folder / f"round{index}" / "last.ckpt" for index in range(rounds)]
    processes = []
    for path in paths:
        path.parent.mkdir(parents=True)
        processes.append(subprocess.Popen([sys.executable, "-c", WRITER, str(path), writer], env=env))
    readable = []
    try:
        for path, process in zip(paths, processes):
            deadline = time.monotonic() + 60
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05 + rng.random() * 0.2)
            process.send_signal(signal.SIGKILL)
            process.wait()
            try:
                readable.append(read_checkpoint(path)["global_step"] >= 1)
            except ConfigurationError:
                readable.append(False)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return readable


@pytest.mark.extended
@pytest.mark.integration  # a subprocess or a training run
def test_a_kill_while_saving_never_leaves_a_truncated_checkpoint(tmp_path):
    assert all(kill_while_saving(tmp_path, "atomic", rounds=4))
    for folder in tmp_path.iterdir():
        assert len(list(folder.glob(".last.ckpt.*.partial"))) <= 1  # what the kill interrupted, at most


@pytest.mark.slow  # a check of the harness, not of the package
def test_the_kill_harness_does_catch_a_plain_torch_save(tmp_path):
    """The same kills truncate a file written in place: the harness above can see the failure it guards against."""
    assert not all(kill_while_saving(tmp_path, "plain", rounds=4))


def test_a_failed_save_keeps_the_previous_file_and_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {}, "pytorch-lightning_version": "2", "global_step": 1}, target)

    def disk_full(checkpoint, handle):
        handle.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"state_dict": {}, "pytorch-lightning_version": "2", "global_step": 2}, target)
    monkeypatch.undo()
    assert read_checkpoint(target)["global_step"] == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_save_leaves_the_partial_file_of_a_live_writer_and_removes_a_killed_ones(tmp_path):
    """Two processes saving into one folder: neither deletes the file the other is writing; a killed writer's file
    goes with the first save after its death."""
    target = tmp_path / "last.ckpt"
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = partial_path(target).name.split(".")[-3]  # .last.ckpt.<host>.<pid>.partial
        being_written = tmp_path / f".last.ckpt.{host}.{writer.pid}.partial"
        being_written.write_bytes(b"the first half of another process's checkpoint")
        io = AtomicCheckpointIO()
        io.save_checkpoint({"state_dict": {}, "pytorch-lightning_version": "2", "global_step": 1}, target)
        assert being_written.exists()
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        io.save_checkpoint({"state_dict": {}, "pytorch-lightning_version": "2", "global_step": 2}, target)
        assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]
        assert read_checkpoint(target)["global_step"] == 2
    finally:
        writer.kill()
        writer.wait()


def test_every_hfmca_fit_writes_with_the_atomic_writer(tmp_path):
    from hfmca_lightning.cli.trainer_cli import HFMCACLI
    from tests.helpers import DEMO

    cli = HFMCACLI(args=["--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)


JUNK_FILES = {
    "text": b"junk\n",  # read as a pickle: 'j' asks for a memo entry that does not exist
    "random bytes": bytes(random.Random(0).randrange(256) for _ in range(4096)),
    "empty": b"",
    "a pickle of a list with a missing memo": b"\x80\x02]q\x00h\x07a.",
    "a zip without a checkpoint": b"PK\x05\x06" + bytes(18),
}


@pytest.mark.parametrize("contents", JUNK_FILES.values(), ids=JUNK_FILES.keys())
def test_a_file_that_is_no_checkpoint_is_one_clear_error(tmp_path: Path, contents: bytes) -> None:
    """Whatever bytes a file holds, reading it as a checkpoint is one ConfigurationError naming it, never an error
    from inside torch's unpickler (a KeyError, an IndexError, ...)."""
    path = tmp_path / "junk.ckpt"
    path.write_bytes(contents)
    with pytest.raises(ConfigurationError, match="junk.ckpt is not a readable checkpoint"):
        read_checkpoint(path)


def test_a_checkpoint_whose_state_dict_is_no_mapping_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "odd.ckpt"
    torch.save({"state_dict": [torch.zeros(2)], "pytorch-lightning_version": "2.5.0"}, path)
    with pytest.raises(ConfigurationError, match="odd.ckpt is not a Lightning training checkpoint"):
        read_checkpoint(path)
