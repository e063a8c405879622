"""The paper's §5 spectrum study in one command: train the three supervision scenarios with the spectrum CNN, then
draw its figures and the table its text argues from.

    python benchmarks/spectrum_study.py --data cifar10 --out results/spectrum_study                     # GPU
    python benchmarks/spectrum_study.py --data synthetic --iterations 20 --channels 8 --hidden-dim 16 \\
        --noise-channels 2 --batch-size 8 --analysis-batches 10 --out results/spectrum_study_tiny        # CPU, ~1 min

Scenarios (``configs/spectrum_<scenario>.yaml``, the appendix's settings; each run's config is written beside it):

* ``unsupervised``: internal costs only (L1 .. L9);
* ``supervised``: groups of ``L`` images of one class, LF and internal costs;
* ``selfsupervised``: ``L`` augmented views of one image, LF and internal costs.

Outputs under ``--out``: each run's folder (checkpoints, logs, the callback figures, ``analysis/`` from ``hfmca
analyze``), and

* ``cross_layer_spectra.png``: per scenario, the eigenvalues of every pair L1 .. L9, LF (after the constant
  function's), with the mean of the 10 largest as a line (paper Fig. 4);
* ``cross_scenario_spectra.png``: per pair of scenarios, the eigenvalues between their features at each layer
  (``hfmca compare``; paper Fig. 5);
* ``learning_dynamics_<scenario>.png``: the top-20 eigenvalues of every pair over training (appendix figure);
* ``table.md``: per scenario and pair, the count of eigenvalues below 0.1 and above 0.5 and the mean of the 10
  largest, the numbers the paper's text argues from (printed too).

``--data``: ``cifar10``, ``cifar100`` (under ``--root``), ``synthetic`` (SyntheticShapes) or a folder in
torchvision's ImageFolder layout (``<folder>/{train,test}/<class>/``), all at 32 px. ``--iterations``: training
steps per scenario (the paper: 50,000). ``--channels``, ``--hidden-dim``, ``--noise-channels`` and ``--batch-size``
shrink the network and batch for CPU runs only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from hfmca_lightning.cli import main as hfmca
from hfmca_lightning.cli.analyze import analyze, compare
from hfmca_lightning.visualization import layer_spectra_panels, learning_dynamics_figure, save_figure

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("unsupervised", "supervised", "selfsupervised")
COMPARISONS = (("supervised", "unsupervised"), ("supervised", "selfsupervised"), ("unsupervised", "selfsupervised"))


def source_config(data: str, root: str) -> dict[str, Any]:
    """The data source of ``--data``."""
    if data in ("cifar10", "cifar100"):
        return {"class_path": "hfmca_lightning.data.CIFAR", "init_args": {"name": data, "root": root, "download": True}}
    if data == "synthetic":
        return {
            "class_path": "hfmca_lightning.data.SyntheticShapes",
            "init_args": {"num_classes": 10, "train_per_class": 200, "test_per_class": 50, "image_size": 32},
        }
    if Path(data).is_dir():
        return {"class_path": "hfmca_lightning.data.ImageFolderSource", "init_args": {"root": data, "image_size": 32}}
    raise SystemExit(f"--data must be cifar10, cifar100, synthetic or an ImageFolder folder; got {data!r}")


def scenario_config(scenario: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``configs/spectrum_<scenario>.yaml`` with its outputs under ``folder``, the chosen data and iterations, and
    (only when asked) a smaller network and batch."""
    config = yaml.safe_load((REPO / "configs" / f"spectrum_{scenario}.yaml").read_text())
    trainer = config["trainer"]
    trainer["max_steps"] = args.iterations
    loggers = trainer["logger"] if isinstance(trainer["logger"], list) else [trainer["logger"]]
    for logger in loggers:
        logger["init_args"]["save_dir"] = str(folder)
    if args.csv_only:
        trainer["logger"] = [logger for logger in loggers if logger["class_path"].endswith("CSVLogger")]
    for callback in trainer["callbacks"]:
        init = callback.setdefault("init_args", {})
        if "dirpath" in init:
            init["dirpath"] = str(folder / "checkpoints")
            init["every_n_train_steps"] = max(1, args.iterations // 10)
        if callback["class_path"].endswith("EigenspectrumCallback"):
            init["every_n_steps"] = max(1, args.iterations // 200)  # ~200 columns of learning dynamics
    data = config["data"]["init_args"]
    data["source"] = source_config(args.data, args.root)
    data["num_workers"] = args.workers
    if args.batch_size:
        data["batch_size"] = args.batch_size
    model = config["model"]["init_args"]
    small = {
        key: value
        for key, value in (
            ("channels", args.channels),
            ("hidden_dim", args.hidden_dim),
            ("noise_channels", args.noise_channels),
        )
        if value is not None
    }
    model["backbone"].setdefault("init_args", {}).update(small)
    if model.get("external_head"):
        head = model["external_head"]["init_args"]
        head.update({"feature_dim": small.get("channels", head["feature_dim"])})
        head.update({key: small[key] for key in ("hidden_dim", "noise_channels") if key in small})
    return config


def train(scenario: str, args: argparse.Namespace) -> Path:
    """One scenario's run; returns its last checkpoint."""
    folder = Path(args.out) / scenario
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(scenario_config(scenario, folder, args), sort_keys=False))
    hfmca(["fit", "--config", str(path)])
    return folder / "checkpoints" / "last.ckpt"


def spectrum_table(summaries: dict[str, dict[str, dict]]) -> str:
    """Markdown: one row per pair, per scenario the count of eigenvalues < 0.1, > 0.5 and the mean of the top 10."""
    pairs = list(dict.fromkeys(name for summary in summaries.values() for name in summary))
    header = "| pair | " + " | ".join(f"{s}: < 0.1 | {s}: > 0.5 | {s}: top-10 mean" for s in summaries) + " |"
    lines = [header, "| --- |" + " ---: |" * (3 * len(summaries))]
    for pair in pairs:
        cells = []
        for summary in summaries.values():
            if pair not in summary:
                cells += ["", "", ""]
                continue
            values = np.asarray(summary[pair]["eigenvalues"])
            cells += [str(int((values < 0.1).sum())), str(int((values > 0.5).sum())), f"{values[:10].mean():.3f}"]
        lines.append(f"| {pair} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spectrum_history(checkpoint: Path) -> dict[str, tuple[list[int], np.ndarray]]:
    """The EigenspectrumCallback's history kept in a checkpoint: ``{pair: (steps, top eigenvalues (T, k))}``."""
    states = torch.load(checkpoint, map_location="cpu", weights_only=True).get("callbacks", {})
    (state,) = [value for key, value in states.items() if "EigenspectrumCallback" in key]
    history = {}
    for name, entries in state["history"].items():
        width = max(len(values) for _, values in entries)
        rows = [values + [float("nan")] * (width - len(values)) for _, values in entries]
        history[name] = ([step for step, _ in entries], np.array(rows))
    return history


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="cifar10", help="cifar10, cifar100, synthetic or an ImageFolder folder")
    parser.add_argument("--root", default="data", help="where CIFAR is (or is downloaded to)")
    parser.add_argument("--iterations", type=int, default=50_000, help="training steps per scenario (paper: 50,000)")
    parser.add_argument("--out", default="results/spectrum_study")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--channels", type=int, default=None, help="CPU runs: map channels (paper: 64)")
    parser.add_argument("--hidden-dim", type=int, default=None, help="CPU runs: hidden channels (paper: 200)")
    parser.add_argument("--noise-channels", type=int, default=None, help="CPU runs: noise channels (paper: 20)")
    parser.add_argument("--batch-size", type=int, default=None, help="CPU runs: images per batch (paper: 32)")
    parser.add_argument("--csv-only", action="store_true", help="log to metrics.csv only, without W&B")
    parser.add_argument(
        "--analysis-batches",
        type=int,
        default=None,
        help="batches for the final spectra (default: enough for 100 groups per feature in every pair)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    checkpoints = {scenario: train(scenario, args) for scenario in args.scenarios}

    summaries = {}
    for scenario, checkpoint in checkpoints.items():
        analyze(checkpoint, out / scenario / "analysis", num_batches=args.analysis_batches, num_images=9)
        summaries[scenario] = json.loads((out / scenario / "analysis" / "spectra.json").read_text())["pairs"]
        history = spectrum_history(checkpoint)
        save_figure(
            learning_dynamics_figure(history, title=f"Eigenvalue learning dynamics, {scenario}"),
            out / f"learning_dynamics_{scenario}.png",
        )
    save_figure(
        layer_spectra_panels(
            {s: {name: pair["eigenvalues"] for name, pair in summary.items()} for s, summary in summaries.items()},
            title="Spectrum across layers (after the constant function's eigenvalue)",
        ),
        out / "cross_layer_spectra.png",
    )
    crossed = {}
    for first, second in COMPARISONS:
        if first in checkpoints and second in checkpoints:
            folder = out / f"compare_{first}_{second}"
            compare(checkpoints[first], checkpoints[second], folder, num_batches=args.analysis_batches)
            pairs = json.loads((folder / "cross_spectra.json").read_text())["pairs"]
            crossed[f"{first} vs {second}"] = {name: pair["eigenvalues"] for name, pair in pairs.items()}
    if crossed:
        save_figure(
            layer_spectra_panels(crossed, title="Spectrum across scenarios"), out / "cross_scenario_spectra.png"
        )
    table = (
        f"Spectrum study on {args.data}, {args.iterations} iterations per scenario\n\n"
        + spectrum_table(summaries)
        + "\n"
    )
    (out / "table.md").write_text(table)
    print(table)
    return table


if __name__ == "__main__":
    main()
