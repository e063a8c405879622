"""What ``make gpu-check`` measures: the sections, the rows' labels, the results and the targets they are held to."""

from __future__ import annotations

from dataclasses import dataclass, field

from step_timing import StepRow
from throughput import DataRow

SECTIONS = ("tests", "steps", "compiled", "precision", "data", "training", "profile")


# Seconds a section needs at least to start on a GPU (``--tiny``: a tenth); the steps include the roofline's
# prediction of their rows (~10 s of tracing on the host's CPU).
NEEDS = {"tests": 30, "steps": 30, "compiled": 40, "precision": 10, "data": 20, "training": 60, "profile": 10}


CUDA_TESTS = ["-m", "pytest", "-m", "cuda", "tests/cuda", "-q", "-p", "no:cacheprovider"]


CIFAR_EPOCH = 50_000


BACKBONE = "backbone alone: "


EXTERNAL = "external: "


INTERNAL = "external + internal: "


BEFOREHAND = "external, views drawn beforehand: channels_last"


IN_STEP = "external, views drawn in the step"


COMPILED_COSTS = " + compiled costs"


# The drawers that draw views inside the step (names of throughput.data_paths) and their row labels.
IN_STEP_PATHS = {
    "resident": "ResidentDrawer",
    "resident-8": "ResidentDrawer, 8 batches per call",
    "batched-device": "BatchedDrawer on device",
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
    """Relative differences of one cost: bf16 autocast vs float32, the fast / tf32x3 statistics vs float64, and the
    configs' ``auto`` statistics vs float64 of the same maps under bf16 autocast (None for the external cost, whose
    statistics have no precision
    setting)."""

    name: str
    bf16: float
    fast: float | None
    tf32x3: float | None
    auto_statistics: float | None = None


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
    predicted: dict[str, float] = field(default_factory=dict)
    """Predicted milliseconds per step by row label (benchmarks/roofline.py --rows), for ``predicted_for``."""
    predicted_for: str = ""
    prediction_failure: str = ""
    """Why the step rows have no prediction when the roofline ran and failed (one line)."""


def fastest_backbone(rows: list[StepRow]) -> StepRow | None:
    """The fastest measured backbone-alone row of the run (the denominator of every ratio)."""
    return min(
        (row for row in rows if row.label.startswith(BACKBONE) and row.seconds),
        key=lambda row: row.seconds or 0.0,
        default=None,
    )


def fastest(rows: list[StepRow], prefix: str) -> StepRow | None:
    return min(
        (row for row in rows if row.label.startswith(prefix) and row.seconds),
        key=lambda row: row.seconds or 0.0,
        default=None,
    )


def count(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if float(value).is_integer() or not digits else f"{value:.{digits}f}"


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
        best = fastest(rows, prefix)
        ratio = best.seconds / base.seconds if best and best.seconds and base and base.seconds else None
        name = f"{what} <= {limit:.2f}x" + (f" (goal {goal:.2f}x)" if goal else "")
        measured = "—" if ratio is None else f"{ratio:.2f}x ({best.label} / {base.label})"  # type: ignore[union-attr]
        found.append(Target(name, measured, None if ratio is None else ratio <= limit))
    reference = next((row for row in rows if row.label == BEFOREHAND and row.seconds), None)
    in_step = fastest(rows, IN_STEP)
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
    worst = max(counted, key=lambda row: row.host_syncs or 0.0, default=None)
    if worst is None:
        measured = "—"
    elif not worst.host_syncs:
        measured = f"0 in all {len(counted)} step rows"
    else:
        syncing = [row for row in counted if row.host_syncs]
        measured = f"{count(worst.host_syncs, 2)} ({worst.label}; {len(syncing)} of {len(counted)} rows sync)"
    found.append(
        Target(
            f"host syncs per training step ({result.sync_counter}) = 0",
            measured,
            None if worst is None else not worst.host_syncs,
        )
    )
    return found
