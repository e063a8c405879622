"""``make gpu-check``: the command line, the time budget and the order of the sections."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from step_timing import format_rows
from throughput import data_path_rows, data_paths

from gpu_check.predicted import gpu_key, predicted_rows
from gpu_check.report import device_slug, write_report
from gpu_check.results import CIFAR_EPOCH, EXTERNAL, INTERNAL, NEEDS, SECTIONS, GpuCheckResult, fastest, targets
from gpu_check.sections import (
    agreement,
    batches_that_fit,
    fastest_data_path,
    profile_steps,
    run_cuda_tests,
    step_rows,
    training_run,
)

ROOT = Path(__file__).resolve().parents[2]
GPUS_NAMES = {
    "h100-sxm": "H100 SXM",
    "h100-pcie": "H100 PCIe",
    "h200": "H200",
    "a100": "A100 SXM 80GB",
    "l4": "L4",
}
__doc__ = (Path(__file__).resolve().parent / "__init__.py").read_text().split('"""')[1]

NO_CUDA_MESSAGE = (
    "gpu_check: CUDA is not available here (torch {torch}, {build}). This check measures a GPU and never "
    "silently measures the CPU: run it on a machine with a CUDA GPU, or pass --device cpu --tiny to test the script."
)


def main(argv: list[str] | None = None) -> int:
    """The whole check; the process's torch thread count is as it was afterwards (the tiny test sets one thread)."""
    threads = torch.get_num_threads()
    try:
        return _check(argv)
    finally:
        torch.set_num_threads(threads)


def _check(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to test this script")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (with --device cpu: a test of the script)")
    parser.add_argument("--backbone", choices=["resnet18", "small"], default="resnet18")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--views", type=int, default=9, choices=[4, 9, 16])
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed rounds of the step rows")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--epochs", type=int, default=2, help="of each training run (the last one is timed)")
    parser.add_argument("--train-images", type=int, default=CIFAR_EPOCH)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    parser.add_argument(
        "--train-data",
        choices=["fastest", *data_paths(0)],
        default="fastest",
        help="the training runs' data path (default: the fastest of the data section, else the training set on "
        "the device)",
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    parser.add_argument("--out-dir", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument(
        "--time-budget",
        type=float,
        default=480.0,
        help="seconds the whole check may take: training is cut to fit, later sections skipped",
    )
    args = parser.parse_args(argv)
    chosen = set(args.sections.split(","))
    if chosen - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(chosen - set(SECTIONS))}; choose from {','.join(SECTIONS)}")
    if args.no_compile:
        chosen.discard("compiled")
    if args.tiny:
        args.backbone, args.batch_size, args.views, args.steps, args.epochs = "small", 4, 4, 1, 1
        args.train_images, args.image_size = 40, 16
        args.workers = min(args.workers, 1)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        build_info = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        print(NO_CUDA_MESSAGE.format(torch=torch.__version__, build=build_info), file=sys.stderr)
        return 2
    if args.tiny and device.type == "cpu":
        torch.set_num_threads(1)  # tiny steps gain nothing from threads, and lose much on a busy machine
    start = time.perf_counter()
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else f"{platform.machine()} CPU (script test, not a measurement)"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    environment = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "CUDA": str(torch.version.cuda),
        "python": platform.python_version(),
        "CPU cores": str(os.cpu_count()),
        **({"GPU memory": f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"} if cuda else {}),
        "command": "python benchmarks/gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    views = f"{args.batch_size} images x {args.views} views of {args.image_size} px"
    settings = {"step rows": f"{args.backbone}, {views}, bf16 autocast, {args.steps} rounds"}
    result = GpuCheckResult(name, environment, settings, args.batch_size * args.views)
    result.sync_counter = (
        "CUDA's sync debug mode" if cuda else "HostReads (device values read on the host; CPU, not compiled rows)"
    )
    path = Path(args.out_dir) / f"gpu-{device_slug(name.split(' (')[0])}.md"
    elapsed = lambda: time.perf_counter() - start  # noqa: E731
    scale = 0.1 if args.tiny else 1.0

    def needs_after(title: str) -> float:
        """Seconds kept for the chosen sections after ``title`` (the profiles apart: the least important)."""
        later = SECTIONS[SECTIONS.index(title) + 1 :]
        return scale * sum(NEEDS[other] for other in later if other in chosen and other != "profile")

    def section(title: str, label: str, work: Callable[[], None]) -> None:
        """Run one part of the check; a failure is reported and the rest goes on. The report is rewritten after
        every section, so a check cut short (a machine's time limit) still leaves the sections that ran."""
        if title not in chosen:
            return
        left = args.time_budget - elapsed()
        needs = scale * NEEDS[title]
        print(f"[{elapsed():6.1f} s] {label}", flush=True)
        if left < needs:
            result.sections.append(
                (label, f"skipped: {left:.0f} s of the {args.time_budget:.0f} s budget left, needs {needs:.0f} s")
            )
        else:
            began = time.perf_counter()
            try:
                work()
                result.sections.append((label, f"{time.perf_counter() - began:.0f} s"))
            except Exception as error:  # noqa: BLE001 - reported; the other sections still run
                traceback.print_exc()
                first = str(error).splitlines()[0] if str(error) else ""
                result.sections.append(
                    (
                        label,
                        f"**failed** after {time.perf_counter() - began:.0f} s: {type(error).__name__}: {first}"[:300],
                    )
                )
        result.targets = targets(result)
        result.seconds = elapsed()
        write_report(result, path)

    def cuda_tests() -> None:
        left = args.time_budget - elapsed() - needs_after("tests")
        result.tests = run_cuda_tests(timeout=max(scale * NEEDS["tests"], min(300.0, left)))
        if not result.tests.ok:
            raise RuntimeError(
                f"the cuda tests: {result.tests.failed} failed, {result.tests.errors} errors"
                + (f" ({result.tests.note})" if result.tests.note else "")
            )

    def measure_steps(compiled: bool) -> None:
        deadline = start + args.time_budget - needs_after("compiled") if compiled else None
        rows = step_rows(args, device, autocast, compiled, deadline)
        print("\n".join(format_rows(rows, args.batch_size * args.views)), flush=True)
        result.step_rows += rows
        model = gpu_key(name) if cuda else "h100-sxm"  # on a CPU: the script's test, for an H100
        if not compiled and model is not None:
            sizes = {"backbone": args.backbone, "batch_size": args.batch_size, "views": args.views}
            try:
                result.predicted = predicted_rows(model, {**sizes, "image_size": args.image_size})
            except (subprocess.SubprocessError, OSError) as error:  # the measurements stand without it
                stderr = getattr(error, "stderr", None) or ""
                result.prediction_failure = (stderr.strip().splitlines() or [str(error)])[-1][:300]
            else:
                result.predicted_for = GPUS_NAMES.get(model, model) + ("" if cuda else " (a script test on a CPU)")

    def measure_precision() -> None:
        result.agreement, result.gradient_agreement = agreement(args, device)

    def measure_data() -> None:
        result.data_rows = data_path_rows(
            args.views,
            args.batch_size,
            max(args.steps, 3),
            args.workers,
            device,
            image_size=args.image_size,
            output_dtype="bfloat16" if cuda else "float32",
            channels_last=cuda,
        )

    def train() -> None:
        path_name = fastest_data_path(result, args.workers) if args.train_data == "fastest" else args.train_data
        images = args.train_images // 10 * 10
        eager = [row for row in result.step_rows if row.graphs is None]  # the runs compile nothing
        errors = []
        for internal, prefix, share in ((False, EXTERNAL, 0.4), (True, INTERNAL, 1.0)):
            left = args.time_budget - elapsed() - needs_after("training")
            seconds = max(scale * NEEDS["training"] / 2, share * left)
            batches = batches_that_fit(0.7 * seconds, fastest(eager, prefix), args.epochs, args.batch_size, images)
            try:
                run = training_run(args, device, internal, seconds, path_name, batches)
            except Exception as error:  # noqa: BLE001 - the other run still goes; the section fails after it
                traceback.print_exc()
                errors.append(error)
                continue
            print(f"{run.method}: training seconds {run.train_seconds}, validation {run.validation_seconds}")
            result.training.append(run)
        if errors:
            raise errors[0]

    section("tests", "cuda tests", cuda_tests)
    section("steps", "training-step rows", partial(measure_steps, False))
    section("compiled", "training-step rows, compiled", partial(measure_steps, True))
    section("precision", "precision", measure_precision)
    section("data", "data path", measure_data)
    section("training", f"training: {args.epochs} epochs on {args.train_images} images", train)
    section(
        "profile",
        "profiles of the external and internal steps (log only)",
        lambda: print(profile_steps(args, device, autocast), flush=True),
    )
    if not path.exists():
        write_report(result, path)
    print(path.read_text())
    print(f"[{elapsed():6.1f} s] report written to {path}")
    return 1 if any("failed" in outcome for _, outcome in result.sections) else 0
