"""``hfmca linear`` and ``hfmca knn``: offline evaluation of any checkpoint of the package.

    hfmca linear --ckpt_path runs/cifar10_ss/checkpoints/last.ckpt                      # frozen features
    hfmca linear --ckpt_path ... --label_fraction 0.01                                  # 1 % of the labels
    hfmca linear --ckpt_path ... --finetune --epochs 30                                 # full fine-tuning
    hfmca knn --ckpt_path ... --k 20 200 --temperature 0.07 0.1                         # a grid

Both use the run's DataModule evaluation splits (the labelled train split and the test split, without
augmentation, exactly what :class:`~hfmca_lightning.callbacks.KNNEvaluation` uses) and write a JSON file
and a Markdown table to ``--out`` (default: ``<run dir>/evaluation`` for a checkpoint in the run's ``checkpoints``
folder, else ``evaluation`` beside the checkpoint), each file atomically, the JSON last. Both commands may share a
folder; a command whose own files are already there is refused unless ``--overwrite`` is given. Fine-tuning reports its
progress as ``hfmca fit`` does: a bar on a terminal, a line per epoch in a log file or a pipe, nothing with ``-q``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything

from hfmca_lightning.cli import options
from hfmca_lightning.cli.paths import check_out, read_config_file
from hfmca_lightning.cli.runs import backbone_of, load_run
from hfmca_lightning.cli.trainer_cli import progress_report
from hfmca_lightning.cli.verbosity import progress, stage, warn
from hfmca_lightning.data.datamodule import BANK, QUERIES, MultiViewDataModule
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation import (
    class_balanced_subset,
    classes_raised_to_one_image,
    extract_features,
    knn_grid,
    topk_accuracies,
    train_linear_classifier,
)
from hfmca_lightning.evaluation_data import finetune_loader, labelled_splits
from hfmca_lightning.runtime.checkpoint_io import read_checkpoint
from hfmca_lightning.runtime.files import StagedFiles

__all__ = ["split_features", "frozen_linear_accuracy", "linear_evaluation", "knn_evaluation", "run_evaluation_command"]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_out(ckpt_path: str | Path) -> Path:
    """``<run dir>/evaluation`` for ``<run dir>/checkpoints/<name>.ckpt``; ``evaluation`` beside a checkpoint kept
    anywhere else (never in the folder above it, which may hold other runs or none)."""
    folder = Path(ckpt_path).resolve().parent
    return (folder.parent if folder.name == "checkpoints" else folder) / "evaluation"


def split_features(
    module: LightningModule, datamodule: MultiViewDataModule, device: str
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Features and targets of the ``BANK`` (labelled train) and ``QUERIES`` (test) splits, un-augmented.

    Raises:
        ConfigurationError: when the source has no labels, or features hold NaN or Inf (no classifier or vote could
            use them; the checkpoint's weights are finite, so its forward pass overflowed).
    """
    labelled_splits(datamodule)  # one clear error when the source has no labels
    module.to(device)
    names = {BANK: "features of the training split", QUERIES: "features of the test split"}
    loaders = {index: datamodule.evaluation_loader(index, tuples=True) for index in (BANK, QUERIES)}
    features = {
        index: extract_features(module, progress(loaders[index], names[index], total=len(loaders[index])), device)
        for index in (BANK, QUERIES)
    }
    for index, (values, _) in features.items():
        if broken := int((~torch.isfinite(values)).any(dim=1).sum()):
            raise ConfigurationError(
                f"the {names[index]} hold NaN or Inf ({broken} of {len(values)} images): the backbone's forward pass "
                "overflows on them (in reduced precision?), so no classifier or vote can use them"
            )
    return features


def frozen_linear_accuracy(
    module: LightningModule,
    datamodule: MultiViewDataModule,
    subset: torch.Tensor | None = None,
    *,
    epochs: int = 100,
    batch_size: int = 256,
    lr: float = 0.1,
    seed: int = 0,
    device: str = "cpu",
) -> dict[int, float]:
    """Top-1 / top-5 on the test split of a linear classifier trained on the frozen features of the labelled
    training split (its rows ``subset`` when given), features computed once."""
    features = split_features(module, datamodule, device)
    train_features, train_labels = features[BANK]
    if subset is not None:
        train_features, train_labels = train_features[subset], train_labels[subset]
    stage(f"linear classifier on the features of {len(train_features):,} labelled images, {epochs} epochs")
    classifier = train_linear_classifier(
        train_features.to(device),
        train_labels.to(device),
        datamodule.num_classes,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
    )
    test_features, test_labels = features[QUERIES]
    return topk_accuracies(classifier.logits(test_features.to(device)).cpu(), test_labels, datamodule.num_classes)


def linear_name(finetune: bool, label_fraction: float) -> str:
    """The files' name of a linear or fine-tuning evaluation: ``linear`` / ``finetune``, with the share of the labels
    below 100 % (``linear_1pct``), so the semi-supervised protocols of one run sit side by side."""
    name = "finetune" if finetune else "linear"
    return name if label_fraction >= 1 else f"{name}_{100 * label_fraction:g}pct"


def _write(out: Path, name: str, result: dict[str, Any], table: str) -> Path:
    """``<name>.md`` and ``<name>.json`` (last), both or neither."""
    with StagedFiles() as files:
        files.write_text(out / f"{name}.md", table)
        files.write_text(out / f"{name}.json", json.dumps(result, indent=1))
    return out / f"{name}.json"


def linear_evaluation(
    ckpt_path: str | Path,
    out: str | Path | None = None,
    *,
    epochs: int = 100,
    batch_size: int = 256,
    lr: float = 0.1,
    label_fraction: float = 1.0,
    finetune: bool = False,
    seed: int = 0,
    device: str | None = None,
    config_path: str | Path | None = None,
) -> dict[str, Any]:
    """Top-1 / top-5 on the test split of a linear classifier on the frozen backbone's features (computed
    once), or with ``finetune`` of the whole backbone + linear layer; trained on ``label_fraction`` of the
    labelled training split (class-balanced). Writes ``<name>.json`` / ``<name>.md`` (:func:`linear_name`)."""
    if epochs < 1 or batch_size < 1 or not (math.isfinite(lr) and lr > 0):
        raise ConfigurationError(
            f"linear evaluation needs epochs >= 1, batch_size >= 1 and a finite lr > 0; got {epochs}, {batch_size} "
            f"and {lr}"
        )
    device = device or default_device()
    module, datamodule = load_run(ckpt_path, config_path)
    train_split, test_split = labelled_splits(datamodule)
    train_targets = torch.as_tensor(train_split.targets)
    subset = class_balanced_subset(train_targets, label_fraction, seed)
    used_fraction = len(subset) / len(train_targets)
    if short := classes_raised_to_one_image(train_targets, label_fraction):
        warn(
            f"label_fraction {label_fraction:g} gives no image of {short} of the {len(train_targets.unique())} "
            "classes, so one of "
            f"each is taken: {len(subset)} of {len(train_targets)} labelled images ({100 * used_fraction:.3g} %) "
            "train the classifier"
        )
    seed_everything(seed, verbose=False)
    if finetune:
        top = _finetune(module, datamodule, subset, epochs=epochs, lr=lr, seed=seed, device=device)
    else:
        top = frozen_linear_accuracy(
            module, datamodule, subset, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, device=device
        )
    result = {
        "checkpoint": str(ckpt_path),
        "method": type(module).__name__,
        "protocol": "full fine-tuning" if finetune else "linear classifier on frozen features",
        "label_fraction": label_fraction,
        "label_fraction_used": used_fraction,
        "train_samples": len(subset),
        "test_samples": len(test_split),
        "epochs": epochs,
        "lr": lr,
        "seed": seed,
        "top1": top[1],
        "top5": top[5],
    }
    table = (
        "| checkpoint | method | protocol | labels | top-1 | top-5 |\n| --- | --- | --- | ---: | ---: | ---: |\n"
        f"| {ckpt_path} | {result['method']} | {result['protocol']} | {100 * label_fraction:g}% | {100 * top[1]:.2f} | "
        f"{100 * top[5]:.2f} |\n"
    )
    _write(Path(out) if out else default_out(ckpt_path), linear_name(finetune, label_fraction), result, table)
    return result


def trainer_device(device: str) -> tuple[str, int | list[int]]:
    """Lightning's ``(accelerator, devices)`` of one device named as ``--device`` names it (``cuda:1``: that GPU)."""
    parsed = torch.device(device)
    accelerator = {"cuda": "gpu", "mps": "mps"}.get(parsed.type, "cpu")
    return accelerator, [parsed.index] if parsed.type == "cuda" and parsed.index is not None else 1


def _finetune(
    module: LightningModule,
    datamodule: MultiViewDataModule,
    subset: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    seed: int,
    device: str,
) -> dict[int, float]:
    from hfmca_lightning.methods.classifier import FineTunedClassifier

    backbone = backbone_of(module)
    feature_dim = getattr(backbone, "feature_dim", None)
    if feature_dim is None:
        raise ConfigurationError(
            f"{type(backbone).__name__} has no feature_dim attribute; fine-tuning needs it to size the linear layer"
        )
    classifier = FineTunedClassifier(
        backbone.train(), int(feature_dim), datamodule.num_classes, lr=lr, batch_size=datamodule.batch_size
    )
    accelerator, devices = trainer_device(device)
    enable_progress_bar, callbacks = progress_report()
    trainer = Trainer(
        max_epochs=epochs,
        accelerator=accelerator,
        devices=devices,
        logger=False,
        enable_progress_bar=enable_progress_bar,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    queries = datamodule.evaluation_loader(QUERIES, tuples=True)
    trainer.fit(
        classifier, train_dataloaders=finetune_loader(datamodule, subset.tolist(), seed), val_dataloaders=queries
    )
    metrics = trainer.validate(classifier, dataloaders=queries, verbose=False)[0]
    return {1: float(metrics["finetune/top1"]), 5: float(metrics["finetune/top5"])}


def knn_evaluation(
    ckpt_path: str | Path,
    out: str | Path | None = None,
    *,
    ks: list[int] | tuple[int, ...] = (20, 200),
    temperatures: list[float] | tuple[float, ...] = (0.07, 0.1),
    device: str | None = None,
    config_path: str | Path | None = None,
) -> dict[str, Any]:
    """kNN top-1 on the test split for every ``(k, temperature)``, features computed once. Writes
    ``knn.json`` and ``knn.md`` (rows: k, columns: temperature)."""
    if any(k < 1 for k in ks) or not all(math.isfinite(t) and t > 0 for t in temperatures):
        raise ConfigurationError(
            f"--k values must be >= 1 and --temperature values > 0; got {list(ks)} and {list(temperatures)}"
        )
    module, datamodule = load_run(ckpt_path, config_path)
    features = split_features(module, datamodule, device or default_device())
    (bank, bank_targets), (queries, query_targets) = features[BANK], features[QUERIES]
    if beyond := sorted({k for k in ks if k > len(bank)}):  # knn_grid votes with the whole bank
        listed = ", ".join(f"k={k}" for k in beyond)
        warn(
            f"{listed} {'is' if len(beyond) == 1 else 'are'} more than the {len(bank)} images of the kNN bank: voted "
            f"with the whole bank, reported as k={len(bank)}"
        )
    rows = knn_grid(queries, query_targets, bank, bank_targets, datamodule.num_classes, ks, temperatures)
    result = {
        "checkpoint": str(ckpt_path),
        "method": type(module).__name__,
        "bank": len(bank),
        "queries": len(queries),
        "results": rows,
    }
    header = (
        "| k | " + " | ".join(f"t = {t:g}" for t in temperatures) + " |\n|---:|" + "---:|" * len(temperatures) + "\n"
    )
    used = dict.fromkeys(row["k"] for row in rows)  # a k above the bank's size is the bank's size (knn_grid)
    lines = [f"| {k} | " + " | ".join(f"{100 * row['top1']:.2f}" for row in rows if row["k"] == k) + " |" for k in used]
    table = (
        f"kNN top-1 (%) of {ckpt_path} ({result['method']}), {len(bank)} bank / {len(queries)} test images\n\n{header}"
        + "\n".join(lines)
        + "\n"
    )
    _write(Path(out) if out else default_out(ckpt_path), "knn", result, table)
    return result


def run_evaluation_command(argv: list[str]) -> None:
    """Parse and run ``linear ...`` or ``knn ...``."""
    parser = options.OneLineParser(prog="hfmca", description="Offline evaluation of trained checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    linear = commands.add_parser(
        "linear", help="linear classifier on frozen features, or --finetune; top-1/top-5 on the test split"
    )
    knn = commands.add_parser("knn", help="kNN top-1 on the test split over a grid of k and temperature")
    for sub in (linear, knn):
        sub.add_argument("--ckpt_path", required=True)
        sub.add_argument(
            "--out",
            default=None,
            help="output folder (default: <run dir>/evaluation; for a checkpoint outside a checkpoints/ folder, "
            "evaluation beside it)",
        )
        sub.add_argument(
            "--overwrite", action="store_true", help="replace this command's files of an earlier run in --out"
        )
        sub.add_argument("--config", default=None, help="the run's YAML, for checkpoints not written by `hfmca fit`")
        sub.add_argument(
            "--device", type=options.device_name, default=None, help="cpu or cuda (default: cuda when available)"
        )
    linear.add_argument(
        "--finetune", action="store_true", help="train the whole backbone too (augmented training images)"
    )
    linear.add_argument(
        "--label_fraction",
        type=float,
        default=1.0,
        help="share of the labelled training images, class-balanced (0.01, 0.1)",
    )
    linear.add_argument("--epochs", type=options.positive_int, default=100)
    linear.add_argument(
        "--batch_size",
        type=options.positive_int,
        default=None,
        help="of the linear classifier on features (default 256; fine-tuning uses the run's)",
    )
    linear.add_argument(
        "--lr",
        type=options.finite_positive_float,
        default=None,
        help="base learning rate at batch 256 (default 0.1 linear, 0.05 fine-tuning)",
    )
    linear.add_argument("--seed", type=options.seed, default=0)
    knn.add_argument("--k", type=options.positive_int, nargs="+", default=[20, 200])
    knn.add_argument("--temperature", type=options.finite_positive_float, nargs="+", default=[0.07, 0.1])
    args = parser.parse_args(argv)
    if args.command == "linear":
        if not 0 < args.label_fraction <= 1:
            raise ConfigurationError(f"--label_fraction must be in (0, 1]; got {args.label_fraction}")
        if args.finetune and args.batch_size is not None:
            raise ConfigurationError(
                "--batch_size is the linear classifier's batch on frozen features; --finetune trains in the run's "
                "batches (its data.init_args.batch_size): leave --batch_size out"
            )
        args.batch_size = 256 if args.batch_size is None else args.batch_size
    if args.config is not None:
        read_config_file(args.config)  # a file that is no YAML mapping: one line, before any work
    name = linear_name(args.finetune, args.label_fraction) if args.command == "linear" else "knn"
    if not Path(args.ckpt_path).is_file():
        read_checkpoint(args.ckpt_path)  # missing, or a folder: one line, before the output folder is made
    check_out(args.out or default_out(args.ckpt_path), args.overwrite, outputs=(f"{name}.json", f"{name}.md"))
    if args.command == "linear":
        lr = args.lr if args.lr is not None else (0.05 if args.finetune else 0.1)
        result = linear_evaluation(
            args.ckpt_path,
            args.out,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=lr,
            label_fraction=args.label_fraction,
            finetune=args.finetune,
            seed=args.seed,
            device=args.device,
            config_path=args.config,
        )
        print(
            f"{result['protocol']}, {100 * result['label_fraction']:g}% of the labels: "
            f"top-1 {100 * result['top1']:.2f} %, top-5 {100 * result['top5']:.2f} %"
        )
    else:
        result = knn_evaluation(
            args.ckpt_path,
            args.out,
            ks=args.k,
            temperatures=args.temperature,
            device=args.device,
            config_path=args.config,
        )
        for row in result["results"]:
            print(f"k={row['k']:<4d} t={row['temperature']:<5g} top-1 {100 * row['top1']:.2f} %")
    print(f"wrote {Path(args.out) if args.out else default_out(args.ckpt_path)}")
