"""Paper Table 1 as a harness: train methods for an epoch budget, write kNN top-1 / time / memory / speed.

    python benchmarks/harness.py --data cifar10 --epochs 20 200 800 --out results/table1_cifar10.md   # GPU
    python benchmarks/harness.py --data synthetic --backbone small --epochs 1 2 --head-dim 64 \\
        --batch-size 32 --limit-train-batches 4 --methods hfmca simclr fastsiam                      # CPU, ~1 min

kNN top-1 and the online linear probe's top-1 at epoch e are the best values up to e (the paper reports the
max over 20 / 200 / 800 epochs); the last accuracy column is a linear classifier trained on the final frozen
features (``hfmca linear``'s protocol, ``--linear-epochs``).
Every method uses the same backbone, data module, optimiser (SGD 0.06, momentum 0.9, wd 5e-4, cosine over
the largest budget) and kNN protocol (k = 200, t = 0.1, 512-d backbone output for ResNet-18).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DISPLAY,
    add_training_arguments,
    build_data,
    build_method,
    markdown_table,
    train_and_measure,
    train_batch_limit,
    views_of,
    write_table,
)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(DISPLAY), choices=list(DISPLAY))
    parser.add_argument("--epochs", nargs="+", type=int, default=[20, 200, 800], help="report kNN at these epochs")
    parser.add_argument("--seed", type=int, default=0)
    add_training_arguments(parser, "Trains each method for max(--epochs) epochs.")
    args = parser.parse_args(argv)
    budget = max(args.epochs)
    limit = train_batch_limit(args.limit_train_batches)
    rows = []
    for method in args.methods:
        torch.manual_seed(args.seed)
        views = views_of(method, args.hfmca_views)
        module = build_method(method, args.backbone, args.hfmca_views, args.head_dim)
        data = build_data(args.data, args.root, views, args.batch_size, args.workers, args.per_class)
        measured = train_and_measure(module, data, budget, limit, args.knn_k, linear_epochs=args.linear_epochs)
        accuracy = [f"{100 * measured.knn_at(e):.1f} / {100 * measured.linear_at(e):.1f}" for e in args.epochs]
        speed = measured.views_seen / max(measured.train_seconds, 1e-9)
        rows.append([DISPLAY[method], str(views), *accuracy, f"{100 * measured.offline_linear:.1f}", f"{measured.wall_seconds / 60:.1f} min", measured.peak_memory, f"{speed:,.0f}"])
        print(
            f"{DISPLAY[method]}: kNN top-1 by epoch {[round(100 * a, 1) for a in measured.knn_by_epoch]}, "
            f"online linear {[round(100 * a, 1) for a in measured.linear_by_epoch]}, offline linear {100 * measured.offline_linear:.1f}",
            flush=True,
        )
    header = ["Method", "Views", *(f"kNN / linear top-1 @ epoch {e}" for e in args.epochs), "Linear top-1 (offline, final)", "Wall time", "Peak memory", "Views/s"]
    hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    table = f"{args.data}, backbone {args.backbone}, batch {args.batch_size}, {hardware}\n\n" + markdown_table(header, rows)
    write_table(table, args.out)
    return table


if __name__ == "__main__":
    main()
