"""Training-step rows timed side by side, so that a drifting machine moves every row alike.

Every row is built and warmed up first (compilation, cuDNN autotuning, allocator growth), then the rows
are timed in interleaved rounds (row 1, row 2, ..., row 1, row 2, ...) and each row reports the median of
its rounds. On CUDA each row also reports the peak memory its step allocates above what was resident
before the step (activations, gradients, workspace). With ``anatomy``, each row then reports what its step
asks of the device: host reads of device values per step (each a wait for the queue on a GPU) and, on CUDA,
kernels launched per step and the GPU-busy fraction (kernel time per step, from a profile, over the row's
median step time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hfmca_lightning.diagnostics import HostReads
from hfmca_lightning.runtime.cpu_memory import keep_freed_memory

Step = Callable[[], object]


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
    """One measured row: ``seconds`` (median per step) or the ``error`` that stopped it."""

    label: str
    seconds: float | None = None
    step_memory_gib: float | None = None
    error: str | None = None
    host_reads: int | None = None
    kernels: float | None = None
    busy_fraction: float | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rows(
    rows: list[tuple[str, Callable[[], Step]]],
    rounds: int,
    device: torch.device,
    warmup: int = 2,
    anatomy: bool = False,
) -> list[StepRow]:
    """Build each ``(label, make_step)`` row, warm it up ``warmup`` times, then time ``rounds`` interleaved rounds
    (and, with ``anatomy``, count each step's host reads, kernels and busy fraction: :func:`step_anatomy`).

    A row whose construction or warm-up raises reports the error's first line and is skipped, so one
    unsupported combination (say ``torch.compile`` with forward hooks on an old PyTorch) does not lose the
    other rows.
    """
    results: list[StepRow] = []
    steps: list[Step | None] = []
    for label, make_step in rows:
        row = StepRow(label)
        results.append(row)
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
            steps.append(step)
        except Exception as error:  # noqa: BLE001 - reported in the table, the other rows go on
            row.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
            steps.append(None)
    samples: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for index, step in enumerate(steps):
            if step is None:
                continue
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            samples[index].append(time.perf_counter() - start)
    for row, times in zip(results, samples):
        if times:
            row.seconds = statistics.median(times)
    if anatomy:
        for row, step in zip(results, steps):
            if step is not None and row.seconds is not None:
                step_anatomy(row, step, device)
    return results


def step_anatomy(row: StepRow, step: Step, device: torch.device, steps: int = 3) -> None:
    """Fill ``row``'s host reads per step (one step under :class:`HostReads`) and, on CUDA, kernels per step and the
    busy fraction: device time of the kernels of ``steps`` profiled steps (CUPTI) over ``steps`` times the row's
    median step time (timed without the profiler)."""
    with HostReads() as recorder:
        step()
    _sync(device)
    row.host_reads = len(recorder.reads)
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
    row.kernels = len(kernels) / steps
    busy = sum(event.time_range.elapsed_us() for event in kernels) / 1e6 / steps
    row.busy_fraction = min(1.0, busy / row.seconds)


def format_rows(rows: list[StepRow], items: int, unit: str = "views/s") -> list[str]:
    """Text lines: rate, time, ratio to the first row (or the error), and step memory on CUDA."""
    base = rows[0].seconds
    lines = []
    for row in rows:
        if row.seconds is None:
            lines.append(f"  {row.label:58s} failed: {row.error}")
            continue
        ratio = f"x{row.seconds / base:5.2f} time of first row" if base else ""
        memory = f"   step memory {row.step_memory_gib:6.2f} GiB" if row.step_memory_gib is not None else ""
        lines.append(
            f"  {row.label:58s} {items / row.seconds:12,.0f} {unit}   {row.seconds * 1000:9.1f} ms   {ratio}{memory}"
        )
    return lines
