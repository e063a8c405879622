"""How well does each label-free health metric track accuracy? RankMe, effective rank, alpha-ReQ and LiDAR
(:mod:`hfmca_lightning.analysis.health`) against kNN top-1 and linear-probe top-1, over the checkpoints of short runs
of HFMCA-SS(*) and of baselines on the demo's data, as Spearman rank correlations per method and pooled.

    python benchmarks/health_correlation.py                                  # hfmca simclr byol vicreg, 6 epochs
    python benchmarks/health_correlation.py --methods hfmca simclr --epochs 10 --out results/health_correlation.md

Every method trains on the demo's data and backbone with the demo's optimiser (``configs/demo.yaml``: SyntheticShapes
2,000 training images, SmallConvNet, Adam 2e-3, batch 64): ``hfmca`` is the demo as shipped, a baseline is the model
of ``configs/baselines/<name>_cifar10.yaml`` (its heads, loss settings and view count) with the demo's backbone,
optimiser and views. The weights are copied at initialisation and after every epoch (``--every-steps``: every that
many steps); each copy is then evaluated:

* the four metrics of the backbone embeddings ``(B, L, D)`` of one fixed set of augmented batches, the same for
  every method and copy: the first ``--health-batches`` training batches of the demo's data (4 views per image,
  ``hfmca_lightning.evaluation_data.view_batches``), summed (``HealthStatistics.of``, merged) and computed once over
  all of them; BatchNorm normalises with each batch's statistics, as in the training steps the health callback sees;
* kNN top-1 (k and temperature of the demo's ``KNNEvaluation``) and linear top-1 (``hfmca linear``'s classifier on
  frozen features, ``--linear-epochs``) on the 500 test images, as ``hfmca knn`` / ``hfmca linear`` compute them.

The script prints every copy's numbers, then a table of Spearman's rank correlation between each metric and each
accuracy, per method (over its copies) and pooled (over every method's copies).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CONFIGS, DISPLAY, SHIPPED_CONFIGS, TRAINING_ONLY, machine, markdown_table  # noqa: E402

from hfmca_lightning.analysis.health import HealthStatistics  # noqa: E402
from hfmca_lightning.cli.evaluate import frozen_linear_accuracy, split_features  # noqa: E402
from hfmca_lightning.cli.trainer_cli import HFMCACLI  # noqa: E402
from hfmca_lightning.data.datamodule import BANK, QUERIES  # noqa: E402
from hfmca_lightning.evaluation import knn_accuracy  # noqa: E402
from hfmca_lightning.evaluation.batch_norm import batch_statistics_mode  # noqa: E402
from hfmca_lightning.evaluation_data import view_batches  # noqa: E402

METRICS = {"rankme": "RankMe", "effective_rank": "effective rank", "alpha_req": "alpha-ReQ", "lidar": "LiDAR"}
ACCURACIES = {"knn": "kNN", "linear": "linear"}
METHODS = ["hfmca", "simclr", "moco", "byol", "simsiam", "barlowtwins", "vicreg", "fastsiam"]  # not VICRegL: grids


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given their mean rank."""
    order = np.argsort(values, kind="stable")
    ranked = np.empty(len(values))
    ranked[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tied = values == value
        ranked[tied] = ranked[tied].mean()
    return ranked


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks, ties at their mean rank); NaN where either is constant or
    fewer than 3 pairs."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    ra, rb = ranks(a) - (len(a) + 1) / 2, ranks(b) - (len(b) + 1) / 2
    return float((ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()))


def method_config(method: str, demo: dict[str, Any]) -> dict[str, Any]:
    """The demo config (``hfmca``), or a baseline's shipped model on the demo's backbone, optimiser and views."""
    config = {key: copy.deepcopy(demo[key]) for key in ("seed_everything", "model", "data")}
    if method == "hfmca":
        return config
    shipped = yaml.safe_load((CONFIGS / SHIPPED_CONFIGS[method]).read_text())
    model = copy.deepcopy(shipped["model"])
    model["init_args"]["backbone"] = copy.deepcopy(demo["model"]["init_args"]["backbone"])
    model["init_args"]["optimizer"] = copy.deepcopy(demo["model"]["init_args"]["optimizer"])
    model["init_args"].pop("lr_scheduler", None)
    config["model"] = model
    count = shipped["data"]["init_args"]["views"]["init_args"]["count"]
    config["data"]["init_args"]["views"]["init_args"]["count"] = count
    return config


class Snapshots(Callback):
    """Copies of the weights at initialisation and after every epoch (or every ``every_steps`` steps): ``(label,
    state_dict)``."""

    def __init__(self, every_steps: int | None) -> None:
        self.every_steps = every_steps
        self.copies: list[tuple[str, dict[str, torch.Tensor]]] = []

    def _take(self, label: str, module: LightningModule) -> None:
        self.copies.append((label, copy.deepcopy(module.state_dict())))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take("init", pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.every_steps and trainer.global_step % self.every_steps == 0:
            self._take(f"step {trainer.global_step}", pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.every_steps:
            self._take(f"epoch {trainer.current_epoch + 1}", pl_module)


@torch.no_grad()
def health(module: LightningModule, batches: list[torch.Tensor]) -> dict[str, float]:
    """The four metrics of the backbone embeddings of ``batches`` ``(B, L, C, H, W)``, summed over all of them."""
    backbone = module.backbone
    sums: HealthStatistics | None = None
    with batch_statistics_mode(backbone):
        for views in batches:
            embeddings = backbone(views.flatten(0, 1)).unflatten(0, views.shape[:2])
            added = HealthStatistics.of(embeddings)
            sums = added if sums is None else sums.merge(added)
    assert sums is not None
    return sums.metrics()


def accuracies(module: LightningModule, data: Any, k: int, temperature: float, linear_epochs: int) -> dict[str, float]:
    """kNN top-1 and linear top-1 on the test split, as ``hfmca knn`` and ``hfmca linear`` compute them."""
    features = split_features(module, data, "cpu")
    (bank, bank_targets), (queries, query_targets) = features[BANK], features[QUERIES]
    knn = knn_accuracy(queries, query_targets, bank, bank_targets, data.num_classes, k=k, temperature=temperature)
    linear = frozen_linear_accuracy(module, data, epochs=linear_epochs, device="cpu")[1]
    return {"knn": knn, "linear": linear}


def correlation_table(results: dict[str, list[dict[str, float]]]) -> str:
    """Spearman's rho of each metric against each accuracy: per method, then pooled over every method's copies (a
    copy equal to another in every number, such as the methods' common initialisation, counted once)."""
    columns = [(DISPLAY[method], rows) for method, rows in results.items()]
    if len(results) > 1:
        distinct = {tuple(sorted(row.items())): row for rows in results.values() for row in rows}
        columns.append(("pooled", list(distinct.values())))
    header = ["metric"] + [f"{name} ({len(rows)}): {ACCURACIES[a]}" for name, rows in columns for a in ACCURACIES]
    table = []
    for metric, label in METRICS.items():
        cells = [label]
        for _, rows in columns:
            for accuracy in ACCURACIES:
                rho = spearman([row[metric] for row in rows], [row[accuracy] for row in rows])
                cells.append("-" if np.isnan(rho) else f"{rho:+.2f}")
        table.append(cells)
    return markdown_table(header, table)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(CONFIGS / "demo.yaml"), help="the data, backbone, optimiser")
    parser.add_argument("--methods", nargs="+", default=["hfmca", "simclr", "byol", "vicreg"], choices=METHODS)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--every-steps", type=int, default=None, help="copy the weights every this many steps")
    parser.add_argument("--health-batches", type=int, default=8, help="fixed training batches the metrics see")
    parser.add_argument("--linear-epochs", type=int, default=100, help="of the linear classifier (hfmca linear's)")
    parser.add_argument("--per-class", type=int, default=None, help="SyntheticShapes training images per class")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the config's")
    parser.add_argument("--workers", type=int, default=None, help="default: the config's num_workers")
    parser.add_argument("--out", default=None, help="also write the tables here")
    parser.add_argument("--tiny", action="store_true", help="a few steps of a small copy (smoke test)")
    args = parser.parse_args(argv)
    demo = yaml.safe_load(Path(args.config).read_text())
    if args.tiny:
        args.epochs, args.health_batches, args.linear_epochs = 2, 2, 5
        args.per_class, args.batch_size, args.workers = args.per_class or 8, args.batch_size or 16, 0
        demo["model"]["init_args"]["backbone"]["init_args"]["width"] = 8
        demo["model"]["init_args"]["projector"]["init_args"]["input_dim"] = 32
        demo["data"]["init_args"]["source"]["init_args"]["test_per_class"] = 10
    data_settings = demo["data"]["init_args"]
    for key, value in (("batch_size", args.batch_size), ("num_workers", args.workers)):
        if value is not None:
            data_settings[key] = value
    if args.per_class is not None:
        data_settings["source"]["init_args"]["train_per_class"] = args.per_class
    callbacks = demo.get("trainer", {}).get("callbacks", [])
    knn_settings = next((c.get("init_args", {}) for c in callbacks if c["class_path"].endswith("KNNEvaluation")), {})
    k, temperature = int(knn_settings.get("k", 200)), float(knn_settings.get("temperature", 0.1))

    began, began_cpu = time.perf_counter(), os.times()
    fixed: list[torch.Tensor] | None = None
    results: dict[str, list[dict[str, float]]] = {}
    after_training: dict[str, list[dict[str, float]]] = {}  # without the copy at initialisation
    lines: list[list[str]] = []
    quiet = {"logger": False, "callbacks": [], "enable_progress_bar": False}
    for method in args.methods:
        cli = HFMCACLI(args={**method_config(method, demo), "trainer": quiet}, run=False)  # seeds from the config
        module, data = cli.model, cli.datamodule
        if fixed is None:  # the demo's own views (4 per image), the same batches for every method and copy
            views_data = HFMCACLI(args={**method_config("hfmca", demo), "trainer": quiet}, run=False).datamodule
            views_data.setup("fit")
            fixed = [
                batch.groups[0].clone() for batch in view_batches(views_data, torch.device("cpu"), args.health_batches)
            ]
        snapshots = Snapshots(args.every_steps)
        trainer = Trainer(max_epochs=args.epochs, accelerator="cpu", callbacks=[snapshots], **TRAINING_ONLY)
        start = time.perf_counter()
        trainer.fit(module, data)
        trained = time.perf_counter() - start
        start = time.perf_counter()
        rows = []
        for label, weights in snapshots.copies:
            module.load_state_dict(weights)
            row = health(module, fixed) | accuracies(module, data, k, temperature, args.linear_epochs)
            rows.append(row)
            lines.append(
                [DISPLAY[method], label]
                + [f"{row[m]:.2f}" for m in METRICS]
                + [f"{100 * row[a]:.1f}" for a in ACCURACIES]
            )
        results[method] = rows
        after_training[method] = rows[1:]
        print(
            f"{DISPLAY[method]}: trained {trained:.0f} s, {len(rows)} copies evaluated in "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )

    cpu = sum(
        getattr(os.times(), name) - getattr(began_cpu, name)
        for name in ("user", "system", "children_user", "children_system")
    )
    samples = sum(batch.shape[0] for batch in fixed or [])
    views = fixed[0].shape[1] if fixed else 0
    copies = "every epoch" if not args.every_steps else f"every {args.every_steps} steps"
    heading = (
        f"{Path(args.config).name} data, backbone and optimiser, {args.epochs} epochs, weights copied at "
        f"initialisation and {copies}; metrics of {samples} images x {views} views; kNN k = {k}, t = {temperature:g}; "
        f"linear classifier {args.linear_epochs} epochs; {machine()}; {time.perf_counter() - began:.0f} s in all "
        f"({cpu:.0f} s of CPU time)"
    )
    values = markdown_table(
        ["method", "weights", *METRICS.values(), *(f"{name} top-1 (%)" for name in ACCURACIES.values())], lines
    )
    table = (
        f"{heading}\n\n{values}\n\nSpearman's rank correlation of each metric with each accuracy, every copy (copies "
        f"per column in brackets):\n\n{correlation_table(results)}\n\nThe same over the trained copies (the "
        f"initialisation left out):\n\n{correlation_table(after_training)}"
    )
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
