"""Shared pieces of the benchmark scripts: build a method, build its data, train it and measure."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from hfmca_lightning.callbacks import KNNEvaluation, LinearProbe
from hfmca_lightning.data import CIFAR, MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.methods.inspection import analysis_layers
from hfmca_lightning.models import CIFARResNet18, GridExternalHead, SmallConvNet, ViewProjector


def baselines() -> dict[str, type[LightningModule]]:
    """The lightly-based baselines by name (imported on use: the HFMCA rows and gpu_check need no lightly)."""
    from hfmca_lightning.methods.baselines import BYOL, BarlowTwins, FastSiam, MoCo, SimCLR, SimSiam, VICReg, VICRegL

    return {
        "simclr": SimCLR,
        "moco": MoCo,
        "byol": BYOL,
        "simsiam": SimSiam,
        "barlowtwins": BarlowTwins,
        "vicreg": VICReg,
        "vicregl": VICRegL,
        "fastsiam": FastSiam,
    }


DISPLAY = {
    "hfmca": "HFMCA-SS(*)",
    "hfmca_internal": "HFMCA-SS",
    "simclr": "SimCLR",
    "moco": "MoCo v2",
    "byol": "BYOL",
    "simsiam": "SimSiam",
    "barlowtwins": "Barlow Twins",
    "vicreg": "VICReg",
    "vicregl": "VICRegL",
    "fastsiam": "FastSiam",
}
VIEW_GRIDS = {"vicregl": 4}  # VICRegL's crop grids: the 4x4 local map of both backbones on 32 px images
GRIDS = {4: (2, 2), 9: (3, 3), 16: (4, 4)}


def views_of(method: str, hfmca_views: int) -> int:
    return hfmca_views if method.startswith("hfmca") else 4 if method == "fastsiam" else 2


def machine() -> str:
    """The CPU (or GPU) that measured, in words."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({platform.machine()}), {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


# A Trainer that only trains: one device, no logger, checkpoints, progress bar, summary or validation.
TRAINING_ONLY: dict[str, Any] = dict(
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED_CONFIGS = {
    "hfmca": "cifar10_ss.yaml",
    "hfmca_internal": "cifar10_ss_internal.yaml",
    **{name: f"baselines/{name}_cifar10.yaml" for name in DISPLAY if not name.startswith("hfmca")},
}


def shipped_model_arguments(method: str) -> dict[str, Any]:
    """The model's ``init_args`` in the method's shipped CIFAR10 config (its heads, temperatures and costs: the
    paper's Table 1 settings, one source of truth), without the backbone and the optimiser."""
    config = yaml.safe_load((CONFIGS / SHIPPED_CONFIGS[method]).read_text())
    return {
        key: value
        for key, value in config["model"]["init_args"].items()
        if key not in ("backbone", "optimizer", "lr_scheduler")
    }


def build_method(
    method: str, backbone: str, hfmca_views: int = 9, head_dim: int | None = None, **hfmca_options: Any
) -> LightningModule:
    """The method as its shipped config builds it (:func:`shipped_model_arguments`), on ``backbone``, with the Table 1
    optimiser (SGD 0.06, momentum 0.9, wd 5e-4, cosine). ``head_dim`` shrinks every head (hidden and output width)
    for quick CPU runs; ``hfmca_options`` go to HFMCAModule (channels_last, compile_backbone, ...)."""
    net = CIFARResNet18() if backbone == "resnet18" else SmallConvNet(width=16, num_stages=3)
    shipped = shipped_model_arguments(method)
    if method.startswith("hfmca"):
        projector = shipped["projector"]["init_args"]
        head = shipped["external_head"]["init_args"]
        k = head_dim or projector["output_dim"]
        if method == "hfmca_internal":
            internal = shipped["internal_costs"]["init_args"]
            # on every residual block (ResNet-18: the config's 8 BasicBlocks), or the small CPU backbone's stages
            hfmca_options.setdefault(
                "internal_costs",
                InternalCosts(
                    analysis_layers(net), reg=internal["reg"], weight=internal.get("weight", 1.0), sync_dist=True
                ),
            )
        return HFMCAModule(
            net,
            ViewProjector(net.feature_dim, k, head_dim or projector["hidden_dim"]),
            GridExternalHead(
                k,
                *GRIDS[hfmca_views],
                hidden_dim=head_dim or head["hidden_dim"],
                noise_channels=head.get("noise_channels", 0),
            ),
            HFMCACost(**shipped["external_cost"]["init_args"]),
            **hfmca_options,
        )
    arguments: dict[str, Any] = {
        key: tuple(value) if isinstance(value, list) else value for key, value in shipped.items()
    }
    if head_dim:
        arguments.update(hidden_dim=head_dim, output_dim=head_dim)
        if method in ("simsiam", "fastsiam"):
            arguments["prediction_dim"] = max(8, head_dim // 2)
        if method == "moco":
            arguments["memory_bank_size"] = 256
    if method == "vicregl":  # local features: the last 4x4 map; lightly's (20, 4) matches are for 7x7 maps
        arguments["local_layer"] = None if backbone == "resnet18" else "features"
    return baselines()[method](net, **arguments)


def build_data(
    dataset: str,
    root: str,
    views: int,
    batch_size: int,
    workers: int,
    per_class: int,
    view_grids: int = 0,
    **strengths: float | None,
) -> MultiViewDataModule:
    """``views`` SimCLR views of each image (with crop grids of side ``view_grids`` where > 0; ``strengths``: the
    other settings of :class:`~hfmca_lightning.data.SimCLRViews`, such as its Table 2 knobs), drawn in ``workers``
    CPU workers."""
    if dataset == "synthetic":
        source = SyntheticShapes(num_classes=10, train_per_class=per_class, test_per_class=max(10, per_class // 4))
    else:
        source = CIFAR(name=dataset, root=root, download=True)
    return MultiViewDataModule(
        source,
        views=SimCLRViews(count=views, grids=view_grids, **strengths),
        batch_size=batch_size,
        num_workers=workers,
    )


@dataclass
class Measurement:
    knn_by_epoch: list[float] = field(default_factory=list)
    linear_by_epoch: list[float] = field(default_factory=list)
    offline_linear: float = float("nan")
    external_cost_by_epoch: list[float] = field(default_factory=list)
    external_cost_by_step: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    epoch_seconds: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    views_seen: int = 0
    peak_memory: str = ""
    schedule_length: int = 0  # the cosine's T_max, in units of schedule_interval
    schedule_interval: str = ""  # "epoch" or "step"
    learning_rates: list[float] = field(
        default_factory=list
    )  # the first group's rate at the start of every epoch, then at the end

    @property
    def best_knn(self) -> float:
        """Best kNN top-1 of the run (lightly's benchmarks report the maximum over the run)."""
        return max(self.knn_by_epoch) if self.knn_by_epoch else float("nan")

    def knn_at(self, epoch: int) -> float:
        """Best kNN top-1 up to ``epoch`` (1-based), as the paper's Table 1 reports."""
        return max(self.knn_by_epoch[:epoch]) if len(self.knn_by_epoch) >= epoch else float("nan")

    def linear_at(self, epoch: int) -> float:
        """Best online linear-probe top-1 up to ``epoch`` (1-based)."""
        return max(self.linear_by_epoch[:epoch]) if len(self.linear_by_epoch) >= epoch else float("nan")


class _Recorder(Callback):
    def __init__(self, measurement: Measurement) -> None:
        self.m = measurement
        self._start = 0.0
        self._costs: list[torch.Tensor] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.lr_scheduler_configs:
            config = trainer.lr_scheduler_configs[0]
            scheduler = config.scheduler
            length = getattr(scheduler, "T_max", None) or getattr(
                scheduler, "max_epochs", None
            )  # torch cosine / lightly's warm-up cosine
            self.m.schedule_length, self.m.schedule_interval = int(length or 0), config.interval

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()
        self._costs = []
        self.m.learning_rates.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.m.learning_rates.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        groups = batch[0] if isinstance(batch[0], (list, tuple)) else [batch[0]]  # views of several sizes: a list
        self.m.views_seen += sum(group.shape[0] * group.shape[1] for group in groups)
        if "cost/external" in trainer.callback_metrics:
            # kept as a tensor until the epoch ends: a float() per step would make the host wait for the GPU
            self._costs.append(trainer.callback_metrics["cost/external"].detach().clone())

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        costs = (
            torch.stack(self._costs).double().cpu().tolist() if self._costs else []
        )  # waits for the epoch's last step
        self.m.epoch_seconds.append(time.perf_counter() - self._start)
        self.m.train_seconds += self.m.epoch_seconds[-1]
        if costs:
            self.m.external_cost_by_step.extend(costs)
            self.m.external_cost_by_epoch.append(sum(costs) / len(costs))

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and "knn/top1" in trainer.callback_metrics:
            self.m.knn_by_epoch.append(float(trainer.callback_metrics["knn/top1"]))
        if not trainer.sanity_checking and "linear/top1" in trainer.callback_metrics:
            self.m.linear_by_epoch.append(float(trainer.callback_metrics["linear/top1"]))


def train_and_measure(
    module: LightningModule,
    data: MultiViewDataModule,
    epochs: int,
    limit_train_batches: int | float = 1.0,
    k: int = 200,
    accelerator: str = "auto",
    precision: str = "32-true",
    linear_epochs: int | None = 100,
    online_probe: bool = True,
    max_seconds: float | None = None,
) -> Measurement:
    """Train ``epochs`` epochs with kNN and (``online_probe``; off for the GPU check, whose machine lacks lightly)
    the online linear probe every epoch, and an offline linear classifier of ``linear_epochs`` at the end (None: none).
    ``max_seconds`` stops training after that long (Lightning's ``max_time``; the GPU check's time budget)."""
    measurement = Measurement()
    trainer = Trainer(
        max_epochs=epochs,
        accelerator=accelerator,
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=limit_train_batches,
        log_every_n_steps=1,
        callbacks=[KNNEvaluation(k=k), *([LinearProbe()] if online_probe else []), _Recorder(measurement)],
        max_time=None if max_seconds is None else datetime.timedelta(seconds=max_seconds),
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module, data)
    measurement.wall_seconds = time.perf_counter() - start
    if linear_epochs:
        measurement.offline_linear = offline_linear_top1(module, data, linear_epochs)
    if torch.cuda.is_available():
        measurement.peak_memory = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (GPU)"
    else:
        measurement.peak_memory = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (process RSS)"
    return measurement


def offline_linear_top1(module: LightningModule, data: MultiViewDataModule, epochs: int) -> float:
    """Top-1 on the test split of a linear classifier trained on the final frozen features (``hfmca linear``'s
    protocol)."""
    from hfmca_lightning.cli.evaluate import (
        frozen_linear_accuracy,
    )  # imports the CLI (jsonargparse): only where linear runs

    return frozen_linear_accuracy(module, data, epochs=epochs, device="cuda" if torch.cuda.is_available() else "cpu")[1]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def add_training_arguments(parser: argparse.ArgumentParser, epochs_help: str) -> None:
    """Arguments both benchmark scripts take: data, model size, loader and kNN settings."""
    parser.add_argument("--data", default="cifar10", choices=["cifar10", "cifar100", "synthetic"])
    parser.add_argument("--root", default="data", help="CIFAR folder (downloaded when missing)")
    parser.add_argument("--backbone", default="resnet18", choices=["resnet18", "small"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hfmca-views", type=int, default=9, choices=[4, 9, 16])
    parser.add_argument("--head-dim", type=int, default=None, help="shrink every head (quick CPU runs)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--per-class", type=int, default=100, help="synthetic data: training images per class")
    parser.add_argument(
        "--limit-train-batches", type=float, default=1.0, help="fraction (<= 1) or number of batches per epoch"
    )
    parser.add_argument("--knn-k", type=int, default=200)
    parser.add_argument(
        "--linear-epochs", type=int, default=100, help="of the offline linear classifier on the final features"
    )
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.epilog = epochs_help


def train_batch_limit(value: float) -> int | float:
    return int(value) if value > 1 else value


def write_table(table: str, out: str | None) -> None:
    print(table)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table + "\n")
