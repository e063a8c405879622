"""GPU time you can see on a CPU: a kernel-level roofline of one training step (benchmarks/kernel_trace).

    python benchmarks/roofline.py --config configs/cifar10_ss_internal.yaml --gpu h100-sxm
    python benchmarks/roofline.py --config configs/cifar10_ss.yaml --gpu h200 --top 20
    python benchmarks/roofline.py --rows --gpu h200                     # the step rows of make gpu-check
    python benchmarks/roofline.py --precisions --config configs/cifar10_ss_internal.yaml  # what `auto` chooses
    python benchmarks/roofline.py --calibrate --code /tmp/code-9fe80ea   # fit the constants on the H200 report
    python benchmarks/roofline.py --calibrate --report docs/benchmarks/gpu-<device>.md --commit <its commit> --code .

Runs one whole training step of a config (forward, backward, optimizer step, the callbacks' per-step work, the data
transfer and the views a device drawer draws) through Lightning's Trainer on fake tensors: no arithmetic, seconds
on a CPU, and the code takes the branches it takes on the modelled CUDA GPU (its compute capability, the precision
and memory format of the run). Every ATen operation that launches a kernel is recorded with its FLOPs, bytes, dtype,
tensor-core eligibility and source line, and predicted to take ``max(FLOPs / peak, bytes / bandwidth)`` at the fitted
fraction of the GPU's published peak rates, plus a launch floor per kernel (kernel_trace/gpus.py gives the rates,
their sources and the fitted constants). Prints the step's kernels, GB moved, TFLOP and predicted milliseconds by
phase (backbone, external cost, each block's internal costs, the cost path, optimizer, callbacks, data), the GPU
targets, and the operations costing most with their source lines. Every number printed is a prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EPOCH_IMAGES = 50_000
# The report the shipped constants are fitted on, and the commit whose code it measured.
CALIBRATION_REPORT = ROOT / "docs" / "benchmarks" / "gpu-nvidia-h200.md"
CALIBRATION_COMMIT = "9fe80ea"


def _use_code(code: Path | None) -> None:
    """Import ``hfmca_lightning`` and the benchmark helpers from the checkout ``code`` (an older commit, for
    calibration), else from this one."""
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [path for path in sys.path if path not in ("", here)]
    sys.path.insert(0, here)
    import kernel_trace  # noqa: F401  # always from this checkout, whatever the other one's benchmarks hold

    roots = [code, code / "benchmarks"] if code is not None else [ROOT, ROOT / "benchmarks"]
    sys.path[:0] = [str(path) for path in roots]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", type=Path, help="a training config (configs/*.yaml)")
    what.add_argument("--rows", action="store_true", help="the training-step rows of make gpu-check")
    what.add_argument("--calibrate", action="store_true", help="fit the constants on a make gpu-check report's rows")
    parser.add_argument(
        "--precisions", action="store_true", help="with --config: its internal statistics in each precision, per GPU"
    )
    parser.add_argument("--gpu", default="h100-sxm", help="h100-sxm, h100-pcie, h200, a100, l4")
    parser.add_argument("--code", type=Path, help="trace the code of this checkout (for --rows, --calibrate)")
    parser.add_argument("--report", type=Path, default=CALIBRATION_REPORT, help="the report --calibrate fits on")
    parser.add_argument("--commit", default=CALIBRATION_COMMIT, help="the commit whose code --report measured")
    parser.add_argument("--top", type=int, default=12, help="operations listed by cost")
    parser.add_argument("--epoch-images", type=int, default=EPOCH_IMAGES, help="images per epoch (targets)")
    parser.add_argument("--json", type=Path, help="also write the predictions as JSON here")
    rows = parser.add_argument_group("the step rows (--rows), as make gpu-check sizes them")
    rows.add_argument("--backbone", choices=["resnet18", "small"], default="resnet18")
    rows.add_argument("--batch-size", type=int, default=64)
    rows.add_argument("--views", type=int, default=9, choices=[4, 9, 16])
    rows.add_argument("--image-size", type=int, default=32)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _use_code(args.code)
    from kernel_trace.gpus import GPUS

    problem = input_problem(args, GPUS)
    if problem is not None:
        print(f"roofline: {problem}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    if args.precisions:
        result = precisions_report(args.config)
    elif args.config is not None:
        result = config_report(args.config, args.gpu, args.top, args.epoch_images)
    elif args.rows:
        sizes = {"backbone": args.backbone, "batch_size": args.batch_size, "views": args.views}
        result = rows_report(args.gpu, {**sizes, "image_size": args.image_size})
    else:
        result = calibration_report(args.report, args.commit)
    print("\n".join(result["lines"]))
    print(f"\n(traced on this CPU in {time.perf_counter() - began:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(result["data"], indent=1))
    return 0


def input_problem(args: argparse.Namespace, gpus: dict[str, Any]) -> str | None:
    """What is wrong with the command line, in one line, before anything is traced; None when nothing is."""
    if args.gpu not in gpus:
        return f"unknown --gpu {args.gpu!r}; one of {', '.join(gpus)}"
    if args.config is not None and not args.config.is_file():
        return f"--config {args.config} is not a file"
    if args.precisions:
        from kernel_trace.targets import has_internal_costs

        if args.config is None or not has_internal_costs(args.config):
            return "--precisions needs --config with internal costs (model.init_args.internal_costs)"
    if args.code is not None and not (args.code / "hfmca_lightning").is_dir():
        return f"--code {args.code} is not a checkout of this project (no hfmca_lightning/ in it)"
    if args.calibrate:
        if not args.report.is_file():
            return f"--report {args.report} is not a file"
        if args.code is None:
            return (
                f"--calibrate needs --code: a checkout of the commit {args.commit} that {args.report.name} measured "
                f"(git worktree add /tmp/code-{args.commit} {args.commit})"
            )
        head = subprocess.run(
            ["git", "-C", str(args.code), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        if not head.startswith(args.commit):
            return (
                f"--code {args.code} is at {head[:7] or 'no git commit'}, not at {args.commit}, the commit "
                f"{args.report.name} measured; give a checkout of {args.commit}, or --commit"
            )
        changed = subprocess.run(
            ["git", "-C", str(args.code), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if changed:
            return (
                f"--code {args.code} has changes not committed at {args.commit}: give a clean checkout "
                f"(git worktree add /tmp/code-{args.commit} {args.commit})"
            )
    return None


def config_report(config: Path, gpu_name: str, top: int, epoch_images: int) -> dict[str, Any]:
    """The config's step, and the same step without internal costs (the external row), on one GPU."""
    from kernel_trace.gpus import CALIBRATION, GPUS
    from kernel_trace.predict import predict
    from kernel_trace.report import hot_spot_table, phase_table, summary_line
    from kernel_trace.steps import trace_config
    from kernel_trace.targets import batch_size, config_targets, has_internal_costs

    gpu = GPUS[gpu_name]
    full = predict(trace_config(config, gpu), top=top)
    external = predict(trace_config(config, gpu, drop_internal=True), top=top) if has_internal_costs(config) else full
    lines = [
        f"# Roofline of {config} on the {gpu.name} (predicted)",
        "",
        f"Calibration: {CALIBRATION.efficiency:.0%} of peak rates, launch floor "
        f"{CALIBRATION.launch_floor * 1e6:.1f} us per kernel ({CALIBRATION.fitted_on}). Peak rates: {gpu.source}.",
        "",
        summary_line("step", full),
    ]
    if external is not full:
        lines.append(summary_line("same step without internal costs", external))
    lines += ["", *phase_table(full), ""]
    targets, target_lines = config_targets(full, external, epoch_images, batch_size(config))
    lines += target_lines
    lines += ["", f"Costliest operations (of {full.totals.kernels:,.0f} kernels):", "", *hot_spot_table(full)]
    if full.host_syncs:
        lines += ["", "Host syncs:", *(f"- {what} at {where}" for what, where in full.host_syncs)]
    data = {"gpu": gpu_name, "config": str(config), "targets": [asdict(target) for target in targets]}
    data["step_ms"] = full.milliseconds
    data["external_ms"] = external.milliseconds
    return {"lines": lines, "data": data}


# The internal statistics precisions compared, for bf16-mixed maps and for float32 maps (docs/conventions.md §3).
STATISTICS_PRECISIONS = {"bf16-mixed": ("fast", "tf32x3", "bf16"), "32-true": ("fast", "tf32x3")}


def precisions_report(config: Path) -> dict[str, Any]:
    """The milliseconds per step of the config's internal statistics (all hooked blocks) in each precision, on every
    modelled GPU: one trace per precision and map dtype, predicted on each GPU (what ``precision="auto"`` is chosen
    by)."""
    import copy

    import yaml
    from kernel_trace.gpus import GPUS
    from kernel_trace.predict import predict
    from kernel_trace.steps import trace_config

    internal_costs = yaml.safe_load(config.read_text())["model"]["init_args"]["internal_costs"]
    columns = [(maps, precision) for maps, precisions in STATISTICS_PRECISIONS.items() for precision in precisions]
    milliseconds: dict[str, dict[str, float]] = {key: {} for key in GPUS}
    for maps, precision in columns:
        costs = copy.deepcopy(internal_costs)
        costs.setdefault("init_args", {})["precision"] = precision
        trace = trace_config(
            config, GPUS["h100-sxm"], {"model": {"internal_costs": costs}, "trainer": {"precision": maps}}
        )
        for key, gpu in GPUS.items():
            prediction = predict(dataclasses.replace(trace, gpu=gpu))
            milliseconds[key][f"{maps} maps: {precision}"] = prediction.phase_milliseconds("internal/")
    names = list(milliseconds["h100-sxm"])
    lines = [
        f"# Internal statistics of {config} per precision (predicted ms per step, all blocks)",
        "",
        f"| GPU | {' | '.join(f'`{name}`' for name in names)} |",
        f"| --- |{' ---: |' * len(names)}",
        *(
            f"| {GPUS[key].name} | {' | '.join(f'{row[name]:.1f}' for name in names)} |"
            for key, row in milliseconds.items()
        ),
    ]
    return {"lines": lines, "data": milliseconds}


def rows_report(gpu_name: str, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    from kernel_trace.gpus import GPUS
    from kernel_trace.predict import predict
    from kernel_trace.steps import trace_rows_of_checkout

    gpu = GPUS[gpu_name]
    predictions = {name: predict(trace) for name, trace in trace_rows_of_checkout(gpu, **(sizes or {})).items()}
    fastest = min(p.milliseconds for name, p in predictions.items() if name.startswith("backbone alone"))
    lines = [
        f"# Step rows of make gpu-check on the {gpu.name} (predicted)",
        "",
        "| row | kernels | GB moved | TFLOP | predicted ms | vs fastest backbone row | host syncs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, prediction in predictions.items():
        total = prediction.totals
        lines.append(
            f"| {name} | {total.kernels:,.0f} | {total.bytes / 1e9:.1f} | {total.flops / 1e12:.2f} | "
            f"{prediction.milliseconds:.1f} | {prediction.milliseconds / fastest:.2f}x | "
            f"{prediction.host_syncs_per_step:g} |"
        )
    return {"lines": lines, "data": {name: p.milliseconds for name, p in predictions.items()}}


def calibration_report(report: Path, commit: str) -> dict[str, Any]:
    from kernel_trace.calibrate import calibration_lines

    try:
        lines, data = calibration_lines(report, commit)
    except ValueError as error:
        raise SystemExit(f"roofline: {error}") from None
    return {"lines": lines, "data": data}


if __name__ == "__main__":
    raise SystemExit(main())
