"""Tables of predicted steps: the phases of one step, its costliest operations, the GPU targets, the calibration."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .predict import Prediction


def phase_table(prediction: Prediction) -> list[str]:
    """Per phase: kernels, GB moved, GFLOP, predicted ms and share of the step."""
    total = prediction.totals
    lines = [
        "| phase | kernels | GB moved | GFLOP | predicted ms | share |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, phase in sorted(prediction.phases.items(), key=lambda item: -item[1].seconds):
        lines.append(
            f"| {name} | {phase.kernels:,.0f} | {phase.bytes / 1e9:.2f} | {phase.flops / 1e9:,.1f} | "
            f"{phase.seconds * 1e3:.2f} | {phase.seconds / total.seconds:.0%} |"
        )
    lines.append(
        f"| **step** | **{total.kernels:,.0f}** | **{total.bytes / 1e9:.2f}** | **{total.flops / 1e9:,.1f}** | "
        f"**{total.seconds * 1e3:.2f}** | 100% |"
    )
    return lines


def hot_spot_table(prediction: Prediction) -> list[str]:
    """The operations costing most, summed by operation and source line."""
    lines = ["| operation | source | kernels | GB | GFLOP | ms |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, source, kernels, gigabytes, gigaflops, milliseconds in prediction.hot_spots:
        lines.append(
            f"| {name} | {source} | {kernels:,.0f} | {gigabytes:.2f} | {gigaflops:,.1f} | {milliseconds:.2f} |"
        )
    return lines


def summary_line(label: str, prediction: Prediction) -> str:
    total = prediction.totals
    syncs = prediction.host_syncs_per_step
    averaged = f" (the mean of {prediction.steps} steps)" if prediction.steps > 1 else ""
    copies = prediction.transfer_seconds * 1e3
    overlapped = f"; host-device copies {copies:.2f} ms beside it (copy engine)" if copies >= 0.005 else ""
    return (
        f"{label}: {total.kernels:,.0f} kernels, {total.bytes / 1e9:.1f} GB moved, {total.flops / 1e12:.2f} TFLOP, "
        f"{prediction.milliseconds:.1f} ms predicted{averaged}; {syncs:g} host syncs per step{overlapped}"
    )


@dataclass(frozen=True)
class Target:
    name: str
    limit: str
    predicted: str
    met: bool | None


def target_table(targets: Sequence[Target]) -> list[str]:
    lines = ["| target | limit | predicted | met |", "| --- | --- | ---: | --- |"]
    for target in targets:
        met = "—" if target.met is None else "yes" if target.met else "**no**"
        lines.append(f"| {target.name} | {target.limit} | {target.predicted} | {met} |")
    return lines
