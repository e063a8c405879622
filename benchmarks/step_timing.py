"""Training-step rows timed side by side, so that a drifting machine moves every row alike.

Every row is built and warmed up first (compilation, cuDNN autotuning, allocator growth), then the rows
are timed in interleaved rounds (row 1, row 2, ..., row 1, row 2, ...) and each row reports the median of
its rounds. On CUDA each row also reports the peak memory its step allocates above what was resident
before the step (activations, gradients, workspace).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hfmca_lightning.cpu_memory import keep_freed_memory

Step = Callable[[], object]


def add_malloc_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--default-malloc", action="store_true",
        help="keep glibc's default malloc (hfmca sets it to keep freed memory: hfmca_lightning.cpu_memory)",
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rows(
    rows: list[tuple[str, Callable[[], Step]]], rounds: int, device: torch.device, warmup: int = 2
) -> list[StepRow]:
    """Build each ``(label, make_step)`` row, warm it up ``warmup`` times, then time ``rounds`` interleaved rounds.

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
    return results


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
        lines.append(f"  {row.label:58s} {items / row.seconds:12,.0f} {unit}   {row.seconds * 1000:9.1f} ms   {ratio}{memory}")
    return lines
