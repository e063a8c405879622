"""The Markdown report of ``make gpu-check`` (``docs/benchmarks/gpu-<device>.md``)."""

from __future__ import annotations

import re
from pathlib import Path

from gpu_check.results import (
    CUDA_TESTS,
    EXTERNAL,
    CudaTests,
    GpuCheckResult,
    TrainingRun,
    count,
    fastest,
    fastest_backbone,
)


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
        "step. GPU busy: kernel time per step (profiled) over the step's median time. Predicted: "
        + _prediction_note(result),
        "",
        "| row | views/s | ms / step | predicted ms | predicted / measured | vs fastest backbone row | "
        "step memory (GiB) | host syncs | kernels | GPU busy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result.step_rows:
        predicted = result.predicted.get(row.label)
        expected = "—" if predicted is None else f"{predicted:.1f}"
        if row.seconds is None:
            why = f"skipped: {row.skipped}" if row.skipped else f"failed: {row.error}"
            lines.append(f"| {row.label} | {why} | | {expected} | | | | | | |")
            continue
        error = "—" if predicted is None else f"{predicted / (row.seconds * 1000):.2f}"
        ratio = f"{row.seconds / base.seconds:.2f}x" if base and base.seconds else "—"
        memory = f"{row.step_memory_gib:.2f}" if row.step_memory_gib is not None else "—"
        busy = "—" if row.busy_fraction is None else f"{row.busy_fraction:.0%}"
        lines.append(
            f"| {row.label} | {_rate(result.items_per_step, row.seconds)} | {row.seconds * 1000:.1f} | {expected} | "
            f"{error} | {ratio} | {memory} | {count(row.host_syncs, 2)} | {count(row.kernels)} | {busy} |"
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
            f"| {row.label} | {count(row.graphs)} | {count(row.recompiles)} | {count(row.cudagraph_skips)} |"
            for row in compiled
        ]
    return lines


def _prediction_note(result: GpuCheckResult) -> str:
    """What the step table's predicted columns hold."""
    if result.predicted_for:
        return (
            f"the roofline's milliseconds per step for the {result.predicted_for} (benchmarks/roofline.py --rows; "
            "predicted / measured is the tracer's error on this GPU)."
        )
    if result.prediction_failure:
        return f"none (the roofline failed: {result.prediction_failure})."
    return "none (the roofline models no GPU of this name)."


def _precision_lines(result: GpuCheckResult) -> list[str]:
    lines = [
        "",
        "## Precision",
        "",
        "| cost | bf16 vs float32 (relative) | fast vs float64 statistics | tf32x3 vs float64 statistics | "
        "auto vs float64 statistics (bf16 autocast) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in result.agreement:
        values = (row.fast, row.tf32x3, row.auto_statistics)
        fast, split, auto = ("—" if value is None else f"{value:.2e}" for value in values)
        lines.append(f"| {row.name} | {row.bf16:.2e} | {fast} | {split} | {auto} |")
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
    external = fastest(result.step_rows, EXTERNAL)
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
