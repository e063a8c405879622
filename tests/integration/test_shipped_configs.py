"""Every shipped config instantiates with the settings the docs give it, and trains: its model, views, drawer and
callbacks as shipped, on tiny data, for one step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.callbacks import PreemptionCheckpoint
from hfmca_lightning.cli.trainer_cli import HFMCACLI
from hfmca_lightning.loggers import OfflineSafeWandbLogger
from tests.helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("**/*.yaml"))
LARGEST_SIDE = 64  # ImageNet-scale models train on 64-px images here; CIFAR and STL-10 configs on their own size


def assert_documented_settings(cli: HFMCACLI, config: Path) -> None:
    """What the docs say of every shipped config: checkpoints in ``runs/<config>/checkpoints``, ``last.ckpt`` every 500
    steps (1,000 in the ImageNet configs; the demo's once an epoch) and at every epoch's end (docs/training.md,
    docs/resume.md; the epoch's end: tests/callbacks/test_checkpoint.py); W&B runs kept in ``runs/<config>``; every
    cost synchronised over DDP processes but the single-process demo's (docs/speed.md); HFMCA's SGD fused
    (docs/conventions.md §2)."""
    name = config.stem
    (checkpoint,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, PreemptionCheckpoint)]
    assert Path(checkpoint.dirpath) == Path.cwd() / "runs" / name / "checkpoints" and checkpoint.save_last is True
    every = 0 if name == "demo" else 1000 if name.startswith("imagenet") else 500
    assert checkpoint._every_n_train_steps == every, name
    wandb = [logger for logger in cli.trainer.loggers if isinstance(logger, OfflineSafeWandbLogger)]
    if name != "demo":  # docs/training.md: offline runs under runs/<config>/wandb (the folder: tests/test_loggers.py)
        (logger,) = wandb
        assert Path(logger.save_dir).resolve() == Path.cwd() / "runs" / name
    costs = cli.model.cost_modules() if hasattr(cli.model, "cost_modules") else {}
    assert all(cost.sync_dist is (name != "demo") for cost in costs.values()), name
    model = yaml.safe_load(config.read_text())["model"]
    optimizer = model.get("init_args", {}).get("optimizer", {})
    if model["class_path"].endswith("HFMCAModule") and optimizer.get("class_path") == "torch.optim.SGD":
        assert optimizer["init_args"].get("fused") is True, name


@pytest.mark.filterwarnings("ignore:DensityRatioHeatmapCallback:hfmca_lightning.errors.HFMCAWarning")  # 4 test images
@pytest.mark.parametrize("config", CONFIGS, ids=[str(c.relative_to(REPO / "configs")) for c in CONFIGS])
def test_every_shipped_config_trains_one_step(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the configs' run folders land here
    cli = HFMCACLI(args=["--config", str(config)], run=False)
    assert_documented_settings(cli, config)
    assert (cli.trainer.max_epochs or 0) > 0 or cli.trainer.max_steps > 0, "every config must bound its run"
    # every run can be read without W&B: a CSV logger writes metrics.csv under the run's folder
    (csv_logger,) = [logger for logger in cli.trainer.loggers if isinstance(logger, CSVLogger)]
    assert Path(csv_logger.log_dir).resolve().is_relative_to(tmp_path / "runs")
    shipped = cli.datamodule
    count = shipped.num_views or 9
    overrides = {
        "trainer": {
            "max_steps": 1,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "logs"}},
        },
        "data": {
            "init_args": {
                "source": {
                    "class_path": "hfmca_lightning.data.SyntheticShapes",
                    "init_args": {
                        "num_classes": 2,
                        "train_per_class": count + 1,  # same-class groups of `count` distinct images
                        "test_per_class": 2,
                        "image_size": min(shipped.source.image_size, LARGEST_SIDE),
                    },
                },
                "batch_size": 2,
                "num_workers": 0,
            }
        },
    }
    if "warmup_epochs" in yaml.safe_load(config.read_text())["model"].get("init_args", {}):
        overrides["model"] = {"init_args": {"warmup_epochs": 0}}  # the run is one step long
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(overrides))
    cli = HFMCACLI(args=["fit", "--config", str(config), "--config", str(tmp_path / "tiny.yaml")])
    assert cli.trainer.global_step == 1
    assert type(cli.datamodule.views) is type(shipped.views) and type(cli.datamodule.drawer) is type(shipped.drawer)
    metrics = cli.trainer.callback_metrics
    losses = {name: float(value) for name, value in metrics.items() if name.startswith(("train/", "cost/"))}
    assert losses and all(math.isfinite(value) for value in losses.values()), losses
