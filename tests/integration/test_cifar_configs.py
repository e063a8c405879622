"""The CIFAR configs run the fastest settings on a GPU (chosen by benchmarks/roofline.py, each with its reason in the
config) and run unchanged on a CPU: the real command on tiny CIFAR data on disk, with the shipped ResNet-18, callbacks,
loggers and data-loader workers, for two steps."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml

from hfmca_lightning.cli.trainer_cli import HFMCACLI
from hfmca_lightning.data import ResidentDrawer, SimCLRViews
from tests.helpers import REPO, run_hfmca, write_cifar, write_overrides

CIFAR = ["cifar10_ss.yaml", "cifar100_ss.yaml", "cifar10_ss_internal.yaml", "cifar100_ss_internal.yaml"]
# The GPU settings of the CIFAR configs and the words each one's reason must hold (its comment in the YAML).
SETTINGS = {
    "precision: bf16-mixed": "bf16 tensor cores",
    "channels_last: true": "NHWC",
    "class_path: hfmca_lightning.data.ResidentDrawer": "",
    "batches_per_call: 8": "",
}


@pytest.mark.parametrize("name", CIFAR)
def test_the_gpu_settings_of_the_cifar_configs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REPO / "configs" / name).read_text()
    lines = text.splitlines()
    for setting, reason in SETTINGS.items():  # each setting with its reason beside it
        assert any(line.strip().startswith(setting) and reason in line for line in lines), setting
    # the cost path as CUDA graphs where it measured faster (the internal costs' step on an H200), eager otherwise
    compiled = "internal" in name
    compile_costs = "compile_costs: cuda" if compiled else "compile_costs: false"
    assert any(line.strip().startswith(compile_costs) and "H200" in line for line in lines), compile_costs
    if "internal" in name:
        assert any(line.strip().startswith("precision: auto") and "bf16 tensor cores" in line for line in lines)
    assert "views drawn there for 8 batches per call" in text
    monkeypatch.chdir(tmp_path)
    cli = HFMCACLI(args=["--config", str(REPO / "configs" / name)], run=False)
    model, data = cli.model, cli.datamodule
    assert cli.trainer.precision == "bf16-mixed"
    assert model.channels_last and model.compile_costs == ("cuda" if compiled else False)
    # the GPU path where there is one, the CPU's here
    assert model._cuda_graphs(torch.device("cuda")) is compiled and model._compiled(torch.device("cpu")) is False
    assert type(data.views) is SimCLRViews and data.num_views == 9
    assert isinstance(data.drawer, ResidentDrawer)
    assert (data.drawer.batches_per_call, data.drawer.output_dtype, data.drawer.channels_last) == (8, "bfloat16", True)
    if "internal" in name:
        assert model.internal_costs.precision == "auto"
    # the paper's Table 1 (README: ResNet-18, 64 images x 9 views, 800 epochs) and its optimisation
    assert type(model.backbone).__name__ == "CIFARResNet18"
    assert (data.batch_size, cli.trainer.max_epochs) == (64, 800)
    config = yaml.safe_load(text)["model"]["init_args"]["optimizer"]["init_args"]
    assert (config["lr"], config["momentum"], config["weight_decay"]) == (0.06, 0.9, 0.0005)
    # README: "downloads CIFAR10 into data/"
    source = data.source
    assert (source.root, source.download, source.name) == (Path("data"), True, name.split("_")[0])


@pytest.mark.extended
@pytest.mark.parametrize("name", ["cifar10_ss.yaml", "cifar10_ss_internal.yaml"])
def test_the_cifar_configs_run_unchanged_on_a_cpu(name: str, tmp_path: Path) -> None:
    """The shipped config with only its data made tiny (40 CIFAR images on disk, batch 4, 2 workers) and two steps:
    ResNet-18 in bf16 autocast on the CPU, the views drawn from the training set kept in memory, the costs eager,
    the statistics in float32; the costs logged finite."""
    write_cifar(tmp_path / "data", "cifar10", per_class=4)
    overrides = write_overrides(
        tmp_path,
        "tiny-data.yaml",
        {
            "trainer": {"max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 1, "log_every_n_steps": 1},
            "data": {"init_args": {"source": {"init_args": {"root": "data", "download": False, "verify": False}},
                                   "batch_size": 4, "eval_batch_size": 8, "num_workers": 2}},
        },
    )  # fmt: skip
    done = run_hfmca(tmp_path, "fit", "--config", str(REPO / "configs" / name), "--config", str(overrides), timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    run = tmp_path / "runs" / name.removesuffix(".yaml")
    assert (run / "checkpoints" / "last.ckpt").is_file()
    (metrics,) = run.glob("logs/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    costs = [float(row["cost/total"]) for row in rows if row.get("cost/total")]
    assert len(costs) == 2 and all(torch.isfinite(torch.tensor(costs))), costs
    if "internal" in name:
        assert any(row.get("cost/internal/layer4.1") for row in rows)
