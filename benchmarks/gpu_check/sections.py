"""The measuring sections of ``make gpu-check``: the cuda tests, the training-step rows, the kernel profiles, the
precision agreement, the data paths and the training runs."""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, closing, nullcontext
from functools import partial
from typing import Any

import torch
from step_timing import Step, StepRow, measure_rows, repeated
from throughput import build, data_paths, training_step, view_stream

from gpu_check.results import (
    BACKBONE,
    BEFOREHAND,
    COMPILED_COSTS,
    CUDA_TESTS,
    EXTERNAL,
    IN_STEP,
    IN_STEP_PATHS,
    INTERNAL,
    AgreementRow,
    CudaTests,
    GpuCheckResult,
    TrainingRun,
)

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


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
        # wide lines: pytest's summary keeps each failure's message only where the terminal has room for it
        environment = {**os.environ, "COLUMNS": "300"}
        done = subprocess.run(
            [sys.executable, *CUDA_TESTS], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environment
        )
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
    external channels-last step with its views drawn inside the step by each device drawer, and the same step on
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
    """The external channels-last step on views drawn beforehand (by ``ResidentDrawer``), and on views drawn inside
    the step by each device drawer (its loader's next batch, moved to the device and drawn there, as Lightning's
    ``on_after_batch_transfer`` does); a drawer that draws several batches per call is timed over that many steps.
    The loaders are closed with ``open_loaders``."""
    from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
    from hfmca_lightning.evaluation_data import view_batches

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
            source,
            views=SimCLRViews(count=args.views),
            drawer=paths["resident"].make(),
            batch_size=args.batch_size,
            num_workers=0,
        )
        data.setup()
        (first,) = view_batches(data, device, limit=1)
        drawn = first.groups[0]
        return training_step(module(), drawn, True, autocast, update=True)

    def in_step(name: str) -> Step:
        path = paths[name]
        data = MultiViewDataModule(
            source,
            views=SimCLRViews(count=args.views),
            drawer=path.make(),
            batch_size=args.batch_size,
            num_workers=args.workers,
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
    """Relative differences of every cost: bf16 autocast vs float32, fast and tf32x3 vs float64 internal statistics,
    and the statistics the configs run (``auto``) vs float64 of the same maps under bf16 autocast (``bf16`` where both
    maps are bf16), with the backbone-gradient differences of each (and of the fast pass run twice: the floor), on one
    batch of real augmented views. cuDNN runs deterministic float32 convolutions here (no TF32, no autotuned
    nondeterministic kernels), so the gradient differences are the statistics' own."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        return _agreement(args, device)


def _agreement(args: argparse.Namespace, device: torch.device) -> tuple[list[AgreementRow], dict[str, float]]:
    from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
    from hfmca_lightning.evaluation_data import view_batches

    data = MultiViewDataModule(
        SyntheticShapes(train_per_class=max(2, args.batch_size // 10 + 1), image_size=args.image_size),
        views=SimCLRViews(count=args.views),
        batch_size=args.batch_size,
        num_workers=0,
    )
    data.setup()
    (first,) = view_batches(data, device, limit=1)
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
    bf16 = torch.autocast(device.type, dtype=torch.bfloat16)
    passes = {}
    for name, precision, autocast in (
        ("float64", "float64", nullcontext()),
        ("fast", "fast", nullcontext()),
        ("fast twice", "fast", nullcontext()),
        ("tf32x3", "tf32x3", nullcontext()),
        ("bf16", "fast", bf16),
        ("float64 of bf16 maps", "float64", bf16),
        ("auto statistics", "auto", bf16),
    ):
        module.load_state_dict(state)
        passes[name] = costs(precision, autocast)
    (reference, reference_grads), (fast, fast_grads) = passes["float64"], passes["fast"]
    bf16_reference, bf16_reference_grads = passes["float64 of bf16 maps"]

    def relative(values: dict[str, float], name: str, against: dict[str, float] = reference) -> float | None:
        return None if name == "external" else abs(values[name] - against[name]) / abs(against[name])

    rows = [
        AgreementRow(
            name,
            abs(passes["bf16"][0][name] - fast[name]) / abs(fast[name]),
            relative(fast, name),
            relative(passes["tf32x3"][0], name),
            relative(passes["auto statistics"][0], name, bf16_reference),
        )
        for name in fast
    ]
    scale = reference_grads.norm()
    gradients = {
        "fast": float((fast_grads - reference_grads).norm() / scale),
        "tf32x3": float((passes["tf32x3"][1] - reference_grads).norm() / scale),
        "fast twice": float((passes["fast twice"][1] - fast_grads).norm() / scale),
        "auto statistics (bf16 autocast)": float(
            (passes["auto statistics"][1] - bf16_reference_grads).norm() / bf16_reference_grads.norm()
        ),
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
    from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes

    per_class = max(1, args.train_images // 10)
    source = SyntheticShapes(
        num_classes=10, train_per_class=per_class, test_per_class=max(2, per_class // 5), image_size=args.image_size
    )
    cuda = device.type == "cuda"
    path = data_paths(args.workers, "bfloat16" if cuda else "float32", cuda)[data_path_name or "resident"]
    data = MultiViewDataModule(
        source,
        views=SimCLRViews(count=args.views),
        drawer=path.make(),
        batch_size=args.batch_size,
        eval_batch_size=512,
        num_workers=args.workers,
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
