"""Every kind of shipped config runs under DDP as shipped (its callbacks, logger and workers; data, sizes and
schedule shrunk) with two CPU processes (gloo), finishes in time, and writes its checkpoint and figures.

A collective called on rank 0 only (``Trainer.log_dir`` inside a figure callback, once) hangs such a run
at the end of its first epoch; the time limit turns that hang into a failure. A run that times out prints
every process's stacks and is tried once more in a fresh folder, with a warning that carries the stacks:
a deterministic hang fails twice, while a rare hang of gloo on a loaded 2-core machine leaves its stacks in the
report.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, HFMCATimeout, run_hfmca, write_cifar, write_overrides

TIME_LIMIT = 75  # seconds; a healthy run takes 10-30 s on 2 CPU cores

# Only the demo runs in CI (`make test-extended`; `make test` keeps tests/integration/test_ddp.py's internal costs
# under DDP); the CIFAR, spectrum and baseline configs, whose callbacks are a superset of the demo's, 15-25 s each on
# a 2-core CPU, in `make test-slow`.
SLOW_SHIPPED = [
    "cifar10_ss.yaml",
    "cifar10_ss_internal.yaml",
    "spectrum_unsupervised.yaml",
    "spectrum_supervised.yaml",
    "spectrum_selfsupervised.yaml",
    "baselines/simclr_cifar10.yaml",
]
SHIPPED = [
    pytest.param("demo.yaml", marks=pytest.mark.extended),
    *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW_SHIPPED),
]

SMALL_SPECTRUM_CNN = {"channels": 8, "hidden_dim": 16, "noise_channels": 2}
SMALL_HEAD = {"feature_dim": 8, "hidden_dim": 16, "noise_channels": 2}


def shrunk(config: dict, folder: Path) -> dict:
    """Overrides that keep a config's classes and shrink its sizes: one epoch of 2 steps per process, every
    periodic callback firing every step / epoch (spectra from any number of groups), tiny data on disk, 1 worker per
    process."""
    trainer = config["trainer"]
    callbacks = trainer.get("callbacks", [])
    for callback in callbacks:
        for key in ("every_n_steps", "every_n_epochs", "every_n_train_steps"):
            if key in callback.get("init_args", {}):
                callback["init_args"][key] = 1
        if callback["class_path"].endswith("EigenspectrumCallback"):
            callback["init_args"]["min_groups"] = 1  # two tiny batches: spectra from whatever they hold
    data = {"batch_size": 4, "eval_batch_size": 32, "num_workers": 1}
    source = config["data"]["init_args"]["source"]
    if source["class_path"].endswith("CIFAR"):
        write_cifar(folder / "data", source["init_args"].get("name", "cifar10"), per_class=2)
        data["source"] = {
            "class_path": source["class_path"],
            "init_args": {**source["init_args"], "verify": False, "download": False},
        }
    else:
        data["source"] = {
            "class_path": source["class_path"],
            "init_args": {**source["init_args"], "train_per_class": 8, "test_per_class": 2},
        }
    model = {}
    init = config["model"]["init_args"]
    if init["backbone"]["class_path"].endswith("SpectrumCNN"):
        model["backbone"] = {"class_path": init["backbone"]["class_path"], "init_args": SMALL_SPECTRUM_CNN}
        if init.get("external_head"):
            model["external_head"] = {
                "class_path": init["external_head"]["class_path"],
                "init_args": {**init["external_head"]["init_args"], **SMALL_HEAD},
            }
    overrides = {
        "trainer": {
            "max_epochs": 1,
            "max_steps": -1,
            "limit_train_batches": 2,
            "enable_progress_bar": False,
            "callbacks": callbacks,
        },
        "data": {"init_args": data},
    }
    if model:
        overrides["model"] = {"init_args": model}
    return overrides


def figure_files(folder: Path) -> set[str]:
    return {path.name.split("_epoch")[0] for path in folder.rglob("figures/*.png")}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_runs_under_ddp_with_two_processes(name, tmp_path):
    path = REPO / "configs" / name
    config = yaml.safe_load(path.read_text())
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    try:
        overrides = write_overrides(tmp_path, "shrink.yaml", shrunk(copy.deepcopy(config), tmp_path))
        result = run_hfmca(tmp_path, "fit", "--config", str(path), "--config", str(overrides), *ddp, timeout=TIME_LIMIT)
    except HFMCATimeout as hang:
        warnings.warn(f"first DDP run of {name} hung; retrying once. {hang}", stacklevel=1)
        tmp_path = tmp_path / "retry"
        tmp_path.mkdir()
        overrides = write_overrides(tmp_path, "shrink.yaml", shrunk(copy.deepcopy(config), tmp_path))
        result = run_hfmca(tmp_path, "fit", "--config", str(path), "--config", str(overrides), *ddp, timeout=TIME_LIMIT)
    assert result.returncode == 0, result.stdout[-4000:]

    checkpoint_folders = {
        callback["init_args"]["dirpath"]
        for callback in config["trainer"]["callbacks"]
        if "dirpath" in callback.get("init_args", {})
    }
    for folder in checkpoint_folders:
        assert (tmp_path / folder / "last.ckpt").is_file(), f"no last.ckpt in {folder}"
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")  # the CSV logger beside W&B, rank 0's
    rows = metrics.read_text().splitlines()
    assert "knn/top1" in rows[0].split(",") and len(rows) > 1, rows[:3]
    kinds = {callback["class_path"].rsplit(".", 1)[-1] for callback in config["trainer"]["callbacks"]}
    figures = figure_files(tmp_path / "runs")
    if "EigenspectrumCallback" in kinds:  # HFMCA's pairs, or a baseline's hooked ones, under the same keys
        assert {"learning_dynamics", "layer_spectra"} <= figures, figures
        header = rows[0].split(",")
        assert "rankme/backbone" in header, header
        # the external pair: every scenario but the unsupervised one (one view per image, internal costs only)
        views = config["data"]["init_args"].get("views") or {}
        with_external = views.get("class_path") != "hfmca_lightning.data.SingleView"
        assert ("spectrum/external/top10_mean" in header) == with_external, header
        # internal pairs: HFMCA's internal costs, or the blocks a baseline's spectra hook
        with_internal = bool(config["model"].get("init_args", {}).get("internal_costs")) or "baselines" in name
        assert any(key.startswith("spectrum/internal/") for key in header) == with_internal, header
    if "DensityRatioHeatmapCallback" in kinds:
        assert "density_ratio" in figures, figures
