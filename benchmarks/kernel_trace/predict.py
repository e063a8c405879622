"""Predicted GPU time of a traced step: each kernel as the larger of its arithmetic at the peak rate of its dtype and
its bytes at the memory bandwidth, both at the calibrated fraction of peak, plus a launch floor per kernel."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .gpus import CALIBRATION, GRAPH_KERNEL_FLOOR, Calibration, GPUSpec
from .recorder import Operation
from .trace import Trace


def operation_cost(operation: Operation, gpu: GPUSpec, calibration: Calibration = CALIBRATION) -> float:
    """Predicted seconds of one operation, ``kernels * floor + max(flops / (e * peak[rate]), bytes / (e * bandwidth))``,
    the floor of a kernel replayed in a CUDA graph :data:`~.gpus.GRAPH_KERNEL_FLOOR`; host-device copies over the host
    link (on their own copy engine: they overlap the step and are reported apart)."""
    if operation.transfer is not None:
        return operation.bytes / 2 / gpu.host_link
    compute = operation.flops / (calibration.efficiency * gpu.peak(operation.rate))
    memory = operation.bytes / (calibration.efficiency * gpu.bandwidth)
    floor = operation.kernels * (GRAPH_KERNEL_FLOOR if operation.in_graph else calibration.launch_floor)
    return floor + max(compute, memory)


@dataclass
class PhaseTotals:
    kernels: float = 0
    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0

    def per_step(self, steps: int) -> PhaseTotals:
        return PhaseTotals(self.kernels / steps, self.flops / steps, self.bytes / steps, self.seconds / steps)


@dataclass
class Prediction:
    """The predicted step: totals, per phase, per source line."""

    gpu: GPUSpec
    calibration: Calibration
    totals: PhaseTotals
    phases: dict[str, PhaseTotals]
    hot_spots: list[tuple[str, str, float, float, float, float]]  # (operation, source, kernels, GB, GFLOP, ms)
    host_syncs: list[tuple[str, str]]  # of all the traced steps
    transfer_seconds: float  # host-device copies per step, on the copy engine beside the step
    steps: int = 1

    @property
    def host_syncs_per_step(self) -> float:
        return len(self.host_syncs) / self.steps

    @property
    def milliseconds(self) -> float:
        return self.totals.seconds * 1e3

    def phase_milliseconds(self, prefix: str) -> float:
        return 1e3 * sum(totals.seconds for name, totals in self.phases.items() if name.startswith(prefix))


def predict(trace: Trace, calibration: Calibration = CALIBRATION, top: int = 15) -> Prediction:
    """The step's predicted time on ``trace.gpu``, per traced step: GPU operations only (host-side work, such as views
    drawn in the main process, runs on the CPU; host-device copies overlap the step on the copy engines)."""
    totals = PhaseTotals()
    phases: dict[str, PhaseTotals] = defaultdict(PhaseTotals)
    spots: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    transfer = 0.0
    for operation in trace.operations:
        if not operation.on_gpu:
            continue
        seconds = operation_cost(operation, trace.gpu, calibration)
        if operation.transfer is not None:
            transfer += seconds
            continue
        for bucket in (totals, phases[operation.phase]):
            bucket.kernels += operation.kernels
            bucket.flops += operation.flops
            bucket.bytes += operation.bytes
            bucket.seconds += seconds
        spot = spots[(operation.name, operation.source)]
        spot[0] += operation.kernels
        spot[1] += operation.bytes
        spot[2] += operation.flops
        spot[3] += seconds
    hottest = sorted(spots.items(), key=lambda item: -item[1][3])[:top]
    n = trace.steps
    return Prediction(
        trace.gpu,
        calibration,
        totals.per_step(n),
        {name: phase.per_step(n) for name, phase in phases.items()},
        [(name, source, k / n, b / 1e9 / n, f / 1e9 / n, s * 1e3 / n) for (name, source), (k, b, f, s) in hottest],
        trace.host_syncs,
        transfer / n,
        n,
    )
