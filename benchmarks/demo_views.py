"""How many views should the demo use? The demo config (``configs/demo.yaml``) trained as shipped with its
views and LF grid replaced, against SimCLR on the same backbone, data and optimiser; kNN top-1 after every
epoch against the seconds of training so far, in one process on this machine.

    python benchmarks/demo_views.py --settings l4 l9 simclr --epochs 12 --out results/demo_views.md

Settings: ``l4`` = 4 views on a 2x2 LF grid without noise channels; ``l9`` = the paper's 9 views on a 3x3
grid with 20 noise channels in LF; ``l4_noise`` / ``l9_no_noise`` the other noise setting of each;
``multicrop`` = 2 global crops of 32 px and 6 local crops of 16 px (``MultiCrop``: scales 0.14-1 and 0.05-0.14) on a
2x4 LF grid without noise; ``simclr`` = lightly's SimCLR on 2 views. The table reports, for each
setting, the final kNN top-1 and training time, and the best kNN top-1 reached within the training time of
the fastest HFMCA setting (equal wall-clock).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, train_and_measure, write_table  # noqa: E402

from hfmca_lightning.cli.trainer_cli import HFMCACLI  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "l4": (4, 2, 0),
    "l4_noise": (4, 2, 20),
    "l9": (9, 3, 20),
    "l9_no_noise": (9, 3, 0),
}  # views, grid side, LF noise channels
LABELS = {
    "l4": "HFMCA-SS(*), L = 4 (2x2 grid, no noise)",
    "l4_noise": "HFMCA-SS(*), L = 4 (2x2 grid, 20 noise channels)",
    "l9": "HFMCA-SS(*), L = 9 (3x3 grid, 20 noise channels)",
    "l9_no_noise": "HFMCA-SS(*), L = 9 (3x3 grid, no noise)",
    "multicrop": "HFMCA-SS(*), 2 global + 6 local crops (2x4 grid, no noise)",
    "simclr": "SimCLR (2 views)",
}


def setting_config(base: dict, setting: str, per_class: int | None) -> dict:
    """The demo config with the views / LF grid / noise of ``setting`` (or SimCLR on the demo's backbone); the views
    keep the demo's other settings (its greyscale strength; multi-crop crops at its own scales, without the demo's
    crop strength)."""
    config = copy.deepcopy(base)
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    if per_class:
        data["source"]["init_args"]["train_per_class"] = per_class
    views = data.setdefault("views", {"class_path": "hfmca_lightning.data.SimCLRViews"})
    settings = views.setdefault("init_args", {})
    if setting == "simclr":
        config["model"] = {
            "class_path": "hfmca_lightning.methods.baselines.SimCLR",
            "init_args": {
                "backbone": model["backbone"],
                "hidden_dim": 256,
                "output_dim": 64,
                "optimizer": model["optimizer"],
            },
        }
        settings["count"] = 2
        return config
    if setting == "multicrop":
        kept = {key: value for key, value in settings.items() if key not in ("count", "crop_strength", "grids")}
        data["views"] = {
            "class_path": "hfmca_lightning.data.MultiCrop",
            "init_args": {"global_crops": 2, "local_crops": 6, **kept},
        }
        model["external_head"]["init_args"].update(grid_height=2, grid_width=4, noise_channels=0)
        return config
    count, grid, noise = SETTINGS[setting]
    settings["count"] = count
    model["external_head"]["init_args"].update(grid_height=grid, grid_width=grid, noise_channels=noise)
    return config


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--settings", nargs="+", default=["l4", "l9", "simclr"], choices=list(LABELS))
    parser.add_argument("--epochs", type=int, default=None, help="default: the config's max_epochs")
    parser.add_argument("--per-class", type=int, default=None, help="training images per class (default: the config's)")
    parser.add_argument("--limit-train-batches", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=None, help="default: the config's num_workers")
    parser.add_argument("--seed", type=int, default=None, help="default: the config's seed_everything")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    base = yaml.safe_load(Path(args.config).read_text())
    if args.seed is not None:  # the model's initialisation, the data order and the views all follow it
        base["seed_everything"] = base["data"]["init_args"]["seed"] = args.seed
    epochs = args.epochs or int(base["trainer"]["max_epochs"])
    if args.workers is not None:
        base["data"]["init_args"]["num_workers"] = args.workers
    limit = int(args.limit_train_batches) if args.limit_train_batches > 1 else args.limit_train_batches
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for setting in args.settings:
        config = {
            key: value
            for key, value in setting_config(base, setting, args.per_class).items()
            if key in ("seed_everything", "model", "data")
        }
        config["trainer"] = {"logger": False, "callbacks": [], "enable_progress_bar": False}
        cli = HFMCACLI(args=config, run=False)  # seeds from seed_everything
        start = time.perf_counter()
        measured = train_and_measure(
            cli.model, cli.datamodule, epochs, limit, k=200, linear_epochs=None, online_probe=False
        )
        seconds = [sum(measured.epoch_seconds[: i + 1]) for i in range(len(measured.epoch_seconds))]
        curves[setting] = (seconds, measured.knn_by_epoch)
        print(
            f"{LABELS[setting]}: {time.perf_counter() - start:.0f} s; kNN top-1 by epoch "
            + ", ".join(f"{100 * a:.1f} ({s:.0f} s)" for a, s in zip(measured.knn_by_epoch, seconds)),
            flush=True,
        )
    hfmca = [curves[s][0][-1] for s in curves if s != "simclr"]
    budget = min(hfmca) if hfmca else min(curve[0][-1] for curve in curves.values())
    rows = []
    for setting, (seconds, knn) in curves.items():
        within = [a for a, s in zip(knn, seconds) if s <= budget * 1.02]
        rows.append(
            [
                LABELS[setting],
                f"{100 * knn[-1]:.1f}",
                f"{seconds[-1]:.0f} s",
                f"{100 * max(within):.1f}" if within else "-",
                ", ".join(f"{100 * a:.0f}" for a in knn),
            ]
        )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    header = [
        "Setting",
        "kNN top-1 (final)",
        "Training time",
        f"Best kNN top-1 within {budget:.0f} s",
        "kNN top-1 per epoch",
    ]
    table = (
        f"{Path(args.config).name}, {epochs} epochs each, seed {base.get('seed_everything')}, {device}\n\n"
        + markdown_table(header, rows)
    )
    write_table(table, args.out)
    return table


if __name__ == "__main__":
    main()
