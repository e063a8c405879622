"""What the label-free health callback (:class:`~hfmca_lightning.callbacks.HealthMetrics`) costs a training run at
its shipped setting (``every_n_steps=100``, ``samples_per_dim=2``), as a fraction of the training step, measured in
one run on this machine.

    python benchmarks/health_cost.py                                     # configs/demo.yaml's model and data
    python benchmarks/health_cost.py --config configs/baselines/simclr_cifar10.yaml --data-config configs/demo.yaml
                                         # a baseline, hooked: its ResNet-18 wants a GPU (hours on a 2-core CPU)

One Trainer trains the config's model on its data (no other callback, no logger, no validation) in blocks of
``every_n_steps`` optimiser steps that end on the callback's logged steps. After a few warm-up steps, the first block
runs the callback fresh (it learns its window from its first step, then sums the window before the block's last
step and logs); the blocks after it alternate without and with the callback (off, on, off, on, ..., off), so that a
machine drifting slowly moves both alike. A step is timed from the first callback's ``on_train_batch_start`` to the
last one's ``on_train_batch_end`` (forward, backward, optimiser, the callback's hooks; not the data loading around
it). The script prints:

* the per-step overhead ratio, with / without the callback - 1: each step of a with-block against the same step of
  the without-blocks either side, the median of those differences over the with-blocks per step position (robust to
  a burst of another process in one block), summed over the block; in wall-clock time and in the training process's
  CPU time; and each whole with-block's mean step against its neighbours' (where such bursts show);
* the callback's own time in its hooks, split into the steps it sums (one summed step), the step that logs (one log:
  that step's sums, the eigendecompositions and ``pl_module.log``) and the steps it only checks, and the
  eigendecompositions alone (``HealthStatistics.metrics`` on the last window's sums, repeated);
* the same as a fraction of the training step: the callback's own time per step at its interval.

``--tiny`` runs a few steps of a small copy (the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TRAINING_ONLY, machine  # noqa: E402

from hfmca_lightning.analysis.health import HealthStatistics  # noqa: E402
from hfmca_lightning.callbacks import HealthMetrics  # noqa: E402
from hfmca_lightning.cli.trainer_cli import HFMCACLI  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.02  # the callback may add at most 2 % to a training step at its shipped interval


def run_config(config_path: str, data_config: str | None, overrides: argparse.Namespace) -> dict[str, Any]:
    """``seed_everything``, ``model`` and ``data`` of ``config_path`` (the data of ``data_config`` where given, with
    the model config's view count), with the command line's data overrides."""
    config = yaml.safe_load(Path(config_path).read_text())
    chosen = {key: copy.deepcopy(config[key]) for key in ("seed_everything", "model", "data") if key in config}
    if data_config:
        data = copy.deepcopy(yaml.safe_load(Path(data_config).read_text())["data"])
        count = config["data"]["init_args"].get("views", {}).get("init_args", {}).get("count")
        if count is not None:
            data["init_args"]["views"].setdefault("init_args", {})["count"] = count
        chosen["data"] = data
    data = chosen["data"]["init_args"]
    if overrides.batch_size is not None:
        data["batch_size"] = overrides.batch_size
    if overrides.workers is not None:
        data["num_workers"] = overrides.workers
    if overrides.per_class is not None:
        data["source"]["init_args"]["train_per_class"] = overrides.per_class
    chosen["trainer"] = {"logger": False, "callbacks": [], "enable_progress_bar": False}
    return chosen


class CountedHealth(HealthMetrics):
    """The shipped callback, counting its logs (to tell a logged step from a summed one) and keeping the sums of its
    last estimate (to time the eigendecompositions alone)."""

    logs = 0
    last_window: HealthStatistics | None = None

    def _reduced(self, trainer: Trainer) -> HealthStatistics:
        self.last_window = super()._reduced(trainer)
        return self.last_window

    def _log(self, *args: Any, **kwargs: Any) -> None:
        self.logs += 1
        super()._log(*args, **kwargs)


class StepStart(Callback):
    """First in the list: a step starts at its first ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.started, self.started_cpu = 0.0, 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.started, self.started_cpu = time.perf_counter(), time.process_time()


class StepEnd(Callback):
    """Last in the list: a step ends at its last ``on_train_batch_end``; its wall-clock and CPU seconds (the training
    process's, all its threads) go to its block."""

    def __init__(self, start: StepStart, block_of: Callable[[int], int]) -> None:
        self.start, self.block_of = start, block_of
        self.seconds: dict[int, list[float]] = {}
        self.cpu_seconds: dict[int, list[float]] = {}

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        wall, cpu = time.perf_counter() - self.start.started, time.process_time() - self.start.started_cpu
        block = self.block_of(trainer.global_step)
        self.seconds.setdefault(block, []).append(wall)
        self.cpu_seconds.setdefault(block, []).append(cpu)


class Gate(Callback):
    """Calls the health callback's hooks in the blocks where it is on, and times them: each step's hook time goes to
    ``log`` (it logged), ``summed`` (it added the step's embeddings) or ``idle`` (it only checked the step)."""

    def __init__(self, health: CountedHealth, on: Callable[[int], bool], block_of: Callable[[int], int]) -> None:
        self.health, self.on, self.block_of = health, on, block_of
        self.active, self.begin = False, 0.0
        self.hooks: dict[int, dict[str, list[float]]] = {}
        self.first_log_samples: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.health.on_train_start(trainer, pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.active = self.on(trainer.global_step + 1)
        if self.active:
            start = time.perf_counter()
            self.health.on_train_batch_start(trainer, pl_module, batch, batch_idx)
            self.begin = time.perf_counter() - start

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.active:
            return
        sums, logs = self.health.sums, self.health.logs
        start = time.perf_counter()
        self.health.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        seconds = self.begin + time.perf_counter() - start
        kind = "log" if self.health.logs > logs else "summed" if self.health.sums is not sums else "idle"
        if kind == "log" and self.first_log_samples is None:
            self.first_log_samples = float(trainer.callback_metrics["health/samples"])
        self.hooks.setdefault(self.block_of(trainer.global_step), {}).setdefault(kind, []).append(seconds)


def with_without_ratios(seconds: dict[int, list[float]], blocks: int) -> list[float]:
    """Each with-block's (even) mean step time over the mean of the without-blocks (odd) either side, minus 1."""
    mean = {block: statistics.mean(seconds[block]) for block in range(1, blocks + 1)}
    return [mean[block] / ((mean[block - 1] + mean[block + 1]) / 2) - 1 for block in range(2, blocks + 1, 2)]


def matched_overhead(seconds: dict[int, list[float]], blocks: int) -> float:
    """The extra time of a with-block over its without-blocks, step by step, robust to bursts of other processes:
    for each step position of a block, the median over the with-blocks of that step's time minus the mean of the same
    step of the without-blocks either side; summed over the positions, over the block's steps times the median step
    of the without-blocks."""
    extra = 0.0
    for position in range(len(seconds[1])):
        extra += statistics.median(
            seconds[block][position] - (seconds[block - 1][position] + seconds[block + 1][position]) / 2
            for block in range(2, blocks + 1, 2)
        )
    step = statistics.median(value for block in range(1, blocks + 1, 2) for value in seconds[block])
    return extra / (len(seconds[1]) * step)


def median_ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.3f} ms" if values else "-"


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="the model (and data)")
    parser.add_argument("--data-config", default=None, help="take the data from this config (the model's view count)")
    parser.add_argument("--every-n-steps", type=int, default=100, help="the callback's interval (shipped: 100)")
    parser.add_argument("--samples-per-dim", type=int, default=2, help="the callback's window (shipped: 2)")
    parser.add_argument("--pairs", type=int, default=5, help="with-blocks, each between two without-blocks")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the config's")
    parser.add_argument("--workers", type=int, default=None, help="default: the config's num_workers")
    parser.add_argument("--per-class", type=int, default=None, help="SyntheticShapes training images per class")
    parser.add_argument("--repeats", type=int, default=50, help="of HealthStatistics.metrics timed alone")
    parser.add_argument("--tiny", action="store_true", help="a few steps of a small copy (smoke test)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.every_n_steps, args.samples_per_dim, args.pairs, args.warmup, args.repeats = 4, 1, 1, 1, 3
        args.batch_size, args.workers, args.per_class = 16, 0, 4
    every, warmup = args.every_n_steps, args.warmup
    if not 0 < warmup < every:
        parser.error("--warmup must be between 1 and --every-n-steps - 1")

    config = run_config(args.config, args.data_config, args)
    if args.tiny:  # a narrower backbone where the config's is a SmallConvNet with a ViewProjector (the demo's)
        model = config["model"]["init_args"]
        if model.get("backbone", {}).get("class_path", "").endswith("SmallConvNet"):
            model["backbone"].setdefault("init_args", {})["width"] = 8
            stages = model["backbone"]["init_args"].get("num_stages", 3)
            if "projector" in model:
                model["projector"]["init_args"]["input_dim"] = 8 * 2 ** (stages - 1)
    cli = HFMCACLI(args=config, run=False)  # seeds from seed_everything
    module, data = cli.model, cli.datamodule

    # blocks of `every` steps ending on the callback's logged steps: block 0 the warm-up and the first interval,
    # then blocks 1, 2, ... alternate without (odd) and with (even) the callback, ending without
    blocks = 2 * args.pairs + 1

    def block_of(step: int) -> int:
        return (step - 1) // every  # step counted from 1: block b holds steps b * every + 1 .. (b + 1) * every

    def on(step: int) -> bool:
        block = block_of(step)
        return (block == 0 and step > warmup) or (block > 0 and block % 2 == 0)

    health = CountedHealth(every_n_steps=every, samples_per_dim=args.samples_per_dim)
    start = StepStart()
    gate = Gate(health, on, block_of)
    end = StepEnd(start, block_of)
    trainer = Trainer(max_steps=(blocks + 1) * every, accelerator="auto", callbacks=[start, gate, end], **TRAINING_ONLY)
    load = os.getloadavg()[0]
    began = time.perf_counter()
    trainer.fit(module, data)
    wall = time.perf_counter() - began

    ratios = with_without_ratios(end.seconds, blocks)
    cpu_ratios = with_without_ratios(end.cpu_seconds, blocks)
    without = range(1, blocks + 1, 2)
    step = statistics.median([seconds for block in without for seconds in end.seconds[block]])
    steady = [gate.hooks.get(block, {}) for block in range(2, blocks + 1, 2)]
    kinds = {kind: [s for hooks in steady for s in hooks.get(kind, [])] for kind in ("summed", "log", "idle")}
    own = statistics.mean(sum(sum(times) for times in hooks.values()) / every for hooks in steady)
    first = gate.hooks.get(0, {})
    first_steps = every - warmup
    first_own = sum(sum(times) for times in first.values()) / first_steps
    first_step = statistics.median(end.seconds[0][warmup:])

    sums = health.last_window  # the sums of the last logged estimate, timed alone
    if sums is None:
        raise RuntimeError("the callback logged no estimate; give it more steps (--every-n-steps)")
    sums.metrics()
    timed = []
    for _ in range(args.repeats):
        began_metrics = time.perf_counter()
        sums.metrics()
        timed.append(time.perf_counter() - began_metrics)
    metrics_seconds = statistics.median(timed)

    name = Path(args.config).name + (f" (data: {Path(args.data_config).name})" if args.data_config else "")
    dim, images, window = int(sums.first_sum.shape[0]), data.batch_size, health.window_steps or 0
    summed = statistics.median(kinds["summed"]) if kinds["summed"] else float("nan")
    logged = statistics.median(kinds["log"]) if kinds["log"] else float("nan")
    overhead, cpu_overhead = matched_overhead(end.seconds, blocks), matched_overhead(end.cpu_seconds, blocks)
    lines = [
        f"HealthMetrics(every_n_steps={every}, samples_per_dim={args.samples_per_dim}) on {name}: "
        f"{type(module).__name__}, {images} images x {sums.views} views per step, D = {dim}",
        f"measured on {machine()}, torch {torch.__version__}; {trainer.global_step} steps in {wall:.0f} s; load "
        f"average {load:.1f} before, {os.getloadavg()[0]:.1f} after (other processes slow every row)",
        f"training step without the callback: {1000 * step:.1f} ms (median of {len(without) * every} steps)",
        f"window: {window} summed step(s) before each logged step ({window * images} samples >= "
        f"{args.samples_per_dim} x {dim})",
        f"one summed step: {1000 * summed:.3f} ms in the callback ({summed / step:.3%} of a step)",
        f"one log: {1000 * logged:.3f} ms in the callback ({logged / step:.3%} of a step); its eigendecompositions "
        f"alone (HealthStatistics.metrics, median of {args.repeats}): {1000 * metrics_seconds:.3f} ms",
        f"a step it only checks: {median_ms(kinds['idle'])}",
        f"the callback's own time per step at its interval: {own / step:.3%} of a step",
        f"the first block, with a fresh callback ({first_steps} steps, {len(first.get('log', []))} logs, the first "
        f"of {gate.first_log_samples or 0:.0f} samples): its own time {first_own / first_step:.3%} of a step; its "
        f"logs {', '.join(f'{1000 * s:.1f}' for s in first.get('log', []))} ms",
        f"per-step overhead ratio, wall clock (with / without - 1, {len(ratios)} with-blocks of {every} steps, each "
        f"step against the same step of the without-blocks either side, median per step): {overhead:+.2%}",
        f"per-step overhead ratio, CPU time of the training process (the same steps): {cpu_overhead:+.2%}",
        f"whole with-blocks against the without-blocks either side (mean step times; bursts of other processes "
        f"show here): wall clock {', '.join(f'{r:+.1%}' for r in ratios)}; CPU time "
        f"{', '.join(f'{r:+.1%}' for r in cpu_ratios)}",
        f"target <= {TARGET:.0%}: {'met' if overhead <= TARGET else 'not met'} (wall clock), "
        f"{'met' if cpu_overhead <= TARGET else 'not met'} (CPU time)",
    ]
    print("\n".join(lines), flush=True)
    return {
        "overhead": overhead,
        "cpu_overhead": cpu_overhead,
        "own": own / step,
        "step": step,
        "summed": summed,
        "log": logged,
        "metrics": metrics_seconds,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
