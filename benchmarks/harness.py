"""Paper Table 1 as a harness: train methods for epoch budgets, write kNN top-1 / time / memory / speed.

    python benchmarks/harness.py --data cifar10 --epochs 20 200 800 --out results/table1_cifar10.md   # GPU
    python benchmarks/harness.py --data synthetic --backbone small --epochs 1 2 --head-dim 64 \\
        --batch-size 32 --limit-train-batches 4 --methods hfmca simclr fastsiam                      # CPU, ~1 min

Protocol (``--protocol separate``, the default): the lightly benchmarks' protocol that the paper cites. Every
budget column is its own run: a fresh model trained for that many epochs with its own cosine schedule over
those epochs; the cell is the best kNN top-1 / online linear top-1 of that run (lightly reports the maximum
over the run). The offline linear column is a linear classifier trained on the final frozen features of the
largest budget's run (``hfmca linear``'s protocol, ``--linear-epochs``); wall time, peak memory and views/s
are that run's. A second table lists every run with the epochs it trained and the length of its schedule.

``--protocol single-run`` (cheaper, *not* the paper's protocol): one run over the largest budget, each column
the best value up to that epoch of the one cosine schedule over max(--epochs).

Every method uses the same backbone, data module, optimiser (SGD 0.06, momentum 0.9, wd 5e-4, cosine) and
kNN protocol (k = 200, t = 0.1, 512-d backbone output for ResNet-18). ``hfmca`` is HFMCA-SS(*) (external cost
only), ``hfmca_internal`` HFMCA-SS (plus internal costs on every residual block).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DISPLAY,
    VIEW_GRIDS,
    Measurement,
    add_training_arguments,
    build_data,
    build_method,
    markdown_table,
    train_and_measure,
    train_batch_limit,
    views_of,
    write_table,
)

PROTOCOLS = ("separate", "single-run")


def measure(method: str, args: argparse.Namespace, epochs: int, linear_epochs: int | None) -> Measurement:
    """Train a fresh ``method`` (seeded) for ``epochs`` epochs, with its cosine schedule over those epochs."""
    torch.manual_seed(args.seed)
    views = views_of(method, args.hfmca_views)
    module = build_method(method, args.backbone, args.hfmca_views, args.head_dim)
    data = build_data(
        args.data, args.root, views, args.batch_size, args.workers, args.per_class, view_grids=VIEW_GRIDS.get(method, 0)
    )
    return train_and_measure(
        module, data, epochs, train_batch_limit(args.limit_train_batches), args.knn_k, linear_epochs=linear_epochs
    )


def run_row(measured: Measurement) -> list[str]:
    """The columns of the runs table after method and budget."""
    schedule = f"cosine over {measured.schedule_length} {measured.schedule_interval}s"
    rates = measured.learning_rates
    return [
        str(len(measured.epoch_seconds)),
        schedule,
        f"{rates[0]:.3g} -> {rates[-1]:.3g}",
        f"{100 * measured.best_knn:.1f}",
        f"{measured.wall_seconds / 60:.1f} min",
    ]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(DISPLAY), choices=list(DISPLAY))
    parser.add_argument("--epochs", nargs="+", type=int, default=[20, 200, 800], help="the epoch budgets (columns)")
    parser.add_argument(
        "--protocol",
        default="separate",
        choices=PROTOCOLS,
        help="separate: one run per budget (the paper's); single-run: one run, best value up to each budget",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_training_arguments(parser, "separate: trains each method once per budget; single-run: once for max(--epochs).")
    args = parser.parse_args(argv)
    budgets = sorted(set(args.epochs))
    largest = budgets[-1]
    rows, run_rows = [], []
    for method in args.methods:
        if args.protocol == "separate":
            runs = {e: measure(method, args, e, args.linear_epochs if e == largest else None) for e in budgets}
            cells = [
                f"{100 * runs[e].best_knn:.1f} / {100 * max(runs[e].linear_by_epoch, default=float('nan')):.1f}"
                for e in budgets
            ]
            run_rows += [[DISPLAY[method], str(e), *run_row(runs[e])] for e in budgets]
            final = runs[largest]
        else:
            final = measure(method, args, largest, args.linear_epochs)
            cells = [f"{100 * final.knn_at(e):.1f} / {100 * final.linear_at(e):.1f}" for e in budgets]
            run_rows.append([DISPLAY[method], f"{largest} (columns: best up to each budget)", *run_row(final)])
        speed = final.views_seen / max(final.train_seconds, 1e-9)
        rows.append(
            [
                DISPLAY[method],
                str(views_of(method, args.hfmca_views)),
                *cells,
                f"{100 * final.offline_linear:.1f}",
                f"{final.wall_seconds / 60:.1f} min",
                final.peak_memory,
                f"{speed:,.0f}",
            ]
        )
        print(
            f"{DISPLAY[method]}: kNN / online linear top-1 per budget {cells}, offline linear "
            f"{100 * final.offline_linear:.1f}",
            flush=True,
        )
    if args.protocol == "separate":
        protocol = "one run per budget, each with its cosine schedule over its budget; cells: best of that run"
        column = "kNN / linear top-1, {e}-epoch run"
    else:
        protocol = (
            f"single run (not the paper's protocol): one {largest}-epoch cosine schedule; cells: best up to the epoch"
        )
        column = "kNN / linear top-1 @ epoch {e}"
    header = [
        "Method",
        "Views",
        *(column.format(e=e) for e in budgets),
        f"Linear top-1 (offline, {largest}-epoch run)",
        "Wall time",
        "Peak memory",
        "Views/s",
    ]
    hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    runs_header = [
        "Method",
        "Budget (epochs)",
        "Epochs trained",
        "Schedule",
        "Learning rate start -> end",
        "Best kNN top-1",
        "Wall time",
    ]
    table = (
        f"{args.data}, backbone {args.backbone}, batch {args.batch_size}, {hardware}; protocol: {protocol}\n\n"
        + markdown_table(header, rows)
        + "\n\nRuns\n\n"
        + markdown_table(runs_header, run_rows)
    )
    write_table(table, args.out)
    return table


if __name__ == "__main__":
    main()
