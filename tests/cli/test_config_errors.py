"""Mistakes in the optimizer and learning-rate schedule settings (keys typed as callables) and in the command name
are one line, ``hfmca: error: ...`` with exit status 2: the key and what is wrong with it, or the commands there
are and the closest one; ``hfmca --version`` prints the version."""

from __future__ import annotations

import subprocess
from importlib.metadata import version

import pytest
import torch

from hfmca_lightning.cli import main
from tests.helpers import DEMO, HFMCA, tiny_overrides

ADAM_KEYS = "lr, betas, eps, weight_decay, amsgrad"
STEP_LR = ["--model.init_args.lr_scheduler", "torch.optim.lr_scheduler.StepLR"]
COMMANDS = "fit, validate, test, analyze, compare, linear, knn, export, dashboard"

# (case, extra command-line args, config changes, the one error line's text)
CASES: list[tuple[str, list[str], dict, str]] = [
    (
        "optimizer value of the wrong type",
        ["--model.init_args.optimizer.init_args.lr", "abc"],
        {},
        "model.init_args.optimizer.init_args.lr: expected a float, got 'abc'",
    ),
    (
        "optimizer value of the wrong type in a config file",
        [],
        {"model.init_args.optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": "abc"}}},
        "model.init_args.optimizer.init_args.lr: expected a float, got 'abc'",
    ),
    (
        "optimizer key its class does not take",
        ["--model.init_args.optimizer.init_args.momentum", "0.9"],
        {},
        "unknown key model.init_args.optimizer.init_args.momentum of Adam. Valid keys here: " + ADAM_KEYS,
    ),
    (
        "optimizer key its class does not take in a config file",
        [],
        {"model.init_args.optimizer": {"class_path": "torch.optim.Adam", "init_args": {"momentum": 0.9}}},
        "unknown key model.init_args.optimizer.init_args.momentum of Adam. Valid keys here: " + ADAM_KEYS,
    ),
    (
        "misspelt optimizer key",
        ["--model.init_args.optimizer.init_args.weight_decy", "0.1"],
        {},
        "did you mean model.init_args.optimizer.init_args.weight_decay?",
    ),
    (
        "optimizer class that does not exist",
        ["--model.init_args.optimizer", "torch.optim.Adamx"],
        {},
        "model.init_args.optimizer: class_path torch.optim.Adamx names no class "
        "(module 'torch.optim' has no attribute 'Adamx')",
    ),
    (
        "schedule value of the wrong type",
        [*STEP_LR, "--model.init_args.lr_scheduler.init_args.step_size", "abc"],
        {},
        "model.init_args.lr_scheduler.init_args.step_size: expected an int, got 'abc'",
    ),
    (
        "schedule key its class does not take",
        [*STEP_LR, "--model.init_args.lr_scheduler.init_args.foo", "1"],
        {},
        "unknown key model.init_args.lr_scheduler.init_args.foo of StepLR. Valid keys here: step_size, gamma",
    ),
    (
        "schedule settings without a schedule",
        ["--model.init_args.lr_scheduler.init_args.step_size", "3"],
        {},
        "model.init_args.lr_scheduler: init_args given without a class_path; set "
        "model.init_args.lr_scheduler.class_path",
    ),
]


@pytest.mark.parametrize(("case", "args", "changes", "expected"), CASES, ids=[case[0] for case in CASES])
def test_a_bad_optimizer_or_schedule_setting_is_one_line_naming_the_key(
    case, args, changes, expected, tmp_path, capsys
):
    overrides = tiny_overrides(tmp_path, **changes)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(DEMO), "--config", str(overrides), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("hfmca: error: ")]
    assert len(lines) == 1 and expected in lines[0], err
    assert "expects a function" not in err and "Namespace(" not in err and "Traceback" not in err, err
    assert not (tmp_path / "checkpoints").exists(), "training started"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["analyse", "--ckpt_path", "last.ckpt"], "unknown command 'analyse'; did you mean analyze?"),
        (["fitt", "--config", str(DEMO)], "unknown command 'fitt'; did you mean fit?"),
        (["-q", "evalute"], "unknown command 'evalute'"),
        (["--config", str(DEMO), "fitt"], "unknown command 'fitt'; did you mean fit?"),
        ([], "no command given; usage: hfmca [-q | -v] <command>"),
        (["-v"], "no command given; usage: hfmca [-q | -v] <command>"),
        (["--config", str(DEMO)], "no command given; usage: hfmca [-q | -v] <command>"),
    ],
)
def test_a_missing_or_unknown_command_lists_every_command(args, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("hfmca: error: ")]
    assert len(lines) == 1 and expected in lines[0] and COMMANDS in lines[0], err
    assert len(err.strip().splitlines()) == 1, err


def test_predict_which_no_module_implements_points_to_the_embeddings_export(capsys):
    """Before: listed among the commands, and Lightning's "`predict_dataloader` must be implemented" after start-up."""
    for args in (["predict", "--config", str(DEMO)], ["--config", str(DEMO), "predict"]):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("hfmca: error: hfmca has no predict command: `hfmca export --ckpt_path <checkpo"), err
        assert "--embeddings train test" in err


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_run_without_a_config_says_to_give_one(command, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--trainer.max_steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip() == (
        f"hfmca: error: the following arguments are required: {command}.data, {command}.model: give the run's "
        f"config, hfmca {command} --config <run.yaml> (the repository's configs/demo.yaml is one), or the model and "
        "data with --model and --data"
    )
    trainer_only = tmp_path / "trainer.yaml"
    trainer_only.write_text("trainer:\n  max_epochs: 1\n")
    with pytest.raises(SystemExit):
        main([command, "--config", str(trainer_only)])
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("the configs given set no model: or data: section; add them (--model, --data)")
    )


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(), reason="needs a machine without a GPU"
)  # Lightning takes MPS for accelerator gpu
def test_a_gpu_asked_for_on_a_machine_without_one_says_what_to_set(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(DEMO), "--config", str(tiny_overrides(tmp_path)), "--trainer.accelerator", "gpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip().endswith("(no GPU is visible to this process: set trainer.accelerator to cpu or auto)"), err


def test_version_prints_the_package_version(capsys):
    main(["--version"])
    assert capsys.readouterr().out.strip() == f"hfmca {version('hfmca_lightning')}"


@pytest.mark.integration  # a subprocess
def test_the_console_script_prints_its_version_and_exits_0(tmp_path):
    result = subprocess.run([str(HFMCA), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hfmca {version('hfmca_lightning')}", result.stdout
