"""One command that measures a GPU: ``make gpu-check`` (``python benchmarks/gpu_check.py``).

Writes ``docs/benchmarks/gpu-<device>.md``, section by section, in this order (a time budget cuts the last first):

1. ``tests``: the ``cuda`` tests (``python -m pytest -m cuda tests/cuda``, in a subprocess): passed / failed / skipped
   and the first failures (without CUDA all are skipped, which is reported, not a failure);
2. ``steps``: training steps at 64 images x 9 views in bf16 (ResNet-18, CIFAR-sized views; forward, backward and the
   fused-SGD update guarded by the step's checks): the backbone alone, the HFMCA external cost, external + internal
   costs on all 8 BasicBlocks, each plain and channels-last; and the external channels-last step with its views drawn
   on the device inside the step (``ResidentViews``, ``BatchedViews`` / ``KorniaViews`` on the device) against the
   same step on views drawn beforehand. Per row: views/s, time relative to the fastest backbone row of the run, the
   memory the step allocates, host synchronisations per step (on CUDA counted by CUDA's sync debug mode, on the CPU
   the device values read on the host), kernels launched and the fraction of the step the GPU is busy;
3. ``compiled``: the same with the backbone compiled, and with the cost path compiled (``compile_costs``, CUDA
   graphs on CUDA), with the graphs compiled, recompilations and CUDA-graph skips of each row;
4. ``precision``: bf16-vs-float32 agreement of every cost, and fast-vs-float64 and tf32x3-vs-float64 internal
   statistics (costs and backbone gradients);
5. ``data``: every data path (CPU workers: torchvision per view, kornia per image, batched per batch; uint8 batches
   drawn on the device by kornia or batched; the training set on the device, one or 8 batches per call);
6. ``training``: epochs of HFMCA-SS(*) and of HFMCA-SS (internal costs on the 8 BasicBlocks) on a CIFAR-sized
   SyntheticShapes set (50k images) on the fastest data path, training and validation (kNN) seconds apart, and the
   training seconds of one 50,000-image epoch;
7. ``profile``: kernel tables of the external and internal steps (to the log only).

and the targets (bf16, 64 x 9 views of 32 px, channels-last), each marked met, not met or not measured. A missing
optional package (kornia) drops only the rows that need it, with the reason.

Without CUDA it says so and exits with status 2: it never silently measures the CPU. ``--device cpu --tiny`` runs
every section at tiny sizes to test the script. Needs torch, torchvision, lightning, numpy and pytest; kornia for
the kornia rows (carried as a wheel to machines without it: ``make gpu-wheels``); never jsonargparse, wandb or
lightly.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, closing, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from step_timing import RowSkipped, Step, StepRow, format_rows, measure_rows, repeated  # noqa: E402
from throughput import (  # noqa: E402
    DataRow,
    build,
    data_path_rows,
    data_paths,
    missing_packages,
    training_step,
    view_stream,
)

SECTIONS = ("tests", "steps", "compiled", "precision", "data", "training", "profile")
# Seconds a section needs at least to start on a GPU (``--tiny``: a tenth).
NEEDS = {"tests": 30, "steps": 20, "compiled": 40, "precision": 10, "data": 20, "training": 60, "profile": 10}
CUDA_TESTS = ["-m", "pytest", "-m", "cuda", "tests/cuda", "-q", "-p", "no:cacheprovider"]
CIFAR_EPOCH = 50_000

NO_CUDA_MESSAGE = (
    "gpu_check: CUDA is not available here (torch {torch}, {build}). This check measures a GPU and never "
    "silently measures the CPU: run it on a machine with a CUDA GPU, or pass --device cpu --tiny to test the script."
)

BACKBONE = "backbone alone: "
EXTERNAL = "external: "
INTERNAL = "external + internal: "
BEFOREHAND = "external, views drawn beforehand: channels_last"
IN_STEP = "external, views drawn in the step"
COMPILED_COSTS = " + compiled costs"
# The pipelines that draw views inside the step (names of throughput.data_paths) and their row labels.
IN_STEP_PATHS = {
    "resident": "ResidentViews",
    "resident-8": "ResidentViews, 8 batches per call",
    "batched-device": "BatchedViews on device",
    "kornia-device": "KorniaViews on device",
}


@dataclass
class Target:
    """One stated target and what was measured against it (``met`` is None when it could not be measured)."""

    what: str
    measured: str
    met: bool | None


@dataclass
class CudaTests:
    """The outcome of the ``cuda`` tests: counts from pytest's summary, its first failure lines, and a ``note``
    (all skipped without CUDA, stopped by the time budget)."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    note: str = ""
    returncode: int | None = 0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.failed and not self.errors


@dataclass
class AgreementRow:
    """Relative differences of one cost: bf16 autocast vs float32, and the fast / tf32x3 statistics vs float64
    (None for the external cost, whose statistics have no precision setting)."""

    name: str
    bf16: float
    fast: float | None
    tf32x3: float | None


@dataclass
class TrainingRun:
    """One training run: per epoch, the images trained, the training seconds and the validation (kNN) seconds apart,
    and the kNN top-1; ``cut`` says what the time budget shortened."""

    method: str
    backbone: str
    images: int
    views: int
    batch_size: int
    images_trained: list[int] = field(default_factory=list)
    train_seconds: list[float] = field(default_factory=list)
    validation_seconds: list[float | None] = field(default_factory=list)
    knn_top1: list[float | None] = field(default_factory=list)
    peak_memory: str = ""
    data_path: str = ""
    cut: str = ""

    def epoch_projection(self) -> tuple[float, int] | None:
        """Training seconds of one 50,000-image epoch at the pace of the last epoch that trained the most images
        (later epochs have warmed up), and that epoch's number (1-based); None without a trained epoch."""
        if not self.train_seconds or not max(self.images_trained, default=0):
            return None
        most = max(self.images_trained)
        epoch = max(index for index, images in enumerate(self.images_trained) if images == most)
        return self.train_seconds[epoch] * CIFAR_EPOCH / most, epoch + 1


@dataclass
class GpuCheckResult:
    """Everything the report shows; :func:`write_report` turns it into Markdown."""

    device_name: str
    environment: dict[str, str]
    settings: dict[str, str]
    items_per_step: int
    step_rows: list[StepRow] = field(default_factory=list)
    data_rows: list[DataRow] = field(default_factory=list)
    agreement: list[AgreementRow] = field(default_factory=list)
    gradient_agreement: dict[str, float] = field(default_factory=dict)
    """Backbone gradients vs float64 statistics, by precision; ``fast twice``: the fast pass run twice (the floor)."""
    training: list[TrainingRun] = field(default_factory=list)
    tests: CudaTests | None = None
    targets: list[Target] = field(default_factory=list)
    seconds: float = 0.0
    sections: list[tuple[str, str]] = field(default_factory=list)
    """``(section, outcome)`` in the order run: seconds taken, or why it failed or was skipped."""
    sync_counter: str = "CUDA's sync debug mode"


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3`` (the report's file name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _rate(items: int, seconds: float | None) -> str:
    return f"{items / seconds:,.0f}" if seconds else "—"


def _count(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if float(value).is_integer() or not digits else f"{value:.{digits}f}"


def fastest_backbone(rows: list[StepRow]) -> StepRow | None:
    """The fastest measured backbone-alone row of the run (the denominator of every ratio)."""
    return min(
        (row for row in rows if row.label.startswith(BACKBONE) and row.seconds),
        key=lambda row: row.seconds or 0.0,
        default=None,
    )


def _fastest(rows: list[StepRow], prefix: str) -> StepRow | None:
    return min(
        (row for row in rows if row.label.startswith(prefix) and row.seconds),
        key=lambda row: row.seconds or 0.0,
        default=None,
    )


def write_report(result: GpuCheckResult, path: Path) -> str:
    """Write the Markdown report of ``result`` to ``path`` and return it."""
    lines = [f"# GPU check: {result.device_name}", ""]
    lines += [f"- {key}: {value}" for key, value in result.environment.items()]
    lines += [f"- {key}: {value}" for key, value in result.settings.items()]
    lines += [f"- whole check: {result.seconds:.0f} s"]
    lines += [f"- section {name}: {outcome}" for name, outcome in result.sections]
    lines += ["", "## Targets", "", "| target | measured | verdict |", "| --- | --- | --- |"]
    for target in result.targets:
        verdict = "not measured" if target.met is None else ("met" if target.met else "**not met**")
        lines.append(f"| {target.what} | {target.measured} | {verdict} |")
    lines += _test_lines(result.tests)
    lines += _step_lines(result)
    lines += _precision_lines(result)
    lines += _data_lines(result)
    lines += _training_lines(result.training)
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def _test_lines(tests: CudaTests | None) -> list[str]:
    lines = ["", "## CUDA tests", ""]
    if tests is None:
        return lines + ["Not run."]
    counts = f"{tests.passed} passed, {tests.failed} failed, {tests.skipped} skipped"
    counts += f", {tests.errors} errors" if tests.errors else ""
    lines.append(f"`python {' '.join(CUDA_TESTS)}`: {counts} in {tests.seconds:.0f} s.")
    if tests.note:
        lines += ["", tests.note]
    if tests.failures:
        lines += ["", "First failures:", "", "```", *tests.failures, "```"]
    return lines


def _step_lines(result: GpuCheckResult) -> list[str]:
    base = fastest_backbone(result.step_rows)
    lines = ["", f"## Training step ({result.items_per_step} views per step; medians of interleaved rounds)", ""]
    lines += [
        "Each step: forward (bf16 autocast), backward and the fused-SGD update, guarded on the device by the step's "
        "checks, which are read one step later. Ratios: time over the fastest backbone row of this run"
        + (f" ({base.label}, {base.seconds * 1000:.1f} ms)" if base and base.seconds else "")
        + f". Host syncs: host synchronisations per step, counted by {result.sync_counter}. Kernels: launched per "
        "step. GPU busy: kernel time per step (profiled) over the step's median time.",
        "",
        "| row | views/s | ms / step | vs fastest backbone row | step memory (GiB) | host syncs | kernels | GPU busy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result.step_rows:
        if row.seconds is None:
            why = f"skipped: {row.skipped}" if row.skipped else f"failed: {row.error}"
            lines.append(f"| {row.label} | {why} | | | | | | |")
            continue
        ratio = f"{row.seconds / base.seconds:.2f}x" if base and base.seconds else "—"
        memory = f"{row.step_memory_gib:.2f}" if row.step_memory_gib is not None else "—"
        busy = "—" if row.busy_fraction is None else f"{row.busy_fraction:.0%}"
        lines.append(
            f"| {row.label} | {_rate(result.items_per_step, row.seconds)} | {row.seconds * 1000:.1f} | {ratio} | "
            f"{memory} | {_count(row.host_syncs, 2)} | {_count(row.kernels)} | {busy} |"
        )
    incomplete = [row for row in result.step_rows if row.seconds is not None and row.error]
    if incomplete:
        lines += ["", *(f"- {row.label}: {row.error}" for row in incomplete)]
    compiled = [row for row in result.step_rows if row.graphs is not None]
    if compiled:
        lines += [
            "",
            "Compilation of the compiled rows (TorchDynamo graphs compiled while the row was built and warmed up, "
            "graphs compiled after that, and CUDA graphs inductor skipped; 0 recompiles and 0 skips expected):",
            "",
            "| row | graphs compiled | recompiles | CUDA-graph skips |",
            "| --- | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {row.label} | {_count(row.graphs)} | {_count(row.recompiles)} | {_count(row.cudagraph_skips)} |"
            for row in compiled
        ]
    return lines


def _precision_lines(result: GpuCheckResult) -> list[str]:
    lines = [
        "",
        "## Precision",
        "",
        "| cost | bf16 vs float32 (relative) | fast vs float64 statistics | tf32x3 vs float64 statistics |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in result.agreement:
        fast = "—" if row.fast is None else f"{row.fast:.2e}"
        split = "—" if row.tf32x3 is None else f"{row.tf32x3:.2e}"
        lines.append(f"| {row.name} | {row.bf16:.2e} | {fast} | {split} |")
    gradients = result.gradient_agreement
    if gradients:
        parts = ", ".join(f"{name} {value:.2e}" for name, value in gradients.items())
        lines += [
            "",
            "Backbone gradients against float64 internal statistics (float32 model, deterministic float32 "
            f"convolutions), relative difference: {parts}.",
        ]
    return lines


def _data_lines(result: GpuCheckResult) -> list[str]:
    items = result.items_per_step
    external = _fastest(result.step_rows, EXTERNAL)
    lines = ["", "## Data path", ""]
    if external is not None:
        consumed = _rate(items, external.seconds)
        lines += [f"Against what the fastest external step ({external.label}) consumes: {consumed} views/s.", ""]
    lines += ["| path | views/s | vs the external step's consumption |", "| --- | ---: | ---: |"]
    for row in result.data_rows:
        if row.seconds is None:
            lines.append(f"| {row.label} | {row.note} | |")
            continue
        ratio = f"{external.seconds / row.seconds:.2f}x" if external is not None and external.seconds else "—"
        lines.append(f"| {row.label} | {_rate(items, row.seconds)} | {ratio} |")
    return lines


def _training_lines(runs: list[TrainingRun]) -> list[str]:
    lines = ["", "## Training", ""]
    if not runs:
        return lines + ["Not run."]
    for run in runs:
        lines += [
            f"### {run.method}",
            "",
            f"{run.backbone}, SyntheticShapes {run.images:,} training images, {run.views} views, batch "
            f"{run.batch_size}" + (f", views from {run.data_path}" if run.data_path else "") + f"; peak memory "
            f"{run.peak_memory}." + (f" {run.cut}" if run.cut else ""),
            "",
        ]
        if not run.train_seconds:
            lines += ["No epoch finished.", ""]
            continue
        lines += [
            "| epoch | images trained | training s | validation (kNN) s | kNN top-1 |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for epoch, (images, seconds) in enumerate(zip(run.images_trained, run.train_seconds)):
            validation = run.validation_seconds[epoch] if epoch < len(run.validation_seconds) else None
            top1 = run.knn_top1[epoch] if epoch < len(run.knn_top1) else None
            lines.append(
                f"| {epoch + 1} | {images:,} | {seconds:.1f} | {'—' if validation is None else f'{validation:.1f}'} "
                f"| {'—' if top1 is None else f'{top1:.3f}'} |"
            )
        projection = run.epoch_projection()
        if projection is not None:
            seconds, epoch = projection
            lines += [
                "",
                f"At epoch {epoch}'s pace, training on one CIFAR epoch (50,000 images) takes {seconds:.1f} s, "
                f"validation apart: 20 epochs {_duration(20 * seconds)}, 800 epochs {_duration(800 * seconds)}.",
            ]
        lines.append("")
    return lines


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


# --- the sections ----------------------------------------------------------------------------------------------------


def parse_pytest(output: str, returncode: int | None, seconds: float) -> CudaTests:
    """Counts and first failure lines from pytest's ``-q`` output."""
    tests = CudaTests(seconds=seconds, returncode=returncode)
    summaries = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    if summaries:
        for count, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summaries[-1]):
            name = "errors" if what.startswith("error") else what
            setattr(tests, name, int(count))
    tests.failures = [line[:300] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))][:5]
    if returncode == 5:
        tests.note = "No cuda test was collected."
    elif tests.skipped and not tests.passed and not tests.failed and not tests.errors:
        reasons = sorted({line.split(": ", 1)[-1] for line in output.splitlines() if line.startswith("SKIPPED")})
        tests.note = "All skipped" + (f": {'; '.join(reasons)}" if reasons else "") + "."
    return tests


def run_cuda_tests(timeout: float) -> CudaTests:
    """The ``cuda`` tests in a subprocess (the repository's tests/cuda), stopped after ``timeout`` seconds."""
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *CUDA_TESTS], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode(errors="replace")
        tests = parse_pytest(output, None, time.perf_counter() - began)
        tests.note = f"Stopped by the time budget after {timeout:.0f} s."
        return tests
    return parse_pytest(done.stdout + done.stderr, done.returncode, time.perf_counter() - began)


def step_rows(
    args: argparse.Namespace,
    device: torch.device,
    autocast: AbstractContextManager,
    compiled: bool = False,
    deadline: float | None = None,
) -> list[StepRow]:
    """The training-step rows: backbone / external / external + internal, each plain and channels-last, then the
    external channels-last step with its views drawn inside the step by each device pipeline, and the same step on
    views drawn beforehand; with ``compiled``, instead the three rows with the backbone compiled + channels-last
    and the two cost rows channels-last with the cost path compiled (CUDA graphs on CUDA), with their compilation
    counts, timed as their own group."""
    views = torch.randn(args.batch_size, args.views, 3, args.image_size, args.image_size, device=device)

    def make(internal: bool, cost: bool, options: dict[str, Any]) -> Step:
        module = build(args.backbone, args.views, internal, **options).to(device).train()
        return training_step(module, views, cost, autocast, update=True)

    if compiled:
        settings = {
            "compiled + channels_last": {"channels_last": True, "compile_backbone": True},
            f"channels_last{COMPILED_COSTS}": {"channels_last": True, "compile_costs": True},
        }
    else:
        settings = {"plain": {}, "channels_last": {"channels_last": True}}
    rows: list[tuple[str, Callable[[], Step]]] = []
    for what, internal, cost in ((BACKBONE, False, False), (EXTERNAL, False, True), (INTERNAL, True, True)):
        for setting, options in settings.items():
            if not cost and COMPILED_COSTS in setting:
                continue
            rows.append((f"{what}{setting}", partial(make, internal, cost, options)))
    with ExitStack() as open_loaders:
        if not compiled:
            rows += in_step_rows(args, device, autocast, open_loaders)
        return measure_rows(rows, args.steps, device, anatomy=True, compilation=compiled, deadline=deadline)


def in_step_rows(
    args: argparse.Namespace, device: torch.device, autocast: AbstractContextManager, open_loaders: ExitStack
) -> list[tuple[str, Callable[[], Step]]]:
    """The external channels-last step on views drawn beforehand (by ``ResidentViews``), and on views drawn inside
    the step by each device pipeline (its loader's next batch, moved to the device and drawn there, as Lightning's
    ``on_after_batch_transfer`` does); a pipeline that draws several batches per call is timed over that many steps.
    The loaders are closed with ``open_loaders``."""
    from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes

    paths = data_paths(args.workers, "bfloat16", True)
    batches_needed = (args.steps + 8) * max(path.batches_per_call for path in paths.values())
    source = SyntheticShapes(
        num_classes=10,
        train_per_class=max(4, args.batch_size * batches_needed // 10 + 1),
        test_per_class=2,
        image_size=args.image_size,
    )

    def module() -> Any:
        return build(args.backbone, args.views, False, channels_last=True).to(device).train()

    def beforehand() -> Step:
        data = MultiViewDataModule(
            source, num_views=args.views, batch_size=args.batch_size, num_workers=0, views=paths["resident"].make()
        )
        data.setup()
        (first,) = data.view_batches(device, limit=1)
        drawn = first.groups[0]
        return training_step(module(), drawn, True, autocast, update=True)

    def in_step(name: str) -> Step:
        path = paths[name]
        missing = missing_packages(path.needs)
        if missing:
            raise RowSkipped(f"needs {', '.join(missing)}")
        data = MultiViewDataModule(
            source, num_views=args.views, batch_size=args.batch_size, num_workers=args.workers, views=path.make()
        )
        data.setup()
        batches = open_loaders.enter_context(closing(view_stream(data, device)))
        step = training_step(module(), lambda: next(batches).groups[0], True, autocast, update=True)
        return repeated(step, path.batches_per_call) if path.batches_per_call > 1 else step

    return [(BEFOREHAND, beforehand)] + [
        (f"{IN_STEP} ({label}): channels_last", partial(in_step, name)) for name, label in IN_STEP_PATHS.items()
    ]


def profile_steps(
    args: argparse.Namespace, device: torch.device, autocast: AbstractContextManager, rows: int = 30
) -> str:
    """Kernel tables (torch.profiler) of three channels-last steps with the external cost, and with external +
    internal costs: by device self time (where the costs' kernels go) and, for the internal step, by host self
    time (on GPUs that step is bound by host work). Printed to the log, not the report."""
    from torch.profiler import ProfilerActivity, profile

    views = torch.randn(args.batch_size, args.views, 3, args.image_size, args.image_size, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    device_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    tables = []
    for what, internal in (("external", False), ("external + internal", True)):
        module = build(args.backbone, args.views, internal, channels_last=True).to(device).train()
        step = training_step(module, views, True, autocast, update=True)
        for _ in range(2):
            step()
        with profile(activities=activities) as profiler:
            for _ in range(3):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        averages = profiler.key_averages()
        tables.append(f"{what} step, 3 steps, by {device_key}:\n" + averages.table(sort_by=device_key, row_limit=rows))
        if internal and device.type == "cuda":
            tables.append(
                f"{what} step, 3 steps, by self_cpu_time_total:\n"
                + averages.table(sort_by="self_cpu_time_total", row_limit=rows)
            )
    return "\n".join(tables)


def agreement(args: argparse.Namespace, device: torch.device) -> tuple[list[AgreementRow], dict[str, float]]:
    """Relative differences of every cost: bf16 autocast vs float32, and fast and tf32x3 vs float64 internal
    statistics (with the backbone-gradient differences of both, and of the fast pass run twice: the floor), on one
    batch of real augmented views. cuDNN runs deterministic float32 convolutions here (no TF32, no autotuned
    nondeterministic kernels), so the gradient differences are the statistics' own."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        return _agreement(args, device)


def _agreement(args: argparse.Namespace, device: torch.device) -> tuple[list[AgreementRow], dict[str, float]]:
    from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes

    data = MultiViewDataModule(
        SyntheticShapes(train_per_class=max(2, args.batch_size // 10 + 1), image_size=args.image_size),
        num_views=args.views,
        batch_size=args.batch_size,
        num_workers=0,
    )
    data.setup()
    (first,) = data.view_batches(device, limit=1)
    views = first.groups[0]
    torch.manual_seed(0)
    module = build(args.backbone, args.views, True).to(device).train()

    def costs(precision: str, autocast: AbstractContextManager) -> tuple[dict[str, float], torch.Tensor]:
        module.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the external head's noise channels: the same draw in every pass
        with autocast:
            objective = module.objective(module.collect(views, precision=precision))  # type: ignore[arg-type]
        objective.total.backward()
        gradients = [p.grad.detach().double().flatten() for p in module.backbone.parameters() if p.grad is not None]
        return {name: float(cost.detach()) for name, cost in objective.costs.items()}, torch.cat(gradients)

    state = {k: v.clone() for k, v in module.state_dict().items()}  # BN statistics move in train mode
    passes = {}
    for name, precision, autocast in (
        ("float64", "float64", nullcontext()),
        ("fast", "fast", nullcontext()),
        ("fast twice", "fast", nullcontext()),
        ("tf32x3", "tf32x3", nullcontext()),
        ("bf16", "fast", torch.autocast(device.type, dtype=torch.bfloat16)),
    ):
        module.load_state_dict(state)
        passes[name] = costs(precision, autocast)
    (reference, reference_grads), (fast, fast_grads) = passes["float64"], passes["fast"]

    def relative(values: dict[str, float], name: str) -> float | None:
        return None if name == "external" else abs(values[name] - reference[name]) / abs(reference[name])

    rows = [
        AgreementRow(
            name,
            abs(passes["bf16"][0][name] - fast[name]) / abs(fast[name]),
            relative(fast, name),
            relative(passes["tf32x3"][0], name),
        )
        for name in fast
    ]
    scale = reference_grads.norm()
    gradients = {
        "fast": float((fast_grads - reference_grads).norm() / scale),
        "tf32x3": float((passes["tf32x3"][1] - reference_grads).norm() / scale),
        "fast twice": float((passes["fast twice"][1] - fast_grads).norm() / scale),
    }
    return rows, gradients


def fastest_data_path(result: GpuCheckResult, workers: int) -> str:
    """The name (:func:`throughput.data_paths`) of the data path that delivered the most views in the data section;
    the training set on the device when the section did not run."""
    labels = {f"data: {path.label}": name for name, path in data_paths(workers).items()}
    measured = [(row.seconds, labels[row.label]) for row in result.data_rows if row.seconds and row.label in labels]
    return min(measured)[1] if measured else "resident"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _epoch_clock(device: torch.device) -> Any:
    """A Lightning callback that times every epoch's training and validation apart (the device's queue drained at
    each boundary) and counts the batches trained."""
    from lightning.pytorch import Callback

    class EpochClock(Callback):
        def __init__(self) -> None:
            self.batches: list[int] = []
            self.train_seconds: list[float] = []
            self.validation: dict[int, float] = {}
            self.knn: dict[int, float] = {}
            self._start = self._validation_start = self._validating = 0.0
            self._batches = 0

        def _now(self) -> float:
            _sync(device)
            return time.perf_counter()

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self._start, self._validating, self._batches = self._now(), 0.0, 0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._batches += 1

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            self._validation_start = self._now()

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            seconds = self._now() - self._validation_start
            self._validating += seconds
            epoch = trainer.current_epoch
            self.validation[epoch] = self.validation.get(epoch, 0.0) + seconds
            if "knn/top1" in trainer.callback_metrics:
                self.knn[epoch] = float(trainer.callback_metrics["knn/top1"])

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self.train_seconds.append(self._now() - self._start - self._validating)
            self.batches.append(self._batches)

    return EpochClock()


def training_run(
    args: argparse.Namespace,
    device: torch.device,
    internal: bool = False,
    max_seconds: float | None = None,
    data_path_name: str | None = None,
    max_batches: int | None = None,
) -> TrainingRun:
    """``args.epochs`` epochs of HFMCA-SS(*) (``internal``: HFMCA-SS, internal costs on every block, tf32x3
    statistics) on SyntheticShapes with kNN after each (bf16 and channels-last on CUDA), on the data path
    ``data_path_name``; at most ``max_batches`` batches per epoch, stopped after ``max_seconds`` (the check's time
    budget)."""
    from lightning.pytorch import Trainer

    from hfmca_lightning.callbacks import KNNEvaluation
    from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes

    per_class = max(1, args.train_images // 10)
    source = SyntheticShapes(
        num_classes=10, train_per_class=per_class, test_per_class=max(2, per_class // 5), image_size=args.image_size
    )
    cuda = device.type == "cuda"
    path = data_paths(args.workers, "bfloat16" if cuda else "float32", cuda)[data_path_name or "resident"]
    missing = missing_packages(path.needs)
    if missing:
        raise RuntimeError(f"the data path {path.label} needs {', '.join(missing)}")
    data = MultiViewDataModule(
        source,
        num_views=args.views,
        batch_size=args.batch_size,
        eval_batch_size=512,
        num_workers=args.workers,
        views=path.make(),
    )
    module = build(args.backbone, args.views, internal, channels_last=cuda)
    clock = _epoch_clock(device)
    trainer = Trainer(
        max_epochs=args.epochs,
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=max_batches if max_batches is not None else 1.0,
        callbacks=[KNNEvaluation(k=min(200, per_class * 10)), clock],
        max_time=None if max_seconds is None else datetime.timedelta(seconds=max_seconds),
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(module, data)
    images = per_class * 10
    full = images // args.batch_size * args.batch_size
    trained = [batches * args.batch_size for batches in clock.batches]
    cut = []
    if max_batches is not None and max_batches * args.batch_size < full:
        cut.append(f"Epochs cut to {max_batches * args.batch_size:,} images to fit the time budget.")
    if len(trained) < args.epochs or (trained and trained[-1] < min(full, (max_batches or full) * args.batch_size)):
        cut.append(f"Stopped by the time budget after {max_seconds:.0f} s." if max_seconds else "Stopped early.")
    return TrainingRun(
        "HFMCA-SS" if internal else "HFMCA-SS(*)",
        args.backbone,
        images,
        args.views,
        args.batch_size,
        trained,
        clock.train_seconds,
        [clock.validation.get(epoch) for epoch in range(len(trained))],
        [clock.knn.get(epoch) for epoch in range(len(trained))],
        f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (GPU)" if cuda else "— (CPU)",
        path.label,
        " ".join(cut),
    )


def batches_that_fit(seconds: float, step: StepRow | None, epochs: int, batch_size: int, images: int) -> int | None:
    """Batches per epoch such that ``epochs`` epochs at ``step``'s pace (twice its time, for the first epoch's
    warm-up and the loop's own work) take at most ``seconds``; None when whole epochs fit (or the pace is unknown)."""
    if step is None or not step.seconds:
        return None
    fitting = int(seconds / (epochs * 2 * step.seconds))
    return None if fitting * batch_size >= images else max(4, fitting)


def targets(result: GpuCheckResult) -> list[Target]:
    """The targets (bf16, 64 x 9 views of 32 px, channels-last) against the measured rows: the fastest external and
    external + internal rows (any setting) over the fastest backbone row of the run, the fastest step with its views
    drawn on the device inside it over the same step on views drawn beforehand, the training seconds of one
    50,000-image HFMCA-SS(*) epoch, and the host synchronisations of every step row."""
    rows = result.step_rows
    base = fastest_backbone(rows)
    found: list[Target] = []
    for what, prefix, limit, goal in (
        ("external / backbone step", EXTERNAL, 1.05, None),
        ("external + internal (8 BasicBlocks) / backbone step", INTERNAL, 1.5, 1.25),
    ):
        best = _fastest(rows, prefix)
        ratio = best.seconds / base.seconds if best and best.seconds and base and base.seconds else None
        name = f"{what} <= {limit:.2f}x" + (f" (goal {goal:.2f}x)" if goal else "")
        measured = "—" if ratio is None else f"{ratio:.2f}x ({best.label} / {base.label})"  # type: ignore[union-attr]
        found.append(Target(name, measured, None if ratio is None else ratio <= limit))
    reference = next((row for row in rows if row.label == BEFOREHAND and row.seconds), None)
    in_step = _fastest(rows, IN_STEP)
    ratio = (
        in_step.seconds / reference.seconds if in_step and in_step.seconds and reference and reference.seconds else None
    )
    found.append(
        Target(
            "step with views drawn on the device / step with views drawn beforehand <= 1.05x",
            "—" if ratio is None else f"{ratio:.2f}x ({in_step.label})",  # type: ignore[union-attr]
            None if ratio is None else ratio <= 1.05,
        )
    )
    run = next((run for run in result.training if run.method == "HFMCA-SS(*)"), None)
    projection = run.epoch_projection() if run is not None else None
    found.append(
        Target(
            "training seconds of one 50,000-image epoch, HFMCA-SS(*) (validation apart) <= 10 s",
            "—" if projection is None else f"{projection[0]:.1f} s (epoch {projection[1]}'s pace)",
            None if projection is None else projection[0] <= 10.0,
        )
    )
    counted = [row for row in rows if row.host_syncs is not None]
    kornia = [row for row in counted if "Kornia" in row.label]
    ours = [row for row in counted if row not in kornia]
    worst = max(ours, key=lambda row: row.host_syncs or 0.0, default=None)
    if worst is None:
        measured = "—"
    elif not worst.host_syncs:
        measured = f"0 in all {len(ours)} step rows"
    else:
        syncing = [row for row in ours if row.host_syncs]
        measured = f"{_count(worst.host_syncs, 2)} ({worst.label}; {len(syncing)} of {len(ours)} rows sync)"
    if kornia and worst is not None:
        measured += "; " + ", ".join(f"{row.label}: {_count(row.host_syncs, 2)}" for row in kornia) + " (kornia's)"
    found.append(
        Target(
            f"host syncs per training step ({result.sync_counter}) = 0",
            measured,
            None if worst is None else not worst.host_syncs,
        )
    )
    return found


def main(argv: list[str] | None = None) -> int:
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
    kornia = "not installed" if missing_packages(("kornia",)) else "installed"
    environment = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "CUDA": str(torch.version.cuda),
        "python": platform.python_version(),
        "CPU cores": str(os.cpu_count()),
        **({"GPU memory": f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"} if cuda else {}),
        "kornia": kornia,
        "command": "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
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
            batches = batches_that_fit(0.7 * seconds, _fastest(eager, prefix), args.epochs, args.batch_size, images)
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


if __name__ == "__main__":
    sys.exit(main())
