"""``hfmca linear``, ``hfmca knn`` and ``hfmca export`` on checkpoints written by ``hfmca fit``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from hfmca_lightning.callbacks import KNNEvaluation
from hfmca_lightning.cli import main
from hfmca_lightning.cli.runs import load_run
from hfmca_lightning.evaluation import extract_features
from hfmca_lightning.evaluation_data import figure_images
from tests.helpers import DEMO, FLOAT32_UNIT, REPO, quiet_trainer, tiny_overrides

SIMCLR_RESNET = {
    "init_args": {
        "backbone": {"class_path": "hfmca_lightning.models.CIFARResNet18"},
        "hidden_dim": 32,
        "output_dim": 16,
    }
}


@pytest.fixture(scope="module")
def simclr_run(tmp_path_factory) -> Path:
    """A SimCLR run of the shipped baseline config (CIFAR-stem ResNet-18), shrunk to 16-px shapes and two steps."""
    root = tmp_path_factory.mktemp("simclr")
    overrides = tiny_overrides(root, model=SIMCLR_RESNET, **{"data.init_args.source.init_args.image_size": 16})
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "baselines" / "simclr_cifar10.yaml"),
            "--config",
            str(overrides),
            "--trainer.limit_train_batches",
            "2",
        ]
    )
    return root / "checkpoints" / "last.ckpt"


def stock_resnet18(description: dict) -> nn.Module:
    """torchvision's resnet18 with the stem the JSON documents, without this package."""
    net = torchvision.models.resnet18()
    if description["stem"] == "cifar":
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    net.fc = nn.Identity()
    return net


def test_exported_weights_give_the_modules_features_in_stock_torchvision(simclr_run, tmp_path, capsys):
    out = tmp_path / "export"
    main(["export", "--ckpt_path", str(simclr_run), "--out", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    description = json.loads((out / "backbone.json").read_text())
    assert {k: description[k] for k in ("library", "architecture", "stem", "feature_dim", "method")} == {
        "library": "torchvision",
        "architecture": "resnet18",
        "stem": "cifar",
        "feature_dim": 512,
        "method": "SimCLR",
    }
    assert description["normalisation"]["mean"] == [0.5, 0.5, 0.5] and description["image_size"] == 16
    net = stock_resnet18(description)
    net.load_state_dict(torch.load(out / "backbone.pt", weights_only=True))  # strict: every key matches
    module, datamodule = load_run(simclr_run)
    images, _ = figure_images(datamodule, 6)
    # the same torchvision layers, weights and images on one machine: the same float32 kernels give the same numbers;
    # 1e-6 (features ~1) allows a kernel chosen by memory layout to sum the last layer's 4,608 terms in another order
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(images), module(images), rtol=0, atol=1e-6)
    # The JSON's own loading snippet does the same, without importing this package.
    assert "hfmca_lightning" not in description["load"]
    namespace: dict = {}
    exec(description["load"].replace('"backbone.pt"', repr(str(out / "backbone.pt"))), namespace)
    with torch.no_grad():
        torch.testing.assert_close(namespace["net"](images), module(images), rtol=0, atol=1e-6)


def test_exported_embeddings_are_the_features_and_labels_of_each_split(simclr_run, tmp_path):
    out = tmp_path / "embed"
    main(["export", "--ckpt_path", str(simclr_run), "--out", str(out), "--embeddings"])
    repeated = tmp_path / "repeated"  # a split named twice is written once (it failed half-way, leaving files)
    main(["export", "--ckpt_path", str(simclr_run), "--out", str(repeated), "--embeddings", "test", "test"])
    assert sorted(path.name for path in repeated.iterdir()) == ["backbone.json", "backbone.pt", "embeddings_test.npz"]
    module, datamodule = load_run(simclr_run)
    for split, loader in zip(("train", "test"), datamodule.val_dataloader()):
        saved = np.load(out / f"embeddings_{split}.npz")
        features, labels = extract_features(module, loader)
        np.testing.assert_allclose(saved["features"], features.numpy(), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(saved["labels"], labels.numpy())
    assert saved["features"].shape == (12, 512)  # 4 classes x 3 test images


def test_export_with_overwrite_removes_the_earlier_exports_embeddings(simclr_run, tmp_path):
    """An earlier export's ``embeddings_*.npz`` hold another checkpoint's features: an ``--overwrite`` export that
    does not write them removes them, so the folder holds what ``backbone.json`` describes."""
    out = tmp_path / "export"
    main(["export", "--ckpt_path", str(simclr_run), "--out", str(out), "--embeddings"])
    (out / "notes.txt").write_text("kept")  # not a file export writes: left alone
    main(["export", "--ckpt_path", str(simclr_run), "--out", str(out), "--overwrite", "--embeddings", "test"])
    assert sorted(path.name for path in out.iterdir()) == [
        "backbone.json", "backbone.pt", "embeddings_test.npz", "notes.txt"
    ]  # fmt: skip
    main(["export", "--ckpt_path", str(simclr_run), "--out", str(out), "--overwrite"])
    assert sorted(path.name for path in out.iterdir()) == ["backbone.json", "backbone.pt", "notes.txt"]
    assert sorted(json.loads((out / "backbone.json").read_text())["sha256"]) == ["backbone.pt"]


def test_export_of_a_missing_checkpoint_creates_no_out_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--ckpt_path", str(tmp_path / "nothere.ckpt"), "--out", str(tmp_path / "out" / "e")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("hfmca: error: checkpoint not found: "), err
    assert not (tmp_path / "out").exists()


def test_package_backbones_export_with_their_init_args(tmp_path):
    """A run of the tiny demo model: the JSON names the class and its arguments, and they rebuild it."""
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "demo.yaml"),
            "--config",
            str(tiny_overrides(tmp_path)),
            "--trainer.limit_train_batches",
            "1",
        ]
    )
    main(["export", "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "export")])
    description = json.loads((tmp_path / "export" / "backbone.json").read_text())
    assert description["architecture"] == "hfmca_lightning.models.backbones.SmallConvNet" and description[
        "init_args"
    ] == {"width": 8, "num_stages": 2}
    namespace: dict = {}
    exec(description["load"].replace('"backbone.pt"', repr(str(tmp_path / "export" / "backbone.pt"))), namespace)
    assert namespace["net"].feature_dim == description["feature_dim"] == 16


def test_knn_and_linear_write_into_the_runs_evaluation_folder_and_refuse_only_their_own_files(
    simclr_run, tmp_path, capsys
):
    """evaluation.md: the default ``--out`` is ``<run dir>/evaluation``, shared by both commands; each refuses its own
    files there without ``--overwrite`` (one line, before any work), not the other's, and replaces them with it."""
    import shutil

    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    shutil.copy(simclr_run, checkpoint)
    evaluation = tmp_path / "run" / "evaluation"
    main(["knn", "--ckpt_path", str(checkpoint), "--k", "5"])
    assert (evaluation / "knn.json").is_file() and (evaluation / "knn.md").is_file()
    main(["linear", "--ckpt_path", str(checkpoint), "--epochs", "1"])  # beside knn's files
    linear_files = sorted(path.name for path in evaluation.glob("linear*"))
    assert linear_files and all(name.endswith((".json", ".md")) for name in linear_files)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["knn", "--ckpt_path", str(checkpoint), "--k", "5"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("hfmca: error: ") and "--overwrite" in err, err
    written = (evaluation / "knn.json").stat().st_mtime_ns
    main(["knn", "--ckpt_path", str(checkpoint), "--k", "5", "--overwrite"])
    assert (evaluation / "knn.json").stat().st_mtime_ns != written


def test_a_checkpoint_outside_a_checkpoints_folder_is_evaluated_into_a_folder_beside_it(simclr_run, tmp_path, capsys):
    """evaluation.md: ``<run dir>/evaluation`` only for ``<run dir>/checkpoints/*.ckpt``; a checkpoint kept elsewhere
    gets ``evaluation`` beside it, never a folder above it (which may be a shared one such as /tmp)."""
    import shutil

    checkpoint = tmp_path / "downloads" / "model.ckpt"
    checkpoint.parent.mkdir()
    shutil.copy(simclr_run, checkpoint)
    main(["knn", "--ckpt_path", str(checkpoint), "--k", "5"])
    evaluation = tmp_path / "downloads" / "evaluation"
    assert (evaluation / "knn.json").is_file() and not (tmp_path / "evaluation").exists()
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {evaluation}"


def test_knn_grid_equals_the_callback_at_its_k_and_temperature(simclr_run, tmp_path, capsys):
    out = tmp_path / "knn"
    ks = ["--k", "5", "20", "200"]  # 200: more than the 32 bank images, reported as the 32 it uses
    main(["knn", "--ckpt_path", str(simclr_run), "--out", str(out), *ks, "--temperature", "0.07", "0.1"])
    result = json.loads((out / "knn.json").read_text())
    assert [(row["k"], row["temperature"]) for row in result["results"]] == [
        (5, 0.07), (5, 0.1), (20, 0.07), (20, 0.1), (32, 0.07), (32, 0.1)
    ]  # fmt: skip
    assert (result["bank"], result["queries"]) == (32, 12)
    printed = capsys.readouterr()
    assert printed.err.splitlines()[-1] == (
        "hfmca: warning: k=200 is more than the 32 images of the kNN bank: voted with the whole bank, reported as k=32"
    )
    table = (out / "knn.md").read_text()
    assert "| k | t = 0.07 | t = 0.1 |" in table and table.count("\n| 5 |") == 1
    assert table.count("\n| 32 | ") == 1 and "| 200 |" not in table
    module, datamodule = load_run(simclr_run)
    trainer = quiet_trainer(
        callbacks=[KNNEvaluation(k=20, temperature=0.1)],
    )
    callback_top1 = trainer.validate(module, datamodule, verbose=False)[0]["knn/top1"]
    # the same neighbours and votes: the same count of correct queries over 12 (the callback logs it as float32)
    assert result["results"][3]["top1"] == pytest.approx(callback_top1, abs=FLOAT32_UNIT)
    assert f"top-1 {100 * callback_top1:.2f} %" in printed.out


def test_linear_evaluation_writes_json_and_markdown_and_uses_the_label_fraction(simclr_run, tmp_path, capsys):
    out = tmp_path / "linear"
    main(["linear", "--ckpt_path", str(simclr_run), "--out", str(out), "--epochs", "20", "--label_fraction", "0.25"])
    captured = capsys.readouterr()
    assert "linear classifier on frozen features, 25% of the labels: top-1" in captured.out
    assert "warning" not in captured.err  # 2 of each class's 8 images
    assert sorted(path.name for path in out.iterdir()) == ["linear_25pct.json", "linear_25pct.md"]
    result = json.loads((out / "linear_25pct.json").read_text())
    assert result["train_samples"] == 8 and result["test_samples"] == 12  # 2 of 8 per class; 4 classes x 3 test images
    assert result["method"] == "SimCLR" and 0 <= result["top1"] <= result["top5"] == 1.0  # top-5 of 4 classes
    assert "| 25% |" in (out / "linear_25pct.md").read_text()
    main(
        [
            "linear",
            "--ckpt_path",
            str(simclr_run),
            "--out",
            str(tmp_path / "again"),
            "--epochs",
            "20",
            "--label_fraction",
            "0.25",
        ]
    )
    assert json.loads((tmp_path / "again" / "linear_25pct.json").read_text())["top1"] == result["top1"]  # seeded


def test_a_label_fraction_below_one_image_per_class_warns_with_the_share_used(simclr_run, tmp_path, capsys):
    """5 % of 8 images per class rounds to none: one of each class is taken, and that is said (4 of 32: 12.5 %)."""
    out = tmp_path / "linear"
    main(["linear", "--ckpt_path", str(simclr_run), "--out", str(out), "--epochs", "1", "--label_fraction", "0.05"])
    assert (
        "hfmca: warning: label_fraction 0.05 gives no image of 4 of the 4 classes, so one of each is taken: 4 of 32 "
        "labelled images (12.5 %) train the classifier"
    ) in capsys.readouterr().err
    result = json.loads((out / "linear_5pct.json").read_text())
    assert (result["label_fraction"], result["label_fraction_used"], result["train_samples"]) == (0.05, 0.125, 4)


def test_finetuning_reports_test_accuracy(simclr_run, tmp_path):
    out = tmp_path / "finetune"
    main(["linear", "--ckpt_path", str(simclr_run), "--out", str(out), "--finetune", "--epochs", "1"])
    result = json.loads((out / "finetune.json").read_text())
    assert result["protocol"] == "full fine-tuning" and result["train_samples"] == 32
    assert 0 <= result["top1"] <= 1 and result["top5"] == 1.0


def test_finetuning_trains_the_backbone_on_the_chosen_labels(simclr_run):
    from hfmca_lightning.cli.evaluate import _finetune

    module, datamodule = load_run(simclr_run)
    before = {key: value.clone() for key, value in module.backbone.state_dict().items()}
    _finetune(module, datamodule, torch.arange(0, 32, 4), epochs=1, lr=0.05, seed=0, device="cpu")
    changed = [
        key
        for key, value in module.backbone.state_dict().items()
        if key.endswith("weight") and not torch.equal(value, before[key])
    ]
    assert "net.conv1.weight" in changed and "net.layer4.1.conv2.weight" in changed


@pytest.mark.parametrize(
    ("level", "terminal", "shown"),
    [(None, False, "epoch lines"), ("-q", False, "nothing"), ("-q", True, "nothing"), (None, True, "bar")],
)
def test_finetuning_progress_follows_the_output_and_the_verbosity(
    simclr_run, tmp_path, monkeypatch, capsys, level, terminal, shown
):
    """As ``hfmca fit``: a bar on a terminal, a line per epoch in a log file or a pipe (a bar's redraws would pile up
    there), nothing with -q."""
    import hfmca_lightning.cli.verbosity as verbosity

    monkeypatch.setattr(verbosity, "draws_bars", lambda stream: terminal)
    arguments = ["linear", "--ckpt_path", str(simclr_run), "--out", str(tmp_path / "f"), "--finetune", "--epochs", "2"]
    main([*([level] if level else []), *arguments])
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[-2].startswith("full fine-tuning, 100% of the labels: top-1 ") and lines[-1].startswith("wrote ")
    bar = "Epoch 0" in captured.out or "Epoch 0" in captured.err
    epochs = [line for line in lines if line.startswith("epoch ")]
    if shown == "bar":
        assert bar and not epochs, captured
    else:
        assert not bar and "%|" not in captured.out + captured.err, captured
        assert [line.split(":")[0] for line in epochs] == (["epoch 1/2", "epoch 2/2"] if shown == "epoch lines" else [])
    if level == "-q":
        assert lines[:-2] == [] and captured.err == "", captured


@pytest.mark.parametrize(
    ("device", "expected"), [("cpu", ("cpu", 1)), ("cuda", ("gpu", 1)), ("cuda:1", ("gpu", [1])), ("mps", ("mps", 1))]
)
def test_finetuning_runs_on_the_device_named(simclr_run, monkeypatch, device, expected):
    """``--device mps`` fine-tuned on the CPU and ``--device cuda:1`` on GPU 0: Lightning is given that device."""
    from hfmca_lightning.cli import evaluate

    class Stop(Exception):
        pass

    def trainer(**settings: Any) -> None:
        assert (settings["accelerator"], settings["devices"]) == expected
        raise Stop

    monkeypatch.setattr(evaluate, "Trainer", trainer)
    module, datamodule = load_run(simclr_run)
    with pytest.raises(Stop):
        evaluate._finetune(module, datamodule, torch.arange(8), epochs=1, lr=0.05, seed=0, device=device)


@pytest.mark.parametrize(
    ("protocol", "lr", "expected"),
    [
        ([], "1e38", r"the linear classifier's loss became NaN or Inf in epoch [12] of 2: lower the learning rate"),
        (["--finetune"], "1e30", r"fine-tuning stopped after step \d+: the training loss or the weights became NaN"),
    ],
)
def test_a_diverging_classifier_stops_with_one_line_and_writes_no_accuracy(
    simclr_run, tmp_path, capsys, protocol, lr, expected
):
    """Before: the chance accuracy of NaN weights was printed and written, with exit status 0."""
    out = tmp_path / "diverged"
    with pytest.raises(SystemExit) as exit_info:
        main(["linear", "--ckpt_path", str(simclr_run), "--out", str(out), *protocol, "--epochs", "2", "--lr", lr])
    captured = capsys.readouterr()
    assert exit_info.value.code == 1, captured
    assert re.match(f"hfmca: error: {expected}", captured.err.splitlines()[-1]), captured.err
    assert "Traceback" not in captured.err and "top-1" not in captured.out
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("command", ["linear", "knn"])
def test_features_that_are_not_finite_are_one_line_not_a_learning_rate_or_a_score(
    simclr_run, tmp_path, capsys, monkeypatch, command
):
    """Before: the linear classifier blamed its learning rate, and kNN scored the NaN features."""
    from hfmca_lightning.cli import evaluate

    def overflowing(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        values, targets = extract_features(*args, **kwargs)
        values[1, 0] = float("inf")
        return values, targets

    monkeypatch.setattr(evaluate, "extract_features", overflowing)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                command,
                "--ckpt_path",
                str(simclr_run),
                "--out",
                str(tmp_path / "e"),
                "--epochs" if command == "linear" else "--k",
                "1",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.splitlines()[-1] == (
        "hfmca: error: the features of the training split hold NaN or Inf (1 of 32 images): the backbone's forward "
        "pass overflows on them (in reduced precision?), so no classifier or vote can use them"
    ), err


def test_bad_label_fraction_is_one_line(simclr_run, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["linear", "--ckpt_path", str(simclr_run), "--label_fraction", "2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "hfmca: error: --label_fraction must be in (0, 1]; got 2.0"


def test_a_classifier_inside_a_sequential_is_replaced_where_it_was(tmp_path):
    """MobileNetV3's classifier is Linear-Hardswish-Dropout-Linear: only the last Linear goes, and the JSON's
    snippet says so (replacing the whole classifier would drop layers and fail the strict load)."""
    from hfmca_lightning.cli.export import backbone_description
    from hfmca_lightning.models import TorchvisionBackbone

    backbone = TorchvisionBackbone("mobilenet_v3_small").eval()
    description, state = backbone_description(backbone, None)
    assert (
        description["classifier"] == "classifier.3 replaced by nn.Identity()"
        and "net.classifier[3] = nn.Identity()" in description["load"]
    )
    torch.save(state, tmp_path / "backbone.pt")
    namespace: dict = {}
    exec(description["load"].replace('"backbone.pt"', repr(str(tmp_path / "backbone.pt"))), namespace)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(namespace["net"](images), backbone(images), rtol=0, atol=1e-6)


def test_a_baseline_resumed_with_another_architecture_is_one_line(simclr_run, tmp_path, capsys):
    """``hfmca fit --ckpt_path`` of a SimCLR run with a wider projection head: one line naming what differs, before
    any training (it was torch's multi-line list of keys from inside Lightning's checkpoint restore)."""
    import yaml

    from hfmca_lightning.callbacks.stored_config import saved_config

    config = yaml.safe_load(saved_config(torch.load(simclr_run, weights_only=True)) or "")
    config["model"]["init_args"]["hidden_dim"] = 64
    config["trainer"]["default_root_dir"] = str(tmp_path)
    (tmp_path / "wider.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tmp_path / "wider.yaml"), "--ckpt_path", str(simclr_run)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hfmca: error: the checkpoint was trained with a different architecture than SimCLR"), err
    assert "6 shape mismatches (e.g. projection_head.layers.0.weight: checkpoint (32, 512) vs model (64, 512))" in last
    assert "Traceback" not in err and not list(tmp_path.rglob("*.ckpt"))


def test_a_config_of_another_architecture_is_one_line_naming_what_differs(simclr_run, tmp_path):
    """``--config`` of the run with another projection width, or of the demo's HFMCA model: one line naming the
    checkpoint, the config and what differs (the modules' own architecture check), with what to pass."""
    import yaml

    from hfmca_lightning.callbacks.stored_config import saved_config
    from hfmca_lightning.errors import ConfigurationError

    config = yaml.safe_load(saved_config(torch.load(simclr_run, weights_only=True)) or "")
    config["model"]["init_args"]["hidden_dim"] = 64
    (tmp_path / "wider.yaml").write_text(yaml.safe_dump(config))
    for config_path, details in (
        (tmp_path / "wider.yaml", "(6 shape mismatches (e.g. projection_head.layers.0.weight: checkpoint (32, 512)"),
        (DEMO, "parameters missing from the checkpoint (e.g. "),
    ):
        with pytest.raises(ConfigurationError) as refused:
            load_run(simclr_run, config_path=config_path)
        message = str(refused.value)
        assert message.startswith(f"{simclr_run} does not fit the model of the config {config_path} ("), message
        assert details in message and "\n" not in message
        assert message.endswith("; pass the config of the run that wrote the checkpoint")
