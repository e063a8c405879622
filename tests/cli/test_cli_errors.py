"""Every bad input a user can give ``hfmca fit`` ends as one line, ``hfmca: error: ...``, with exit status 2,
before any training (an unreadable image: when it is first read, before any checkpoint): the line names the
config key or the file, and says how to fix it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hfmca_lightning.cli import main
from tests.helpers import DEMO, HFMCA, fit, run_hfmca, tiny_overrides, write_image_folder, write_overrides


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trained")
    fit(folder)
    return folder / "checkpoints" / "last.ckpt"


def image_folder(root: Path, damage: Callable[[Path], None]) -> dict:
    write_image_folder(root, per_class=6, num_classes=3, size=40)
    damage(root)
    return {
        "data.init_args.source": {
            "class_path": "hfmca_lightning.data.ImageFolderSource",
            "init_args": {"root": str(root), "image_size": 32},
        }
    }


def without_class_folders(root: Path) -> None:
    """Every image straight in its split folder, the class folders gone."""
    for folder in root.glob("*/class_*"):
        for image in folder.iterdir():
            image.rename(folder.parent / f"{folder.name}_{image.name}")
        folder.rmdir()


def truncated(checkpoint: Path, tmp: Path) -> Path:
    data = checkpoint.read_bytes()
    (tmp / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    return tmp / "truncated.ckpt"


def plain_state_dict(checkpoint: Path, tmp: Path) -> Path:
    torch.save(torch.load(checkpoint, weights_only=True)["state_dict"], tmp / "weights.pt")
    return tmp / "weights.pt"


def diverged(checkpoint: Path, tmp: Path) -> Path:
    """``checkpoint`` with NaN in every weight of its first layer, as a diverged run's."""
    state = torch.load(checkpoint, weights_only=True)
    name = next(key for key, value in state["state_dict"].items() if value.is_floating_point())
    state["state_dict"][name] = torch.full_like(state["state_dict"][name], float("nan"))
    torch.save(state, tmp / "diverged.ckpt")
    return tmp / "diverged.ckpt"


# (case, extra command-line args, config changes, the part of the message that must be there)
CASES: list[tuple[str, Callable[[Path, Path], list[str]], Callable[[Path], dict], str]] = [
    (
        "reg <= 0",
        lambda tmp, ckpt: ["--model.init_args.external_cost.init_args.reg", "0"],
        lambda tmp: {},
        "model.init_args.external_cost.init_args.reg: reg must be a finite number > 0",
    ),
    (
        "projector input_dim other than the backbone's features",
        lambda tmp, ckpt: ["--model.init_args.projector.init_args.input_dim", "7"],
        lambda tmp: {},
        "features, but model.init_args.projector takes input_dim=7: set model.init_args.projector.init_args.input_dim",
    ),
    (
        "head feature_dim other than the projector's output",
        lambda tmp, ckpt: ["--model.init_args.external_head.init_args.feature_dim", "7"],
        lambda tmp: {},
        "features, but model.init_args.external_head takes feature_dim=7",
    ),
    (
        # before: Lightning's MisconfigurationException, a traceback and a Namespace dump
        "a setting ModelCheckpoint refuses",
        lambda tmp, ckpt: [],
        lambda tmp: {
            "trainer.callbacks": [
                {
                    "class_path": "hfmca_lightning.callbacks.PreemptionCheckpoint",
                    "init_args": {"dirpath": str(tmp / "checkpoints"), "every_n_train_steps": -1},
                }
            ]
        },
        "PreemptionCheckpoint: Invalid value for every_n_train_steps=-1. Must be >= 0",
    ),
    # before: Lightning's ValueError and its traceback, exit status 1
    (
        "ckpt_path best",
        lambda tmp, ckpt: ["--ckpt_path", "best"],
        lambda tmp: {},
        "--ckpt_path best names the best checkpoint of a fit earlier in the same process",
    ),
    (
        "ckpt_path hpc without an HPC checkpoint",
        lambda tmp, ckpt: ["--ckpt_path", "hpc"],
        lambda tmp: {},
        'trainer: `.fit(ckpt_path="hpc")` is set but no HPC checkpoint was found',
    ),
    # before: a RuntimeError traceback, exit status 1
    (
        "a second KNNEvaluation",
        lambda tmp, ckpt: ["--trainer.callbacks+=hfmca_lightning.callbacks.KNNEvaluation"],
        lambda tmp: {},
        "Found more than one stateful callback of type `KNNEvaluation`",
    ),
    # before: ignored on one process; under DDP every process failed at the start of training, with advice to resume
    (
        "sync_batchnorm on CPUs",
        lambda tmp, ckpt: ["--trainer.sync_batchnorm", "true"],
        lambda tmp: {},
        "trainer.sync_batchnorm: torch's SyncBatchNorm runs on GPUs only",
    ),
    # before: ran, its checkpoints written and read by the strategy's own code, past the checks of docs/trust.md
    (
        "a strategy that shards the model",
        lambda tmp, ckpt: [],
        lambda tmp: {"trainer.strategy": {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}},
        "HFMCAModule trains on one device or under DDP; ModelParallelStrategy shards the model",
    ),
    # before: trained, then failed reading the weights the spawned process handed back
    (
        "ddp started by spawning",
        lambda tmp, ckpt: ["--trainer.strategy", "ddp_spawn"],
        lambda tmp: {},
        "HFMCAModule trains on one device or under DDP; DDP started by spawn hands the trained weights back",
    ),
    (
        "projector output_dim 0",
        lambda tmp, ckpt: ["--model.init_args.projector.init_args.output_dim", "0"],
        lambda tmp: {},
        "ViewProjector: output_dim must be >= 1; got 0",
    ),
    (
        "negative learning rate",
        lambda tmp, ckpt: ["--model.init_args.optimizer", "torch.optim.SGD", "--model.init_args.optimizer.lr", "-1"],
        lambda tmp: {},
        "the optimizer cannot be built: Invalid learning rate: -1.0 (model.init_args.optimizer)",
    ),
    (
        "more backbone stages than the views have pixels for",
        lambda tmp, ckpt: [
            *("--model.init_args.backbone.init_args.num_stages", "6"),
            *("--model.init_args.projector.init_args.input_dim", "256"),
        ],
        lambda tmp: {},
        "the backbone SmallConvNet needs views of at least 64 px (its stages halve the map), but the data gives 32-px",
    ),
    (
        "negative seed",
        lambda tmp, ckpt: ["--seed_everything", "-1"],
        lambda tmp: {},
        "seed_everything must be in [0, 2**32 - 1], or true for a random seed; got -1",
    ),
    (
        "accelerator without its package",
        lambda tmp, ckpt: ["--trainer.accelerator", "tpu"],
        lambda tmp: {},
        "trainer: Requirement 'torch_xla",
    ),
    (
        "beta outside [0, 1)",
        lambda tmp, ckpt: ["--model.init_args.external_cost.init_args.beta", "1"],
        lambda tmp: {},
        "model.init_args.external_cost.init_args.beta: beta (the adaptive-filter smoothing of paper Alg. 3) must be "
        "in [0, 1)",
    ),
    (
        "an internal cost layer the backbone lacks",
        lambda tmp, ckpt: [],
        lambda tmp: {
            "model.init_args.internal_costs": {
                "class_path": "hfmca_lightning.methods.InternalCosts",
                "init_args": {"layers": ["blocks.L42"]},
            }
        },
        "model.init_args.internal_costs.init_args.layers: internal cost layer 'blocks.L42' is not a module of the "
        "backbone SmallConvNet",
    ),
    (
        "negative num_workers",
        lambda tmp, ckpt: ["--data.init_args.num_workers", "-1"],
        lambda tmp: {},
        "data.init_args.num_workers: num_workers must be >= 0",
    ),
    (
        "batch larger than the split",
        lambda tmp, ckpt: ["--data.init_args.batch_size", "1000"],
        lambda tmp: {},
        "batch_size=1000 is larger than the training split (32 images",
    ),
    (
        "a view count off the head's grid",
        lambda tmp, ckpt: ["--data.init_args.views.init_args.count", "3"],
        lambda tmp: {},
        "data.init_args.views gives 3 views per image, but the external head's 2x2 grid takes 4",
    ),
    (
        "unknown key",
        lambda tmp, ckpt: ["--model.init_args.backbone.init_args.widht", "3"],
        lambda tmp: {},
        "unknown key model.init_args.backbone.init_args.widht of SmallConvNet; did you mean "
        "model.init_args.backbone.init_args.width?",
    ),
    (
        "unknown trainer key",
        lambda tmp, ckpt: ["--trainer.max_epoch_count", "3"],
        lambda tmp: {},
        "unknown key trainer.max_epoch_count",
    ),
    (
        "value of the wrong type",
        lambda tmp, ckpt: ["--model.init_args.external_cost.init_args.reg", "abc"],
        lambda tmp: {},
        "model.init_args.external_cost.init_args.reg: Expected a <class 'float'>",
    ),
    ("missing config file", lambda tmp, ckpt: ["--config", str(tmp / "nowhere.yaml")], lambda tmp: {}, "nowhere.yaml"),
    (
        "missing checkpoint",
        lambda tmp, ckpt: ["--ckpt_path", str(tmp / "nowhere.ckpt")],
        lambda tmp: {},
        "checkpoint not found: ",
    ),
    (
        "truncated checkpoint",
        lambda tmp, ckpt: ["--ckpt_path", str(truncated(ckpt, tmp))],
        lambda tmp: {},
        "truncated.ckpt is not a readable checkpoint (truncated or corrupt file?)",
    ),
    (
        "checkpoint of a diverged run",
        lambda tmp, ckpt: ["--ckpt_path", str(diverged(ckpt, tmp))],
        lambda tmp: {},
        "diverged.ckpt holds weights that are not finite (NaN or Inf) in 1 tensor(s)",
    ),
    (
        "plain state_dict as checkpoint",
        lambda tmp, ckpt: ["--ckpt_path", str(plain_state_dict(ckpt, tmp))],
        lambda tmp: {},
        "weights.pt is not a Lightning training checkpoint",
    ),
    (
        "checkpoint of another architecture",
        lambda tmp, ckpt: ["--ckpt_path", str(ckpt)],
        lambda tmp: {
            "model.init_args.backbone": {
                "class_path": "hfmca_lightning.models.SmallConvNet",
                "init_args": {"width": 16, "num_stages": 2},
            },
            "model.init_args.projector.init_args.input_dim": 32,  # the wider backbone's features
        },
        "the checkpoint was trained with a different architecture",
    ),
    (
        "limit_val_batches below one batch",
        lambda tmp, ckpt: ["--trainer.limit_val_batches", "0.001"],
        lambda tmp: {},
        "trainer: You requested to check 0.001 of the `val_dataloader` but 0.001 * ",
    ),
    (
        "LearningRateMonitor without a logger",
        # without a logger the run's config.yaml goes to default_root_dir (else the working folder)
        lambda tmp, ckpt: [
            "--trainer.logger",
            "false",
            "--trainer.callbacks+=LearningRateMonitor",
            "--trainer.default_root_dir",
            str(tmp),
        ],  # fmt: skip
        lambda tmp: {},
        "trainer: Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger",
    ),
    (
        "missing data root",
        lambda tmp, ckpt: [],
        lambda tmp: {
            "data.init_args.source": {
                "class_path": "hfmca_lightning.data.CIFAR",
                "init_args": {"root": str(tmp / "no_data")},
            }
        },
        "cifar10 not found: looked for",
    ),
    (
        "unreadable image",
        lambda tmp, ckpt: [],
        lambda tmp: image_folder(
            tmp / "images", lambda root: (root / "train" / "class_1" / "3.png").write_bytes(b"not a png")
        ),
        "cannot read image ",
    ),
    (
        "empty class folder",
        lambda tmp, ckpt: [],
        lambda tmp: image_folder(
            tmp / "images", lambda root: [p.unlink() for p in (root / "test" / "class_2").iterdir()]
        ),
        "Found no valid file for the classes class_2",
    ),
    (
        "image root without class folders",
        lambda tmp, ckpt: [],
        lambda tmp: image_folder(tmp / "images", without_class_folders),
        "images/train has no class folders: ImageFolderSource expects one sub-folder of images per class, ",
    ),
    (
        "train/test class mismatch",
        lambda tmp, ckpt: [],
        lambda tmp: image_folder(
            tmp / "images", lambda root: (root / "test" / "class_2").rename(root / "test" / "class_9")
        ),
        "have different class folders (only in train: ['class_2']; only in test: ['class_9'])",
    ),
    (
        "a keyword timm's model does not take",
        lambda tmp, ckpt: [],
        lambda tmp: (
            pytest.importorskip("timm")
            and {
                "model.init_args.backbone": {
                    "class_path": "hfmca_lightning.models.TimmBackbone",
                    "init_args": {"name": "resnet18", "model_kwargs": {"drop_rate": 0.0, "bogus_key": 3}},
                }
            }
        ),
        "model.init_args.backbone.init_args.model_kwargs: timm model 'resnet18' takes no argument 'bogus_key'; "
        "remove it from model_kwargs",
    ),
    (
        "a key the DataModule does not take",
        lambda tmp, ckpt: [],
        lambda tmp: {"data.init_args.images_on_device": True},
        "unknown key data.init_args.images_on_device",
    ),
    (
        "a view spec class that does not exist",
        lambda tmp, ckpt: [],
        lambda tmp: {"data.init_args.views": {"class_path": "hfmca_lightning.data.NoSuchViews", "init_args": {}}},
        "data.init_args.views: class_path hfmca_lightning.data.NoSuchViews names no class "
        "(module 'hfmca_lightning.data' has no attribute 'NoSuchViews')",
    ),
    (
        "a drawer that cannot draw the views",
        lambda tmp, ckpt: [],
        lambda tmp: {
            "data.init_args.views": {"class_path": "hfmca_lightning.data.SameClassViews", "init_args": {"count": 4}},
            "data.init_args.drawer": {"class_path": "hfmca_lightning.data.BatchedDrawer"},
        },
        "data.init_args.drawer: BatchedDrawer draws SimCLRViews only; SameClassViews is drawn by TorchvisionDrawer",
    ),
]


@pytest.mark.parametrize(
    "command",
    [
        ["knn", "--device", "cpu"],
        ["linear", "--device", "cpu", "--epochs", "1"],
        ["export", "--embeddings", "test"],
        ["analyze", "--num_images", "2"],
        ["validate", "--config", str(DEMO)],
    ],
    ids=lambda command: command[0],
)
def test_a_diverged_runs_checkpoint_is_one_line_for_every_command(command, tmp_path, trained_checkpoint, capsys):
    """A checkpoint with NaN weights: one line naming it, not chance-level numbers with exit status 0 (knn, linear,
    validate), NaN embeddings (export) or an error from inside the eigendecomposition (analyze)."""
    name, *options = command
    checkpoint = diverged(trained_checkpoint, tmp_path)
    out = [] if name == "validate" else ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--ckpt_path", str(checkpoint), *out, *options])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.splitlines()[-1].startswith(f"hfmca: error: {checkpoint} holds weights that are not finite"), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["linear", "--finetune", "--batch_size", "8"],
            "--batch_size is the linear classifier's batch on frozen features; --finetune trains in the run's",
        ),
        (["analyze", "--num_batches", "2", "--groups_per_feature", "50"], "--num_batches and --groups_per_feature"),
        (["compare", "--num_batches", "2", "--groups_per_feature", "50"], "--num_batches and --groups_per_feature"),
    ],
    ids=["linear --finetune --batch_size", "analyze", "compare"],
)
def test_options_one_of_which_would_be_ignored_are_one_line(command, expected, tmp_path, trained_checkpoint, capsys):
    """Each pair was accepted and one option silently did nothing."""
    name, *options = command
    checkpoints = ["--ckpt_a", str(trained_checkpoint), "--ckpt_b", str(trained_checkpoint)]
    given = checkpoints if name == "compare" else ["--ckpt_path", str(trained_checkpoint)]
    with pytest.raises(SystemExit) as exit_info:
        main([name, *given, "--out", str(tmp_path / "out"), *options])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.splitlines()[-1].startswith(f"hfmca: error: {expected}"), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(("case", "args", "changes", "expected"), CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_with_exit_status_2_before_training(
    case, args, changes, expected, tmp_path, trained_checkpoint, capsys
):
    overrides = tiny_overrides(tmp_path, **changes(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(DEMO), "--config", str(overrides), *args(tmp_path, trained_checkpoint)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("hfmca: error: ")]
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err and len(err.splitlines()) <= 3, err
    assert not (tmp_path / "checkpoints").exists(), "training started"


@pytest.mark.integration  # a subprocess or a training run
def test_a_lightning_error_raised_by_code_during_training_keeps_its_traceback(tmp_path, capsys):
    """Lightning's ``MisconfigurationException`` is a one-line configuration error only where Lightning checks the
    run's settings (``limit_val_batches`` above); raised by a callback's code once training runs, it is the code's
    error and keeps its traceback."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    overrides = tiny_overrides(tmp_path)
    callback = '{"class_path": "tests.helpers.LogsUselesslyAfterOneStep"}'
    with pytest.raises(MisconfigurationException, match="is not useful"):
        main(["fit", "--config", str(DEMO), "--config", str(overrides), f"--trainer.callbacks+={callback}"])
    assert "hfmca: error:" not in capsys.readouterr().err


def test_the_console_script_prints_the_same_single_line(tmp_path):
    """The installed ``hfmca`` command, as a user runs it: no usage text, no traceback, no warnings wall."""
    assert HFMCA.is_file() and shutil.which(str(HFMCA))
    overrides = write_overrides(tmp_path, "tiny.yaml", {"trainer": {"max_epochs": 1}})
    result = run_hfmca(
        tmp_path,
        "fit",
        "--config",
        str(DEMO),
        "--config",
        str(overrides),
        "--model.init_args.external_cost.init_args.reg",
        "-1",
    )
    assert result.returncode == 2
    errors = [line for line in result.stdout.splitlines() if line.startswith("hfmca: error: ")]
    assert errors == [
        "hfmca: error: model.init_args.external_cost.init_args.reg: reg must be a finite number > 0 (it makes the "
        "correlation matrices invertible); got -1.0. Use 0.1 for self-supervised training and 1e-3 for spectrum "
        "analysis (paper appendix)."
    ]
    assert len(result.stdout.strip().splitlines()) <= 2, result.stdout


@pytest.mark.integration  # a subprocess or a training run
def test_an_image_a_worker_cannot_read_is_one_line_and_the_command_exits(tmp_path):
    """Raised in a persistent data-loader worker (which ignores SIGTERM), re-raised in the main process with
    the worker's traceback: still one line, and the process ends instead of waiting for the worker."""
    changes = image_folder(
        tmp_path / "images", lambda root: (root / "train" / "class_1" / "3.png").write_bytes(b"not a png")
    )
    overrides = tiny_overrides(tmp_path, **changes, **{"data.init_args.num_workers": 2})
    result = run_hfmca(tmp_path, "fit", "--config", str(DEMO), "--config", str(overrides), timeout=120)
    assert result.returncode == 2, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("hfmca: error: ")]
    assert len(errors) == 1 and errors[0].startswith("hfmca: error: cannot read image "), result.stdout[-3000:]
    assert "3.png" in errors[0] and "Traceback" not in result.stdout  # not the worker's hfmca_lightning.errors....


def test_a_corrupt_last_checkpoint_is_named_when_resuming_with_last(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 cut short by a full disk")
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, "--ckpt_path", "last")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"hfmca: error: {tmp_path / 'checkpoints' / 'last.ckpt'} is not a readable checkpoint" in err


def test_resuming_with_last_before_any_checkpoint_starts_a_new_run(tmp_path):
    """A job script can always pass `--ckpt_path last` (SLURM requeue): the first start has nothing to resume."""
    fit(tmp_path, "--ckpt_path", "last")
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4


def test_a_nan_mid_run_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    callbacks = [
        {
            "class_path": "hfmca_lightning.callbacks.PreemptionCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "checkpoints"), "save_last": True, "every_n_train_steps": 2},
        },
        {"class_path": "tests.helpers.PoisonWeightsAtStep", "init_args": {"step": 5}},
    ]
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, "--trainer.max_epochs", "3", **{"trainer.callbacks": callbacks})
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    [line] = [line for line in err.splitlines() if line.startswith("hfmca: error: ")]
    assert (
        "training stopped at step 5, in epoch 2 (epoch=1 in checkpoint names): HFMCA cost 'external'" in line
        and "Traceback" not in err
    )
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 4
    assert all(torch.isfinite(value).all() for value in last["state_dict"].values() if value.is_floating_point())


@pytest.mark.extended
@pytest.mark.integration  # a subprocess or a training run
def test_a_nan_on_one_ddp_process_stops_both_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path, shrunk_demo):
    """Two processes (gloo), the demo's external cost without ``sync_dist`` (each process factors its own statistics),
    data-loader workers on; process 1's weights turn NaN. The checks are all-reduced before the optimizer step, so
    process 0, whose own costs are fine, stops at the same step: both exit (no hang at the next collective), one
    line is printed, and the last checkpoint is the good one before the failure."""
    callbacks = [
        {
            "class_path": "hfmca_lightning.callbacks.PreemptionCheckpoint",
            "init_args": {"dirpath": "checkpoints", "save_last": True, "every_n_train_steps": 2},
        },
        {"class_path": "tests.helpers.PoisonWeightsAtStep", "init_args": {"step": 5, "rank": 1}},
    ]
    overrides = shrunk_demo(**{"trainer.callbacks": callbacks, "data.init_args.num_workers": 1})
    ddp = [
        "--trainer.strategy",
        "ddp",
        "--trainer.devices",
        "2",
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_epochs",
        "3",
    ]
    result = run_hfmca(
        tmp_path, "fit", "--config", str(DEMO), "--config", str(overrides), *ddp, timeout=150, test_classes=True
    )
    assert result.returncode == 1, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("hfmca: error: ")]
    assert len(errors) == 1, result.stdout[-3000:]
    assert (
        "training stopped at step 5, in epoch 3 (epoch=2 in checkpoint names): HFMCA cost 'external'" in errors[0]
        and "NaN or Inf" in errors[0]
    )
    assert "Traceback" not in result.stdout
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 4
    assert all(torch.isfinite(value).all() for value in last["state_dict"].values() if value.is_floating_point())


@pytest.mark.extended
@pytest.mark.integration  # a subprocess
def test_a_source_of_another_image_size_than_the_spectrum_cnn_is_one_line_naming_image_size(tmp_path):
    """configs/spectrum_selfsupervised.yaml with an ImageFolderSource left at its default 224 px: the 32-px spectrum
    CNN would grow its maps with the images (it ran out of memory); instead one line before training."""
    write_image_folder(tmp_path / "images", per_class=11)  # 33 images: one batch of 32
    overrides = write_overrides(
        tmp_path,
        "image_folder.yaml",
        {
            "trainer": {"max_steps": 2},
            "data": {
                "init_args": {
                    "source": {
                        "class_path": "hfmca_lightning.data.ImageFolderSource",
                        "init_args": {"root": str(tmp_path / "images")},
                    },
                    "num_workers": 0,
                }
            },
        },
    )
    config = Path(__file__).parents[2] / "configs" / "spectrum_selfsupervised.yaml"
    result = run_hfmca(tmp_path, "fit", "--config", str(config), "--config", str(overrides))
    assert result.returncode == 2, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("hfmca: error: ")]
    assert len(errors) == 1 and "image_size" in errors[0] and "224" in errors[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    assert not (tmp_path / "runs" / "spectrum_selfsupervised" / "checkpoints").exists(), "training started"


def test_a_checkpoint_folder_that_is_a_file_is_one_line_before_training(tmp_path, capsys):
    """It was found when the first checkpoint was written, after a whole epoch, with exit status 1."""
    (tmp_path / "checkpoints").write_text("notes")
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.splitlines()[-1] == (
        f"hfmca: error: checkpoint folder {tmp_path / 'checkpoints'} is a file: give ModelCheckpoint a dirpath that is "
        "a folder, or move the file"
    ), err
    assert not (tmp_path / "logs").exists(), "training started"


def test_a_logger_save_dir_under_a_file_is_one_line_before_training(tmp_path, capsys):
    (tmp_path / "notes").write_text("a file where the logs would go")
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, **{"trainer.logger.init_args.save_dir": str(tmp_path / "notes" / "logs")})
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.splitlines()[-1] == (
        f"hfmca: error: CSVLogger save_dir {tmp_path / 'notes' / 'logs'}: {tmp_path / 'notes'} is a file, not a "
        "folder; give the logger another save_dir, or move the file"
    ), err
    assert not (tmp_path / "checkpoints").exists(), "training started"


def test_a_diverged_last_checkpoint_is_refused_when_resumed_by_name(tmp_path, trained_checkpoint, capsys):
    """``--ckpt_path last`` is resolved once the trainer is built; its weights are checked then."""
    (tmp_path / "checkpoints").mkdir()
    diverged(trained_checkpoint, tmp_path).rename(tmp_path / "checkpoints" / "last.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, "--ckpt_path", "last")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert f"{tmp_path / 'checkpoints' / 'last.ckpt'} holds weights that are not finite" in err.splitlines()[-1], err


@pytest.mark.parametrize("command", ["validate", "test"])
def test_scoring_the_last_checkpoint_of_a_run_without_one_is_one_line(command, tmp_path, capsys):
    """``validate`` / ``test --ckpt_path last`` with no ``last.ckpt``: Lightning scored the untrained weights and
    the command exited 0."""
    overrides = tiny_overrides(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", str(DEMO), "--config", str(overrides), "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.splitlines()[-1] == (
        f"hfmca: error: --ckpt_path last: no last checkpoint in {tmp_path / 'checkpoints'}; {command} scores a "
        "checkpoint: give its path, or fit first"
    ), err


@pytest.mark.parametrize("command", ["validate", "test"])
def test_scoring_the_last_checkpoint_reads_the_runs_newest(command, tmp_path, trained_checkpoint, capsys):
    """``--ckpt_path last`` scores the run's ``last.ckpt``: the metrics of its path given by name."""
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(trained_checkpoint, tmp_path / "checkpoints" / "last.ckpt")
    overrides = tiny_overrides(tmp_path)
    scores = []
    for path in ("last", str(tmp_path / "checkpoints" / "last.ckpt")):
        main(["-q", command, "--config", str(DEMO), "--config", str(overrides), "--ckpt_path", path])
        scores.append(capsys.readouterr().out)
    assert "top1" in scores[0] and scores[0] == scores[1], scores


@pytest.mark.parametrize("folder", ["checkpoints", "logs"])
def test_a_folder_the_run_cannot_write_is_one_line_before_training(folder, tmp_path, capsys, monkeypatch):
    """A checkpoint folder or log save_dir without write permission: before, the first checkpoint failed after a
    whole epoch. (Permissions are simulated: tests may run as root, who writes anywhere.)"""
    import os

    import hfmca_lightning.cli.trainer_cli as trainer_cli

    (tmp_path / folder).mkdir()
    allowed = os.access
    monkeypatch.setattr(
        trainer_cli.os, "access", lambda path, mode: Path(path) != tmp_path / folder and allowed(path, mode)
    )
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert f"{tmp_path / folder} cannot be written" in err.splitlines()[-1], err
    assert not list((tmp_path / "checkpoints").glob("*.ckpt")), "training started"
