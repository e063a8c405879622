"""One command that measures a GPU: ``make gpu-check`` (``python benchmarks/gpu_check.py``).

Writes ``docs/benchmarks/gpu-<device>.md`` with

* training-step rows at 64 images x 9 views in bf16 (ResNet-18, CIFAR-sized views): the backbone alone, the
  HFMCA external cost, external + internal costs on all 8 BasicBlocks, each plain, channels-last, with the
  backbone compiled, and with the cost path compiled into CUDA graphs (``compile_costs``), and the external
  step fed by on-device augmentation; views/s, time relative to the backbone row of the same settings, the
  memory each step allocates, and what each step asks of the device: host reads of device values, kernels
  launched, and the fraction of the step the GPU is busy;
* the data path: CPU workers (torchvision per view, kornia per image, batched per batch), uint8 batches
  augmented on the GPU, and the training set kept on the GPU, against what the external step consumes;
* bf16-vs-float32 agreement of every cost, and fast-vs-float64 internal statistics (costs and backbone
  gradients) on the GPU;
* 3 epochs of HFMCA-SS(*) on a CIFAR-sized SyntheticShapes set (50k images) with kNN on the fastest data path:
  seconds and top-1 per epoch, and the time 20 and 800 CIFAR epochs would take;
* the targets (external <= 1.10x and external + internal <= 1.6x the backbone step, data path >= 1.2x the
  external step's views/s, one epoch of 50,000 images <= 12 s), each marked met or not.

Without CUDA it says so and exits with status 2: it never silently measures the CPU. ``--device cpu``
runs the same script at tiny sizes (``--tiny``) to test it. Needs torch, torchvision, lightning and
numpy; kornia for the device-augmentation rows (carried as a wheel to machines without it: ``make
gpu-wheels``); never jsonargparse, wandb or lightly.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from step_timing import StepRow, format_rows, measure_rows  # noqa: E402
from throughput import build, data_path_rows, data_paths, training_step  # noqa: E402

SECTIONS = ("steps", "profile", "precision", "data", "training", "compiled")

NO_CUDA_MESSAGE = (
    "gpu_check: CUDA is not available here (torch {torch}, {build}). This check measures a GPU and never "
    "silently measures the CPU: run it on a machine with a CUDA GPU, or pass --device cpu --tiny to test the script."
)


@dataclass
class Target:
    """One stated target and what was measured against it (``met`` is None when it could not be measured)."""

    what: str
    measured: str
    met: bool | None


@dataclass
class TrainingRun:
    backbone: str
    images: int
    views: int
    batch_size: int
    epoch_seconds: list[float]
    knn_top1: list[float]
    peak_memory: str
    data_path: str = ""

    def steady_epoch(self) -> float | None:
        """Seconds of the last epoch (the first one also pays for warm-up and compilation)."""
        return self.epoch_seconds[-1] if self.epoch_seconds else None


@dataclass
class GpuCheckResult:
    """Everything the report shows; :func:`write_report` turns it into Markdown."""

    device_name: str
    environment: dict[str, str]
    settings: dict[str, str]
    items_per_step: int
    step_rows: list[StepRow] = field(default_factory=list)
    data_rows: list[tuple[str, float]] = field(default_factory=list)
    agreement: list[tuple[str, float, float | None]] = field(default_factory=list)
    gradient_agreement: float | None = None
    training: TrainingRun | None = None
    gradient_repeat: float | None = None
    """The same fast pass twice (the floor of ``gradient_agreement``)."""
    targets: list[Target] = field(default_factory=list)
    seconds: float = 0.0
    sections: list[tuple[str, str]] = field(default_factory=list)
    """``(section, outcome)`` in the order run: seconds taken, or why it failed or was skipped."""


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3`` (the report's file name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _rate(items: int, seconds: float | None) -> str:
    return f"{items / seconds:,.0f}" if seconds else "—"


def write_report(result: GpuCheckResult, path: Path) -> str:
    """Write the Markdown report of ``result`` to ``path`` and return it."""
    lines = [f"# GPU check: {result.device_name}", ""]
    lines += [f"- {key}: {value}" for key, value in result.environment.items()]
    lines += [f"- {key}: {value}" for key, value in result.settings.items()]
    lines += [f"- whole check: {result.seconds:.0f} s"]
    lines += [f"- section {name}: {outcome}" for name, outcome in result.sections]
    lines += ["", "## Targets", "", "| target | measured | met |", "| --- | --- | --- |"]
    for target in result.targets:
        verdict = "—" if target.met is None else ("yes" if target.met else "**no**")
        lines.append(f"| {target.what} | {target.measured} | {verdict} |")
    lines += ["", f"## Training step ({result.items_per_step} views per step; medians of interleaved rounds)", ""]
    lines += [
        "Host reads: device values read on the host per step (each a wait for the GPU's queue). Kernels: launched "
        "per step. "
        "GPU busy: kernel time per step (profiled) over the step's median time.",
        "",
        "| row | views/s | ms / step | vs backbone row of the same settings | step memory (GiB) | host reads | "
        "kernels | GPU busy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result.step_rows:
        if row.seconds is None:
            lines.append(f"| {row.label} | failed: {row.error} | | | | | | |")
            continue
        base = _backbone_seconds(result.step_rows, row.label)
        ratio = f"{row.seconds / base:.2f}x" if base else "—"
        memory = f"{row.step_memory_gib:.2f}" if row.step_memory_gib is not None else "—"
        reads = "—" if row.host_reads is None else str(row.host_reads)
        kernels = "—" if row.kernels is None else f"{row.kernels:,.0f}"
        busy = "—" if row.busy_fraction is None else f"{row.busy_fraction:.0%}"
        lines.append(
            f"| {row.label} | {_rate(result.items_per_step, row.seconds)} | {row.seconds * 1000:.1f} | {ratio} | "
            f"{memory} | {reads} | {kernels} | {busy} |"
        )
    lines += ["", "## Data path", "", "| path | views/s |", "| --- | ---: |"]
    lines += [f"| {label} | {_rate(result.items_per_step, seconds)} |" for label, seconds in result.data_rows]
    lines += [
        "",
        "## Precision",
        "",
        "| cost | bf16 vs float32 (relative) | fast vs float64 statistics (relative) |",
        "| --- | ---: | ---: |",
    ]
    for name, bf16, fast in result.agreement:
        lines.append(f"| {name} | {bf16:.2e} | {'—' if fast is None else f'{fast:.2e}'} |")
    if result.gradient_agreement is not None:
        repeat = "" if result.gradient_repeat is None else f" (the fast pass twice: {result.gradient_repeat:.2e})"
        lines += [
            "",
            "Backbone gradients, fast vs float64 internal statistics (float32 model, deterministic float32 "
            f"convolutions): relative difference {result.gradient_agreement:.2e}{repeat}.",
        ]
    lines += ["", "## Training", ""]
    if result.training is None or not result.training.epoch_seconds:
        lines.append("Not run.")
    else:
        run = result.training
        lines += [
            f"HFMCA-SS(*), {run.backbone}, SyntheticShapes {run.images:,} images, {run.views} views, batch "
            f"{run.batch_size}"
            + (f", views from {run.data_path}" if run.data_path else "")
            + f"; peak memory {run.peak_memory}.",
            "",
            "| epoch | seconds | kNN top-1 |",
            "| ---: | ---: | ---: |",
        ]
        for epoch, (seconds, top1) in enumerate(
            zip(run.epoch_seconds, run.knn_top1 + [float("nan")] * len(run.epoch_seconds)), start=1
        ):
            lines.append(f"| {epoch} | {seconds:.1f} | {top1:.3f} |")
        steady = run.steady_epoch()
        if steady is not None:
            per_cifar_epoch = steady * 50_000 / run.images
            lines += [
                "",
                f"At the last epoch's pace, one CIFAR epoch (50,000 images) takes {per_cifar_epoch:.1f} s: 20 epochs "
                f"{_duration(20 * per_cifar_epoch)}, 800 epochs {_duration(800 * per_cifar_epoch)}.",
            ]
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


COMPILED_COSTS = " + compiled costs"


def _backbone_seconds(rows: list[StepRow], label: str) -> float | None:
    """The backbone row of the same settings as ``label`` (compiling the costs leaves the backbone as it is)."""
    settings = label.split(": ", 1)[1].replace(COMPILED_COSTS, "") if ": " in label else ""
    return next((row.seconds for row in rows if row.label == f"backbone alone: {settings}"), None)


def step_rows(
    args: argparse.Namespace, device: torch.device, autocast: AbstractContextManager, compiled: bool = False
) -> list[StepRow]:
    """The training-step rows: backbone / external / external + internal, each plain and channels-last, plus the
    external step fed by device augmentation; with ``compiled``, instead the three rows with the backbone compiled
    + channels-last and the two cost rows channels-last with the cost path compiled (CUDA graphs on CUDA), timed as
    their own group, last, so that compilation time cannot starve the other sections."""
    views = torch.randn(args.batch_size, args.views, 3, args.image_size, args.image_size, device=device)
    if compiled:
        settings = {
            "compiled + channels_last": {"channels_last": True, "compile_backbone": True},
            f"channels_last{COMPILED_COSTS}": {"channels_last": True, "compile_costs": True},
        }
    else:
        settings = {"plain": {}, "channels_last": {"channels_last": True}}
    rows = []
    for what, internal, cost in (
        ("backbone alone", False, False),
        ("external", False, True),
        ("external + internal", True, True),
    ):
        for setting, options in settings.items():
            if not cost and COMPILED_COSTS in setting:
                continue
            make = partial(
                lambda i, c, o: training_step(
                    build(args.backbone, args.views, i, **o).to(device).train(), views, c, autocast
                ),
                internal,
                cost,
                options,
            )
            rows.append((f"{what}: {setting}", make))

    def augmented_step(pipeline: str) -> object:
        from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes

        source = SyntheticShapes(train_per_class=2, test_per_class=1, image_size=args.image_size)
        data = MultiViewDataModule(source, num_views=args.views, augment_on_device=True, device_pipeline=pipeline)
        augment = data.device_augmentation.to(device)
        images = torch.randint(
            0, 256, (args.batch_size, 3, args.image_size, args.image_size), dtype=torch.uint8, device=device
        )
        module = build(args.backbone, args.views, False, channels_last=True).to(device).train()
        return training_step(module, images, True, autocast, augment=lambda batch: augment(batch, args.views))

    if not compiled:
        for pipeline in ("batched", "kornia"):
            rows.append(
                (f"external, device augmentation ({pipeline}): channels_last", partial(augmented_step, pipeline))
            )
    return measure_rows(rows, args.steps, device, anatomy=True)


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
        step = training_step(
            build(args.backbone, args.views, internal, channels_last=True).to(device).train(), views, True, autocast
        )
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


def agreement(
    args: argparse.Namespace, device: torch.device
) -> tuple[list[tuple[str, float, float | None]], float, float]:
    """Relative differences of every cost: bf16 autocast vs float32, and fast vs float64 internal statistics
    (with the backbone-gradient difference of the latter, and of the fast pass run twice: the floor), on one
    batch of real augmented views. cuDNN runs deterministic float32 convolutions here (no TF32, no autotuned
    nondeterministic kernels), so the gradient differences are the statistics' own."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        return _agreement(args, device)


def _agreement(
    args: argparse.Namespace, device: torch.device
) -> tuple[list[tuple[str, float, float | None]], float, float]:
    from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes

    data = MultiViewDataModule(
        SyntheticShapes(train_per_class=max(2, args.batch_size // 10 + 1), image_size=args.image_size),
        num_views=args.views,
        batch_size=args.batch_size,
    )
    data.setup()
    views = next(iter(data.train_dataloader()))[0].to(device)
    torch.manual_seed(0)
    module = build(args.backbone, args.views, True).to(device).train()

    def costs(precision: str, autocast: AbstractContextManager) -> tuple[dict[str, float], list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the external head's noise channels: the same draw in every pass
        with autocast:
            objective = module.objective(module.collect(views, precision=precision))
        objective.total.backward()
        gradients = [p.grad.detach().double().flatten() for p in module.backbone.parameters() if p.grad is not None]
        return {name: float(cost) for name, cost in objective.costs.items()}, gradients

    state = {k: v.clone() for k, v in module.state_dict().items()}  # BN statistics move in train mode
    reference, reference_grads = costs("float64", nullcontext())
    module.load_state_dict(state)
    fast, fast_grads = costs("fast", nullcontext())
    module.load_state_dict(state)
    _, repeat_grads = costs("fast", nullcontext())
    module.load_state_dict(state)
    bf16, _ = costs("fast", torch.autocast(device.type, dtype=torch.bfloat16))
    rows = [
        (
            name,
            abs(bf16[name] - fast[name]) / abs(fast[name]),
            None if name == "external" else abs(fast[name] - reference[name]) / abs(reference[name]),
        )
        for name in fast
    ]
    scale = torch.cat(reference_grads).norm()
    difference, repeat = (
        torch.cat(fast_grads) - torch.cat(reference_grads),
        torch.cat(repeat_grads) - torch.cat(fast_grads),
    )
    return rows, float(difference.norm() / scale), float(repeat.norm() / scale)


def fastest_data_path(result: GpuCheckResult, workers: int) -> str:
    """The name (:func:`data_paths`) of the data path that delivered the most views in the data section; the
    training set on the device when the section did not run."""
    labels = {f"data: {label}": name for name, (label, _) in data_paths(workers).items()}
    measured = [(seconds, labels[label]) for label, seconds in result.data_rows if label in labels]
    return min(measured)[1] if measured else "images-on-device"


def training_run(
    args: argparse.Namespace, device: torch.device, max_seconds: float | None = None, data_path_name: str | None = None
) -> TrainingRun:
    """``args.epochs`` epochs of HFMCA-SS(*) on SyntheticShapes with kNN after each (bf16 on CUDA), stopped
    after ``max_seconds`` if given (the check's time budget), on the data path ``data_path_name``."""
    from common import build_method, train_and_measure

    from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes

    per_class = max(1, args.train_images // 10)
    source = SyntheticShapes(
        num_classes=10, train_per_class=per_class, test_per_class=max(2, per_class // 5), image_size=args.image_size
    )
    data_path, options = data_paths(args.workers)[data_path_name or "images-on-device"]
    data = MultiViewDataModule(
        source, num_views=args.views, batch_size=args.batch_size, num_workers=args.workers, **options
    )  # type: ignore[arg-type]
    backbone = "resnet18" if args.backbone == "resnet18" else "small"
    module = build_method("hfmca", backbone, args.views, channels_last=device.type == "cuda")
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    measurement = train_and_measure(
        module,
        data,
        args.epochs,
        k=min(200, per_class * 10),
        accelerator=accelerator,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        linear_epochs=None,
        online_probe=False,
        max_seconds=max_seconds,
    )
    return TrainingRun(
        backbone,
        per_class * 10,
        args.views,
        args.batch_size,
        measurement.epoch_seconds,
        measurement.knn_by_epoch,
        measurement.peak_memory,
        data_path,
    )


def targets(result: GpuCheckResult) -> list[Target]:
    """The targets (bf16, 64 x 9 views of 32 px, channels-last) against the measured rows: the best setting of each
    cost row over the backbone row of the same settings, the fastest data path over the fastest external step, and
    one epoch of 50,000 images at the training run's last epoch's pace."""
    rows = {row.label: row.seconds for row in result.step_rows}
    items = result.items_per_step
    found: list[Target] = []
    for what, limit, goal in (("external", 1.10, 1.05), ("external + internal", 1.6, 1.3)):
        ratios = [
            seconds / base
            for label, seconds in rows.items()
            if label.startswith(f"{what}: ") and seconds and (base := _backbone_seconds(result.step_rows, label))
        ]
        measured = min(ratios) if ratios else None
        found.append(
            Target(
                f"{what} <= {limit:.2f}x the backbone step (goal {goal:.2f}x; best setting)",
                "—" if measured is None else f"{measured:.2f}x",
                None if measured is None else measured <= limit,
            )
        )
    external = [seconds for label, seconds in rows.items() if seconds and label.startswith("external: ")]
    best = min(external) if external else None
    data = min((seconds for _, seconds in result.data_rows), default=None)
    ratio = None if data is None or best is None else best / data
    found.append(
        Target(
            "data path views/s >= 1.2x the external step's",
            "—" if ratio is None else f"{_rate(items, data)} vs {_rate(items, best)} views/s ({ratio:.2f}x)",
            None if ratio is None else ratio >= 1.2,
        )
    )
    run = result.training
    steady = run.steady_epoch() if run is not None else None
    epoch = None if steady is None or run is None else steady * 50_000 / run.images
    found.append(
        Target(
            "one epoch of 50,000 images, HFMCA-SS(*) <= 12 s",
            "—" if epoch is None else f"{epoch:.1f} s",
            None if epoch is None else epoch <= 12.0,
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
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-images", type=int, default=50_000)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument(
        "--train-data",
        choices=["fastest", *data_paths(0)],
        default="fastest",
        help="the training run's data path (default: the fastest of the data section, else the training set on "
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
    if args.tiny:
        args.backbone, args.batch_size, args.steps, args.epochs, args.train_images, args.image_size = (
            "small",
            4,
            1,
            1,
            40,
            16,
        )
        args.workers, args.no_compile = min(args.workers, 1), True
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        build_info = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        print(NO_CUDA_MESSAGE.format(torch=torch.__version__, build=build_info), file=sys.stderr)
        return 2
    start = time.perf_counter()
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.machine()} CPU (script test, not a measurement)"
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    environment = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "CUDA": str(torch.version.cuda),
        "python": platform.python_version(),
        "CPU cores": str(os.cpu_count()),
        **(
            {"GPU memory": f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"}
            if device.type == "cuda"
            else {}
        ),
        "command": "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    views = f"{args.batch_size} images x {args.views} views of {args.image_size} px"
    settings = {"step rows": f"{args.backbone}, {views}, bf16 autocast, {args.steps} rounds"}
    result = GpuCheckResult(name, environment, settings, args.batch_size * args.views)
    path = Path(args.out_dir) / f"gpu-{device_slug(name.split(' (')[0])}.md"
    elapsed = lambda: time.perf_counter() - start  # noqa: E731
    compile_reserve = 0.0 if args.no_compile else 150.0  # seconds kept for the compiled rows, run last

    def section(title: str, work: Callable[[], None], needs: float = 0.0) -> None:
        """Run one part of the check; a failure is reported and the rest goes on. The report is rewritten after
        every section, so a check cut short (a machine's time limit) still leaves the sections that ran."""
        left = args.time_budget - elapsed()
        print(f"[{elapsed():6.1f} s] {title}", flush=True)
        if left < needs:
            result.sections.append(
                (title, f"skipped: {left:.0f} s of the {args.time_budget:.0f} s budget left, needs {needs:.0f} s")
            )
        else:
            began = time.perf_counter()
            try:
                work()
                result.sections.append((title, f"{time.perf_counter() - began:.0f} s"))
            except Exception as error:  # noqa: BLE001 - reported; the other sections still run
                traceback.print_exc()
                first = str(error).splitlines()[0] if str(error) else ""
                result.sections.append(
                    (
                        title,
                        f"**failed** after {time.perf_counter() - began:.0f} s: {type(error).__name__}: {first}"[:300],
                    )
                )
        result.targets = targets(result)
        result.seconds = elapsed()
        write_report(result, path)

    def measure_steps(compiled: bool) -> None:
        rows = step_rows(args, device, autocast, compiled)
        print("\n".join(format_rows(rows, args.batch_size * args.views)), flush=True)
        result.step_rows += rows

    def measure_precision() -> None:
        result.agreement, result.gradient_agreement, result.gradient_repeat = agreement(args, device)

    def measure_data() -> None:
        result.data_rows = data_path_rows(
            args.views, args.batch_size, max(args.steps, 3), args.workers, device, image_size=args.image_size
        )

    def train() -> None:
        path_name = fastest_data_path(result, args.workers) if args.train_data == "fastest" else args.train_data
        result.training = training_run(
            args, device, max_seconds=args.time_budget - elapsed() - compile_reserve, data_path_name=path_name
        )

    chosen = set(args.sections.split(","))
    if chosen - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(chosen - set(SECTIONS))}; choose from {','.join(SECTIONS)}")
    if args.no_compile or "compiled" not in chosen:
        compile_reserve = 0.0
    if "steps" in chosen:
        section("training-step rows", partial(measure_steps, False))
    if "profile" in chosen:
        section(
            "profiles of the external and internal steps (log only)",
            lambda: print(profile_steps(args, device, autocast), flush=True),
        )
    if "precision" in chosen:
        section("precision", measure_precision)
    if "data" in chosen:
        section("data path", measure_data)
    if "training" in chosen:
        section(f"training: {args.epochs} epochs on {args.train_images} images", train, needs=compile_reserve + 30)
    if "compiled" in chosen and not args.no_compile:
        section("training-step rows, compiled", partial(measure_steps, True), needs=60)
    print(path.read_text())
    print(f"[{elapsed():6.1f} s] report written to {path}")
    return 1 if any("failed" in outcome for _, outcome in result.sections) else 0


if __name__ == "__main__":
    sys.exit(main())
