"""The value types of the commands' options (hfmca_lightning/cli/options.py): a value out of range is the command's
usage error naming the option, exit status 2, before any checkpoint is read or any work is done."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from hfmca_lightning.cli import main, options

NO_CHECKPOINT = "nowhere.ckpt"  # never read: the options are refused first

CASES = {
    "knn --k 0": (["knn", "--k", "0"], "argument --k: must be >= 1; got 0"),
    "knn --temperature nan": (["knn", "--temperature", "nan"], "argument --temperature: must be a finite number > 0"),
    "knn --temperature inf": (["knn", "--temperature", "0.1", "inf"], "argument --temperature: must be a finite"),
    "knn --device tpu": (["knn", "--device", "tpu"], "argument --device: 'tpu' is not a device"),
    "linear --lr -1": (["linear", "--lr", "-1"], "argument --lr: must be a finite number > 0; got -1"),
    "linear --lr nan": (["linear", "--finetune", "--lr", "nan"], "argument --lr: must be a finite number > 0"),
    "linear --batch_size 0": (["linear", "--batch_size", "0"], "argument --batch_size: must be >= 1; got 0"),
    "linear --epochs 0": (["linear", "--epochs", "0"], "argument --epochs: must be >= 1; got 0"),
    "linear --seed -1": (["linear", "--seed", "-1"], "argument --seed: must be in [0, 2**32 - 1]; got -1"),
    "export --device tpu": (["export", "--out", "e", "--device", "tpu"], "argument --device: 'tpu' is not a device"),
    "analyze --num_images 0": (["analyze", "--out", "a", "--num_images", "0"], "argument --num_images: must be >= 1"),
    "analyze --num_batches -1": (["analyze", "--out", "a", "--num_batches", "-1"], "argument --num_batches: must"),
    "analyze --first_image -1": (["analyze", "--out", "a", "--first_image", "-1"], "argument --first_image: must be"),
    "analyze --image_class -2": (["analyze", "--out", "a", "--image_class", "-2"], "argument --image_class: must be"),
    "analyze --groups_per_feature 0": (
        ["analyze", "--out", "a", "--groups_per_feature", "0"],
        "argument --groups_per_feature: must be >= 1; got 0",
    ),
    "compare --num_batches 0": (
        ["compare", "--ckpt_a", NO_CHECKPOINT, "--ckpt_b", NO_CHECKPOINT, "--out", "c", "--num_batches", "0"],
        "argument --num_batches: must be >= 1; got 0",
    ),
}


@pytest.mark.parametrize(("arguments", "message"), CASES.values(), ids=CASES.keys())
def test_an_option_out_of_its_range_is_a_usage_error_before_any_work(
    arguments: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    command, *rest = arguments
    checkpoint = [] if command == "compare" else ["--ckpt_path", NO_CHECKPOINT]
    with pytest.raises(SystemExit) as exit_info:
        main([command, *checkpoint, *rest])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"hfmca: error: {command}: "), err
    assert message in err and err.rstrip().endswith(f"(see `hfmca {command} --help`)"), err
    assert not list(tmp_path.iterdir())  # no --out folder made


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["knn"], "knn: the following arguments are required: --ckpt_path"),
        (["export", "--ckpt_path", NO_CHECKPOINT], "export: the following arguments are required: --out"),
        (
            ["analyze", "--ckpt_path", NO_CHECKPOINT, "--out", "a", "--bogus", "1"],
            "analyze: unrecognized arguments: --bogus 1 (see `hfmca analyze --help`)",
        ),
        (
            ["knn", "--ckpt_path", NO_CHECKPOINT, "--temprature", "0.1"],
            "knn: unrecognized arguments: --temprature 0.1; did you mean --temperature? (see `hfmca knn --help`)",
        ),
        (
            ["export", "--ckpt_path", NO_CHECKPOINT, "--out", "e", "--embedings"],
            "export: unrecognized arguments: --embedings; did you mean --embeddings? (see `hfmca export --help`)",
        ),
        (["knn", "--ckpt_path", NO_CHECKPOINT, "--hh"], "knn: unrecognized arguments: --hh (see `hfmca knn --help`)"),
        (["dashboard", "--entity"], "dashboard: argument --entity: expected one argument"),
    ],
    ids=[
        "knn without --ckpt_path",
        "export without --out",
        "analyze --bogus",
        "knn typo",
        "export typo",
        "no long option close",
        "dashboard",
    ],
)
def test_a_command_line_mistake_is_one_line(arguments: list[str], message: str, tmp_path: Path, monkeypatch, capsys):
    """Every command's parser, as ``hfmca fit``'s: one line ``hfmca: error: ...``, exit status 2, no usage text."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("hfmca: error: ") and message in err and "usage:" not in err, err


def test_the_types_accept_their_ranges_and_refuse_the_rest() -> None:
    assert options.positive_int("3") == 3 and options.non_negative_int("0") == 0
    assert options.seed("0") == 0 and options.seed(str(2**32 - 1)) == 2**32 - 1
    assert options.finite_positive_float("1e-3") == 1e-3
    assert options.device_name("cpu") == "cpu"
    for parse, value in [
        (options.positive_int, "0"),
        (options.positive_int, "1.5"),
        (options.non_negative_int, "-1"),
        (options.seed, str(2**32)),
        (options.finite_positive_float, "0"),
        (options.finite_positive_float, "-inf"),
        (options.finite_positive_float, "abc"),
        (options.device_name, "cuda:x"),
        (options.device_name, "meta"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(value)
    if not torch.cuda.is_available():
        with pytest.raises(argparse.ArgumentTypeError, match="no CUDA GPU"):
            options.device_name("cuda")


@pytest.mark.parametrize("command", ["knn", "linear"])
def test_a_missing_checkpoint_is_one_line_before_the_output_folder_is_made(command, tmp_path, capsys):
    """The default ``--out`` is the run's ``evaluation`` folder: not made for a checkpoint that is not there, and no
    advice of ``--ckpt_path last``, which only fit, validate and test take."""
    checkpoint = tmp_path / "run" / "checkpoints" / "missing.ckpt"
    checkpoint.parent.mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--ckpt_path", str(checkpoint)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"hfmca: error: checkpoint not found: {checkpoint}"), err
    assert "last" not in err and not (tmp_path / "run" / "evaluation").exists()
