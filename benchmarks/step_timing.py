"""Training-step rows timed side by side, so that a drifting machine moves every row alike.

Every row is built and warmed up first (compilation, cuDNN autotuning, allocator growth), then the rows
are timed in interleaved rounds (row 1, row 2, ..., row 1, row 2, ...) and each row reports the median of
its rounds. On CUDA each row also reports the peak memory its step allocates above what was resident
before the step (activations, gradients, workspace). With ``anatomy``, each row then reports what its step
asks of the device: host synchronisations per step (on CUDA the warnings of CUDA's sync debug mode, on other
devices the device values read on the host, :class:`~hfmca_lightning.diagnostics.HostReads`) and, on CUDA,
kernels launched per step and the GPU-busy fraction (kernel time per step, from a profile, over the row's
median step time). With ``compilation``, each row counts the graphs TorchDynamo compiled while it was built and
warmed up, those it compiled later (recompilations) and the CUDA graphs inductor skipped.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hfmca_lightning.diagnostics import HostReads
from hfmca_lightning.runtime.cpu_memory import keep_freed_memory

Step = Callable[[], object]
SYNC_WARNING = "synchronizing CUDA operation"  # what CUDA's sync debug mode ("warn") says at each synchronisation


def add_malloc_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's default malloc (hfmca sets it to keep freed memory: hfmca_lightning.runtime.cpu_memory)",
    )


def set_malloc(args: argparse.Namespace) -> str:
    """Set malloc as the ``hfmca`` command does unless ``--default-malloc``; returns the setting, for the header."""
    if not args.default_malloc and keep_freed_memory():
        return "malloc keeps freed memory (as hfmca does)"
    return "default malloc"


@dataclass
class StepRow:
    """One row: ``seconds`` (median per training step), or the ``error`` that stopped it, or why it was ``skipped``.

    ``host_syncs`` and ``kernels`` are per training step; ``graphs`` / ``recompiles`` / ``cudagraph_skips`` are
    counted only for rows measured with ``compilation``."""

    label: str
    seconds: float | None = None
    step_memory_gib: float | None = None
    error: str | None = None
    host_syncs: float | None = None
    kernels: float | None = None
    busy_fraction: float | None = None
    skipped: str | None = None
    graphs: int | None = None
    recompiles: int | None = None
    cudagraph_skips: int | None = None


def repeated(step: Step, count: int) -> Step:
    """``count`` training steps per call (rows whose work comes in chunks, e.g. views drawn for several batches at
    once): :func:`measure_rows` divides the call's time by ``count``."""

    def steps() -> None:
        for _ in range(count):
            step()

    steps.steps_per_call = count  # type: ignore[attr-defined]
    return steps


def _steps_per_call(step: Step) -> int:
    return int(getattr(step, "steps_per_call", 1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compile_counters() -> tuple[int, int]:
    """TorchDynamo's graphs compiled so far and inductor's CUDA-graph skips, process-wide."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(counters["inductor"]["cudagraph_skips"])


def measure_rows(
    rows: list[tuple[str, Callable[[], Step]]],
    rounds: int,
    device: torch.device,
    warmup: int = 2,
    anatomy: bool = False,
    compilation: bool = False,
    deadline: float | None = None,
) -> list[StepRow]:
    """Build each ``(label, make_step)`` row, warm it up ``warmup`` times, then time ``rounds`` interleaved rounds
    (and, with ``anatomy``, count each step's host synchronisations, kernels and busy fraction: :func:`step_anatomy`).

    A row whose construction or warm-up raises reports the error's first line and is skipped, so one
    unsupported combination (say ``torch.compile`` with forward hooks on an old PyTorch) does not lose the
    other rows. Rows not yet built when ``deadline`` (a ``time.perf_counter()`` value) has passed are skipped with
    that reason.
    """
    results: list[StepRow] = []
    steps: list[Step | None] = []
    for label, make_step in rows:
        row = StepRow(label)
        results.append(row)
        steps.append(None)
        if deadline is not None and time.perf_counter() > deadline:
            row.skipped = "the time budget ran out before this row"
            continue
        before = _compile_counters() if compilation else (0, 0)
        try:
            step = make_step()
            for _ in range(max(1, warmup)):
                step()
            _sync(device)
            if device.type == "cuda":
                resident = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                step()
                _sync(device)
                row.step_memory_gib = (torch.cuda.max_memory_allocated(device) - resident) / 2**30
            steps[-1] = step
        except Exception as error:  # noqa: BLE001 - reported in the table, the other rows go on
            row.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        if compilation:
            graphs, skips = _compile_counters()
            row.graphs, row.recompiles, row.cudagraph_skips = graphs - before[0], 0, skips - before[1]
    samples: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for index, timed_step in enumerate(steps):
            if timed_step is None:
                continue
            before = _compile_counters() if compilation else (0, 0)
            _sync(device)
            start = time.perf_counter()
            timed_step()
            _sync(device)
            samples[index].append((time.perf_counter() - start) / _steps_per_call(timed_step))
            if compilation:
                graphs, skips = _compile_counters()
                row = results[index]
                row.recompiles = (row.recompiles or 0) + graphs - before[0]
                row.cudagraph_skips = (row.cudagraph_skips or 0) + skips - before[1]
    for row, times in zip(results, samples):
        if times:
            row.seconds = statistics.median(times)
    if anatomy:
        for row, built in zip(results, steps):
            if built is not None and row.seconds is not None:
                try:
                    # compiled code does not run under a dispatch mode: no HostReads count of compiled rows off CUDA
                    step_anatomy(row, built, device, count_reads=not compilation or device.type == "cuda")
                except Exception as error:  # noqa: BLE001 - the row keeps its time; the anatomy says what failed
                    row.error = f"anatomy: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return results


def host_syncs(step: Step, device: torch.device) -> int:
    """Host synchronisations of one call of ``step``: on CUDA the warnings CUDA's sync debug mode issues (the mode
    is restored afterwards), elsewhere the device values read on the host (:class:`HostReads`)."""
    if device.type != "cuda":
        with HostReads() as recorder:
            step()
        return len(recorder.reads)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    _sync(device)
    return sum(SYNC_WARNING in str(warning.message) for warning in caught)


def step_anatomy(row: StepRow, step: Step, device: torch.device, steps: int = 3, count_reads: bool = True) -> None:
    """Fill ``row``'s host synchronisations per step (:func:`host_syncs` of one call; off CUDA only with
    ``count_reads``) and, on CUDA, kernels per step and the busy fraction: device time of the kernels of ``steps``
    profiled calls (CUPTI) over the row's median step time (timed without the profiler)."""
    per_call = _steps_per_call(step)
    if count_reads:
        row.host_syncs = host_syncs(step, device) / per_call
    if device.type != "cuda" or row.seconds is None:
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            step()
        _sync(device)
    kernels = [
        event
        for event in profiler.events()
        if event.device_type == DeviceType.CUDA and not event.name.startswith(("Memcpy", "Memset"))
    ]
    row.kernels = len(kernels) / steps / per_call
    busy = sum(event.time_range.elapsed_us() for event in kernels) / 1e6 / steps / per_call
    row.busy_fraction = min(1.0, busy / row.seconds)


def format_rows(rows: list[StepRow], items: int, unit: str = "views/s") -> list[str]:
    """Text lines: rate, time, ratio to the first row (or the error), and step memory on CUDA."""
    base = rows[0].seconds
    lines = []
    for row in rows:
        if row.seconds is None:
            why = f"skipped: {row.skipped}" if row.skipped else f"failed: {row.error}"
            lines.append(f"  {row.label:58s} {why}")
            continue
        ratio = f"x{row.seconds / base:5.2f} time of first row" if base else ""
        memory = f"   step memory {row.step_memory_gib:6.2f} GiB" if row.step_memory_gib is not None else ""
        lines.append(
            f"  {row.label:58s} {items / row.seconds:12,.0f} {unit}   {row.seconds * 1000:9.1f} ms   {ratio}{memory}"
        )
    return lines
