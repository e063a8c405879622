"""`make gpu-check` (benchmarks/gpu_check): refuses without CUDA, runs every section end to end on the CPU at tiny
sizes without the packages GPU machines may lack, and writes a report whose numbers follow from the measurements."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import (  # noqa: E402
    BEFOREHAND,
    AgreementRow,
    GpuCheckResult,
    Target,
    TrainingRun,
    device_slug,
    parse_pytest,
    targets,
    write_report,
)
from step_timing import StepRow  # noqa: E402
from throughput import DataRow  # noqa: E402

# What a GPU machine without network may lack.
MISSING_ON_GPU_MACHINES = ("jsonargparse", "wandb", "lightly")

BLOCKING_RUNNER = """
import importlib.abc, runpy, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {missing!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Missing())
sys.argv = ["benchmarks/gpu_check"] + sys.argv[1:]
runpy.run_path("benchmarks/gpu_check", run_name="__main__")
"""

IN_STEP = "external, views drawn in the step"


def table(text: str, heading: str) -> dict[str, list[str]]:
    """The cells of the first Markdown table after the line ``heading`` (else the first line that starts with it),
    by the first cell of each row."""
    lines = text.splitlines()
    found = [i for i, line in enumerate(lines) if line == heading] or [
        i for i, line in enumerate(lines) if line.startswith(heading)
    ]
    lines = lines[found[0] + 1 :]
    start = next(index for index, line in enumerate(lines) if line.startswith("| "))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_without_cuda_it_says_so_and_exits_non_zero(tmp_path: Path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", f"GPU_CHECK_ARGS=--out-dir {tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "CUDA is not available" in result.stderr and "never silently measures the CPU" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no report of CPU numbers


@pytest.mark.extended
def test_every_section_runs_on_the_cpu_without_the_packages_gpu_machines_may_lack(tmp_path: Path):
    runner = BLOCKING_RUNNER.format(missing=set(MISSING_ON_GPU_MACHINES))
    result = subprocess.run(
        [sys.executable, "-c", runner, "--device", "cpu", "--tiny", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (report,) = tmp_path.glob("gpu-*.md")
    text = report.read_text()
    sections = re.findall(r"^- section (.+): (.+?)$", text, flags=re.MULTILINE)
    assert [name for name, _ in sections] == [
        "cuda tests",
        "training-step rows",
        "training-step rows, compiled",
        "precision",
        "data path",
        "training: 1 epochs on 40 images",
        "profiles of the external and internal steps (log only)",
    ]
    assert all(re.fullmatch(r"\d+ s", outcome) for _, outcome in sections), sections
    for heading in ("## Targets", "## CUDA tests", "## Training step", "## Precision", "## Data path", "## Training"):
        assert f"\n{heading}" in text

    # Without CUDA the cuda tests are all skipped, and the report says so.
    command = "`python -m pytest -m cuda tests/cuda -q -p no:cacheprovider`"
    assert re.search(re.escape(command) + r": 0 passed, 0 failed, \d+ skipped", text)
    assert "All skipped: needs a CUDA GPU" in text

    steps = table(text, "## Training step (16 views per step; medians of interleaved rounds)")
    measured = [
        "backbone alone: plain",
        "backbone alone: channels_last",
        "external: plain",
        "external: channels_last",
        "external + internal: plain",
        "external + internal: channels_last",
        BEFOREHAND,
        f"{IN_STEP} (ResidentDrawer): channels_last",
        f"{IN_STEP} (ResidentDrawer, 8 batches per call): channels_last",
        f"{IN_STEP} (BatchedDrawer on device): channels_last",
        "backbone alone: compiled + channels_last",
        "external: compiled + channels_last",
        "external: channels_last + compiled costs",
        "external + internal: compiled + channels_last",
        "external + internal: channels_last + compiled costs",
    ]
    for row in measured:
        assert re.fullmatch(r"[\d,]+", steps[row][0]), (row, steps[row])
    # beside each row the tracer models, its prediction (here for an H100, the script being tested on a CPU) and the
    # prediction's error; rows it does not model say so
    for row in measured[:6]:
        predicted, ratio = float(steps[row][2]), float(steps[row][3])
        assert predicted > 0 and abs(ratio - predicted / float(steps[row][1])) <= 0.006 + 0.05 * ratio, steps[row]
    assert steps[BEFOREHAND][2:4] == ["—", "—"]
    assert "Predicted: the roofline's milliseconds per step for the H100 SXM (a script test on a CPU)" in text
    # a training step reads nothing on the host: its checks are read one step later
    for row in ("backbone alone: plain", "external: plain", "external + internal: channels_last", BEFOREHAND):
        assert steps[row][6] == "0", (row, steps[row])
    # every ratio is to the fastest backbone row of the run
    seconds = {label: float(cells[1]) for label, cells in steps.items() if re.fullmatch(r"[\d.]+", cells[1])}
    fastest = min(value for label, value in seconds.items() if label.startswith("backbone alone: "))

    def agrees(ratio: str, value: float) -> bool:  # the table's times are rounded to 0.1 ms
        return abs(float(ratio.split("x")[0]) - value / fastest) <= 0.006 + 0.05 / fastest * (1 + value / fastest)

    for label, value in seconds.items():
        assert agrees(steps[label][4], value), (label, steps[label])
    # compiled rows: graphs counted (a compiled backbone's graph serves later rows of the same class), nothing
    # recompiled after warm-up, no CUDA graph skipped
    compilation = table(text, "Compilation of the compiled rows")
    assert list(compilation) == measured[-5:]
    for row, (graphs, recompiles, skips) in compilation.items():
        assert int(graphs) >= (1 if "compiled costs" in row else 0) and recompiles == skips == "0", (row, graphs)

    data = table(text, "## Data path")
    for path in (
        "torchvision per view on 1 CPU workers",
        "batched per batch on 1 CPU workers",
        "uint8 + batched on device",
        "training set on device (ResidentDrawer)",
        "training set on device, 8 batches per call",
    ):
        assert re.fullmatch(r"[\d,]+", data[f"data: {path}"][0]), path

    # The fast and split statistics agree with float64 on the real model's maps, as the library promises (1e-6 cost)
    precision = table(text, "## Precision")
    internal = [cells for name, cells in precision.items() if name.startswith("internal/")]
    assert internal and all(float(cells[1]) < 1e-6 and float(cells[2]) < 1e-6 for cells in internal)
    # and so do the backbone's gradients (every pass draws the same head noise)
    ((fast, split, twice),) = re.findall(
        r"relative difference: fast ([0-9.e+-]+), tf32x3 ([0-9.e+-]+), fast twice ([0-9.e+-]+)\.", text
    )
    assert float(fast) < 1e-5 and float(split) < 1e-5 and float(twice) < 1e-7

    # both training runs, training and validation seconds apart, and the projection from the training seconds
    for method in ("HFMCA-SS(*)", "HFMCA-SS"):
        run = table(text, f"### {method}")
        images, train_seconds, validation_seconds, top1 = run["1"]
        assert images == "40" and float(train_seconds) > 0 and float(validation_seconds) > 0 and 0 <= float(top1) <= 1
        (projected,) = re.findall(
            r"training on one CIFAR epoch \(50,000 images\) takes ([\d.]+) s", text.split(f"### {method}\n")[1]
        )[:1]
        assert abs(float(projected) - float(train_seconds) * 50_000 / 40) <= 0.05 * 50_000 / 40  # from 0.1 s rounding

    verdicts = table(text, "## Targets")
    assert list(verdicts) == [
        "external / backbone step <= 1.05x",
        "external + internal (8 BasicBlocks) / backbone step <= 1.50x (goal 1.25x)",
        "step with views drawn on the device / step with views drawn beforehand <= 1.05x",
        "training seconds of one 50,000-image epoch, HFMCA-SS(*) (validation apart) <= 10 s",
        "host syncs per training step (HostReads (device values read on the host; CPU, not compiled rows)) = 0",
    ]
    assert all(cells[1] in ("met", "**not met**") for cells in verdicts.values()), verdicts
    external = min(value for label, value in seconds.items() if label.startswith("external: "))
    ratio, rows = verdicts["external / backbone step <= 1.05x"][0].split(" ", 1)
    assert agrees(ratio, external) and rows.startswith("(external: ") and "/ backbone alone: " in rows


def fake_result() -> GpuCheckResult:
    rows = [
        StepRow("backbone alone: plain", 0.020, 1.0, host_syncs=0, kernels=420.0, busy_fraction=0.95),
        StepRow("backbone alone: channels_last", 0.016, 0.9, host_syncs=0),
        StepRow("external: plain", 0.021, 1.1, host_syncs=1, kernels=700.0, busy_fraction=0.91),
        StepRow("external: channels_last", 0.0185, 1.0, host_syncs=0),
        StepRow("external + internal: plain", 0.030, 2.0, host_syncs=0),
        StepRow("external + internal: channels_last", 0.028, 1.9, host_syncs=0),
        StepRow(BEFOREHAND, 0.019, 1.0, host_syncs=0),
        StepRow(f"{IN_STEP} (ResidentDrawer): channels_last", 0.0198, 1.0, host_syncs=0),
        StepRow(f"{IN_STEP} (ResidentDrawer, 8 batches per call): channels_last", 0.0194, 1.0, host_syncs=0.125),
        StepRow(
            f"{IN_STEP} (BatchedDrawer on device): channels_last", skipped="the time budget ran out before this row"
        ),
        StepRow("backbone alone: compiled + channels_last", 0.017, 0.9, host_syncs=0, graphs=2, recompiles=0),
        StepRow("external + internal: compiled + channels_last", None, None, "Unsupported: hooks", graphs=1),
        StepRow(
            "external + internal: channels_last + compiled costs",
            0.0232,
            1.9,
            host_syncs=0,
            graphs=1,
            recompiles=0,
            cudagraph_skips=0,
        ),
    ]
    training = [
        TrainingRun("HFMCA-SS(*)", "resnet18", 50_000, 9, 64, [49_984, 49_984], [14.0, 9.5], [2.0, 1.9], [0.41, 0.55]),
        TrainingRun(
            "HFMCA-SS", "resnet18", 50_000, 9, 64, [12_800], [5.2], [None], [None], cut="Stopped by the time budget."
        ),
    ]
    return GpuCheckResult(
        "NVIDIA H100 80GB HBM3",
        {"torch": "2.11.0"},
        {"step rows": "resnet18"},
        576,
        rows,
        [
            DataRow("data: torchvision per view on 16 CPU workers", 0.050),
            DataRow("data: batched per batch on 16 CPU workers", note="failed: RuntimeError: bus error"),
            DataRow("data: training set on device (ResidentDrawer)", 0.004),
        ],
        [AgreementRow("external", 2e-3, None, None), AgreementRow("internal/layer1.0", 3e-3, 4e-8, 5e-8)],
        {"fast": 2e-7, "tf32x3": 3e-7, "fast twice": 1e-8},
        training,
        sections=[("training-step rows", "12 s"), ("data path", "**failed** after 3 s: RuntimeError: bus error")],
        predicted={"backbone alone: plain": 22.0, "external: plain": 18.9},
        predicted_for="H100 SXM",
    )


def test_targets_follow_from_the_rows():
    external, internal, in_step, epoch, syncs = targets(fake_result())
    # the fastest external row (0.0185, channels-last) over the fastest backbone row (0.016, channels-last)
    assert external.measured == "1.16x (external: channels_last / backbone alone: channels_last)"
    assert external.met is False
    # compiled costs over the channels-last backbone: 0.0232 / 0.016
    assert internal.measured.startswith("1.45x (external + internal: channels_last + compiled costs / ")
    assert internal.met
    assert in_step.measured == f"1.02x ({IN_STEP} (ResidentDrawer, 8 batches per call): channels_last)" and in_step.met
    assert epoch.measured == "9.5 s (epoch 2's pace)" and epoch.met  # 9.5 s for 49,984 images: 9.50 s for 50,000
    assert syncs.measured == "1 (external: plain; 2 of 11 rows sync)" and syncs.met is False


def test_targets_not_measured_without_rows():
    result = GpuCheckResult("x", {}, {}, 576)
    assert [target.measured for target in targets(result)] == ["—"] * 5
    assert [target.met for target in targets(result)] == [None] * 5


def test_report_writer_on_a_fake_result(tmp_path: Path):
    result = fake_result()
    result.targets = [
        Target("external <= 1.05x", "1.03x", True),
        Target("internal <= 1.5x", "1.60x", False),
        Target("x", "—", None),
    ]
    text = write_report(result, tmp_path / "gpu-nvidia-h100-80gb-hbm3.md")
    assert (tmp_path / "gpu-nvidia-h100-80gb-hbm3.md").read_text() == text
    assert "| external <= 1.05x | 1.03x | met |" in text and "| internal <= 1.5x | 1.60x | **not met** |" in text
    assert "| x | — | not measured |" in text
    # Ratios are to the fastest backbone row of the run (0.016 s); rates are views per second.
    assert "fastest backbone row of this run (backbone alone: channels_last, 16.0 ms)" in text
    # the prediction beside the measured time, and predicted / measured (22.0 / 20.0; 18.9 / 21.0)
    assert "| backbone alone: plain | 28,800 | 20.0 | 22.0 | 1.10 | 1.25x | 1.00 | 0 | 420 | 95% |" in text
    assert "| external: plain | 27,429 | 21.0 | 18.9 | 0.90 | 1.31x | 1.10 | 1 | 700 | 91% |" in text
    assert "| external + internal: channels_last | 20,571 | 28.0 | — | — | 1.75x | 1.90 | 0 | — | — |" in text
    assert "| external + internal: channels_last + compiled costs | 24,828 | 23.2 | — | — | 1.45x | 1.90 | 0 |" in text
    assert "Predicted: the roofline's milliseconds per step for the H100 SXM (benchmarks/roofline.py --rows" in text
    eight = f"| {IN_STEP} (ResidentDrawer, 8 batches per call): channels_last"
    assert f"{eight} | 29,691 | 19.4 | — | — | 1.21x | 1.00 | 0.12 |" in text  # 1 host sync in 8 steps
    assert f"| {IN_STEP} (BatchedDrawer on device): channels_last | skipped: the time budget ran out" in text
    assert "| external + internal: compiled + channels_last | failed: Unsupported: hooks |" in text
    assert "| backbone alone: compiled + channels_last | 2 | 0 | — |" in text  # the compilation table
    assert "| external + internal: channels_last + compiled costs | 1 | 0 | 0 |" in text
    # the data path against the fastest external step's consumption (0.0185 s per step)
    assert "| data: training set on device (ResidentDrawer) | 144,000 | 4.62x |" in text
    assert "| data: batched per batch on 16 CPU workers | failed: RuntimeError: bus error | |" in text
    assert "| internal/layer1.0 | 3.00e-03 | 4.00e-08 | 5.00e-08 | — |" in text
    assert "| external | 2.00e-03 | — | — | — |" in text
    assert "relative difference: fast 2.00e-07, tf32x3 3.00e-07, fast twice 1.00e-08." in text
    # training and validation seconds apart; the projection from the training seconds of the last full epoch
    assert "| 2 | 49,984 | 9.5 | 1.9 | 0.550 |" in text
    assert "At epoch 2's pace, training on one CIFAR epoch (50,000 images) takes 9.5 s, validation apart" in text
    assert "| 1 | 12,800 | 5.2 | — | — |" in text and "Stopped by the time budget." in text
    assert "takes 20.3 s" in text  # HFMCA-SS: 5.2 s for 12,800 images
    assert "- section data path: **failed** after 3 s: RuntimeError: bus error" in text


def test_pytest_summaries_are_read_with_their_first_failures():
    output = (
        "..F.s\n"
        "FAILED tests/cuda/test_gpu_paths.py::test_split - AssertionError: 3e-5 > 1e-5\n"
        "SKIPPED [1] tests/cuda/test_gpu_paths.py:80: needs two GPUs\n"
        "1 failed, 3 passed, 1 skipped in 41.20s\n"
    )
    tests = parse_pytest(output, 1, 41.2)
    assert (tests.passed, tests.failed, tests.skipped, tests.errors, tests.ok) == (3, 1, 1, 0, False)
    assert tests.failures == ["FAILED tests/cuda/test_gpu_paths.py::test_split - AssertionError: 3e-5 > 1e-5"]
    skipped = parse_pytest("SKIPPED [6] tests/cuda/test_gpu_paths.py:14: needs a CUDA GPU\n6 skipped in 2.1s\n", 0, 2.1)
    assert skipped.ok and skipped.skipped == 6 and skipped.note == "All skipped: needs a CUDA GPU."


@pytest.mark.parametrize(
    ("name", "slug"),
    [("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"), ("NVIDIA H200", "nvidia-h200"), ("", "device")],
)
def test_report_file_names(name: str, slug: str):
    assert device_slug(name) == slug


def test_a_failing_section_is_reported_and_the_others_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """One section's failure (a worker's bus error, an unsupported compile) must not lose the check's other
    measurements: it is written into the report, the later sections run, and the exit status says so."""
    from gpu_check import cli

    def broken_training(*args, **kwargs):
        raise RuntimeError("DataLoader worker (pid 7) is killed by signal: Bus error.\nmore detail")

    monkeypatch.setattr(cli, "training_run", broken_training)
    status = cli.main(["--device", "cpu", "--tiny", "--out-dir", str(tmp_path), "--sections", "training,precision"])
    (report,) = tmp_path.glob("gpu-*.md")
    text = report.read_text()
    assert status == 1
    assert (
        "**failed** after" in text and "RuntimeError: DataLoader worker (pid 7) is killed by signal: Bus error." in text
    )
    assert "| internal/features.0 |" in text  # the precision section still ran and was reported
    with pytest.raises(SystemExit):
        cli.main(["--device", "cpu", "--tiny", "--out-dir", str(tmp_path), "--sections", "steps,typo"])


def test_a_failed_prediction_leaves_the_measured_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The roofline runs after the step rows are measured: when it fails, the report says why in one line and the
    section, measured, stands."""
    import subprocess

    from gpu_check import cli

    def failing_roofline(*args, **kwargs):
        raise subprocess.CalledProcessError(1, ["roofline.py"], stderr="Traceback ...\nroofline: out of memory\n")

    monkeypatch.setattr(cli, "predicted_rows", failing_roofline)
    status = cli.main(["--device", "cpu", "--tiny", "--out-dir", str(tmp_path), "--sections", "steps"])
    (report,) = tmp_path.glob("gpu-*.md")
    text = report.read_text()
    assert status == 0, text
    assert "Predicted: none (the roofline failed: roofline: out of memory)." in text
    assert "| backbone alone: plain |" in text and "**failed**" not in text
