"""Fitting the roofline's two constants to the measured step rows of a ``make gpu-check`` report
(``python benchmarks/roofline.py --calibrate``).

A step's prediction is linear in the two constants: ``T = floor * K + W / e`` with ``K`` its kernels and ``W`` the
sum over its kernels of ``max(FLOPs / peak, bytes / bandwidth)`` at the full peak rates. They are fitted by least
squares on the relative errors of the rows, ``sum_r ((floor K_r + W_r / e) / T_r - 1)^2``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .gpus import GPUS, Calibration, gpu_key
from .predict import operation_cost, predict
from .steps import trace_rows_of_checkout
from .trace import Trace

_FULL_PEAK = Calibration(efficiency=1.0, launch_floor=0.0, fitted_on="")


def work_and_kernels(trace: Trace) -> tuple[float, int]:
    """``(W, K)``: seconds of the step's GPU kernels at the full peak rates, and their number."""
    work, kernels = 0.0, 0
    for operation in trace.operations:
        if operation.on_gpu and operation.transfer is None:
            work += operation_cost(operation, trace.gpu, _FULL_PEAK)
            kernels += operation.kernels
    return work, kernels


def fit(rows: dict[str, tuple[float, int, float]]) -> tuple[float, float]:
    """``(efficiency, launch_floor)`` from ``{row: (W, K, measured seconds)}`` (relative least squares; an efficiency
    above 1, faster than the peak rates, is held at 1 and the floor fitted alone).

    Raises:
        ValueError: with fewer than two rows, or rows that no positive efficiency fits.
    """
    if len(rows) < 2:
        raise ValueError(f"fitting two constants needs at least two measured step rows; got {len(rows)}")
    sxx = sxy = syy = sx = sy = 0.0
    for work, kernels, measured in rows.values():
        x, y = kernels / measured, work / measured
        sxx, sxy, syy, sx, sy = sxx + x * x, sxy + x * y, syy + y * y, sx + x, sy + y
    determinant = sxx * syy - sxy * sxy
    floor = (sx * syy - sy * sxy) / determinant if determinant > 0 else -1.0
    inverse_efficiency = (sxx * sy - sxy * sx) / determinant if determinant > 0 else 0.0
    if floor < 0:  # no launch floor (or rows that cannot tell one from the work): the work alone
        floor, inverse_efficiency = 0.0, sy / syy
    if not inverse_efficiency > 0:
        raise ValueError("the measured rows fit no positive efficiency (a row faster than its work allows?)")
    if inverse_efficiency < 1:  # faster than the peak rates: the peak rates, and the floor fitted alone
        inverse_efficiency = 1.0
        floor = max(0.0, (sx - sxy) / sxx)
    return 1.0 / inverse_efficiency, floor


ROWS = (
    "backbone alone: plain",
    "backbone alone: channels_last",
    "external: plain",
    "external: channels_last",
    "external + internal: plain",
    "external + internal: channels_last",
)


def measured_rows(report: str) -> tuple[str, dict[str, float]]:
    """The GPU's name and the milliseconds per step of the six step rows (:data:`ROWS`) of a ``make gpu-check``
    report (``docs/benchmarks/gpu-<device>.md``): the ``ms / step`` column of its training-step table."""
    lines = report.splitlines()
    name = lines[0].removeprefix("# GPU check: ").strip() if lines else "an empty report"
    header = next((line for line in lines if line.startswith("| row |") and "ms / step" in line), None)
    if header is None:
        raise ValueError(f"the report of {name} has no training-step table (a '| row | ... ms / step' header)")
    column = [cell.strip() for cell in header.strip("|").split("|")].index("ms / step")
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ROWS and cells[column]:
            rows[cells[0]] = float(cells[column].replace(",", ""))
    return name, rows


def calibration_lines(report: Path, commit: str) -> tuple[list[str], dict[str, Any]]:
    """Trace the step rows of the code on the import path (a checkout of ``commit``, the commit the report measured)
    on the report's GPU, fit the constants to the report's six step rows, and the table of measured against predicted
    rows.

    Raises:
        ValueError: when the roofline does not model the report's GPU, the report has no step rows, or they fit no
            constants.
    """
    device, measured_ms = measured_rows(report.read_text())
    key = gpu_key(device)
    if key is None:
        raise ValueError(f"{report} measured {device}, which the roofline does not model")
    gpu = GPUS[key]
    traces = trace_rows_of_checkout(gpu)
    rows = {name: (*work_and_kernels(traces[name]), ms / 1e3) for name, ms in measured_ms.items()}
    efficiency, floor = fit(rows)
    source = f"{report.name}, code of commit {commit}"
    fitted = Calibration(efficiency, floor, f"fitted on the step rows of {source}")
    lines = [
        f"# Calibration on {device} ({source})",
        "",
        f"Fitted: efficiency {efficiency:.3f} of the peak rates, launch floor {floor * 1e6:.2f} us per kernel.",
        "",
        "| row | kernels | GB moved | TFLOP | measured ms | predicted ms | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    data: dict[str, Any] = {"efficiency": efficiency, "launch_floor": floor, "rows": {}}
    for name, ms in measured_ms.items():
        prediction = predict(traces[name], fitted)
        total = prediction.totals
        error = prediction.milliseconds / ms - 1
        lines.append(
            f"| {name} | {total.kernels:,.0f} | {total.bytes / 1e9:.1f} | {total.flops / 1e12:.2f} | {ms:.1f} | "
            f"{prediction.milliseconds:.1f} | {error:+.0%} |"
        )
        data["rows"][name] = {"measured_ms": ms, "predicted_ms": prediction.milliseconds}
    return lines, data
