"""`make gpu-check` (benchmarks/gpu_check.py): refuses without CUDA, runs end to end on the CPU at tiny sizes
without the packages GPU machines lack, and writes a report whose numbers follow from the measurements."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import GpuCheckResult, Target, TrainingRun, device_slug, targets, write_report  # noqa: E402
from step_timing import StepRow  # noqa: E402

# What a GPU machine without network may lack; kornia travels as a wheel (make gpu-wheels).
MISSING_ON_GPU_MACHINES = ("jsonargparse", "wandb", "lightly")

BLOCKING_RUNNER = """
import importlib.abc, runpy, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {missing!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Missing())
sys.argv = ["benchmarks/gpu_check.py"] + sys.argv[1:]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""


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
    assert result.returncode != 0
    assert "CUDA is not available" in result.stderr and "never silently measures the CPU" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no report of CPU numbers


def test_the_whole_check_runs_on_the_cpu_without_the_packages_gpu_machines_lack(tmp_path: Path):
    runner = BLOCKING_RUNNER.format(missing=set(MISSING_ON_GPU_MACHINES))
    result = subprocess.run(
        [sys.executable, "-c", runner, "--device", "cpu", "--tiny", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (report,) = tmp_path.glob("gpu-*.md")
    text = report.read_text()
    for heading in ("## Targets", "## Training step", "## Data path", "## Precision", "## Training"):
        assert heading in text
    for row in (
        "backbone alone: plain",
        "external: channels_last",
        "external + internal: plain",
        "external, device augmentation (batched)",
        "external, device augmentation (kornia)",
    ):
        assert f"| {row}" in text and f"| {row} | failed" not in text
    for path in (
        "torchvision per view on 1 CPU workers",
        "kornia per image on 1 CPU workers",
        "batched per batch on 1 CPU workers",
        "uint8 + kornia on device",
        "uint8 + batched on device",
        "training set on device, batched from seeds",
    ):
        assert f"| data: {path} |" in text
    # every step row says what it asks of the device: the cost rows read their checks once per step
    (external_row,) = [line for line in text.splitlines() if line.startswith("| external: plain |")]
    assert external_row.split("|")[6].strip() == "1"
    (backbone_row,) = [line for line in text.splitlines() if line.startswith("| backbone alone: plain |")]
    assert backbone_row.split("|")[6].strip() == "0"
    # The fast statistics agree with float64 on the real model's maps, as the library promises (1e-6 cost).
    internal_rows = [line for line in text.splitlines() if line.startswith("| internal/")]
    assert internal_rows and all(float(line.split("|")[3]) < 1e-6 for line in internal_rows)
    # and so do the backbone's gradients (both passes draw the same head noise)
    ((gradients, repeat),) = re.findall(
        r"float64 internal statistics \(float32 model[^)]*\): relative difference ([0-9.e+-]+) \(the fast pass "
        r"twice: ([0-9.e+-]+)\)",
        text,
    )
    assert float(gradients) < 1e-5 and float(repeat) < 1e-7
    assert "| 1 |" in text  # one training epoch with its kNN top-1
    assert "one CIFAR epoch (50,000 images) takes" in text and "800 epochs" in text


def fake_result() -> GpuCheckResult:
    rows = [
        StepRow("backbone alone: plain", 0.020, 1.0, host_reads=0, kernels=420.0, busy_fraction=0.95),
        StepRow("backbone alone: channels_last", 0.016, 0.9),
        StepRow("external: plain", 0.021, 1.1, host_reads=1, kernels=700.0, busy_fraction=0.91),
        StepRow("external: channels_last", 0.0185, 1.0),
        StepRow("external + internal: plain", 0.030, 2.0),
        StepRow("external + internal: channels_last", 0.028, 1.9),
        StepRow("external + internal: compiled + channels_last", None, None, "Unsupported: hooks"),
        StepRow("external + internal: channels_last + compiled costs", 0.024, 1.9),
        StepRow("external, device augmentation: channels_last", 0.018, 1.2),
    ]
    training = TrainingRun("resnet18", 50_000, 9, 64, [30.0, 25.0, 25.5], [0.41, 0.55, 0.61], "3.10 GiB (GPU)")
    return GpuCheckResult(
        "NVIDIA H100 80GB HBM3",
        {"torch": "2.11.0"},
        {"step rows": "resnet18"},
        576,
        rows,
        [("data: torchvision on 16 CPU workers", 0.050), ("data: training set on device, batched from seeds", 0.004)],
        [("external", 2e-3, None), ("internal/layer1.0", 3e-3, 4e-8)],
        2e-7,
        training,
        gradient_repeat=1e-8,
        sections=[("training-step rows", "12 s"), ("data path", "**failed** after 3 s: RuntimeError: bus error")],
    )


def test_targets_follow_from_the_rows():
    external, internal, data, epoch = targets(fake_result())
    assert external.measured == "1.05x" and external.met  # 0.021 / 0.020 plain beats 0.0185 / 0.016 channels-last
    assert (
        internal.measured == "1.50x" and internal.met
    )  # 0.024 / 0.016: compiled costs over the channels-last backbone
    assert (
        data.measured == "144,000 vs 31,135 views/s (4.62x)" and data.met
    )  # fastest path over the fastest external step
    assert epoch.measured == "25.5 s" and epoch.met is False  # the last epoch, 50,000 images


def test_report_writer_on_a_fake_result(tmp_path: Path):
    result = fake_result()
    result.targets = [
        Target("external <= 1.05x", "1.03x", True),
        Target("internal <= 1.3x", "1.50x", False),
        Target("x", "—", None),
    ]
    text = write_report(result, tmp_path / "gpu-nvidia-h100-80gb-hbm3.md")
    assert (tmp_path / "gpu-nvidia-h100-80gb-hbm3.md").read_text() == text
    assert (
        "| external <= 1.05x | 1.03x | yes |" in text
        and "| internal <= 1.3x | 1.50x | **no** |" in text
        and "| x | — | — |" in text
    )
    # Ratios are to the backbone row of the same settings; rates are views per second.
    assert "| external: plain | 27,429 | 21.0 | 1.05x | 1.10 | 1 | 700 | 91% |" in text
    assert "| external + internal: channels_last | 20,571 | 28.0 | 1.75x | 1.90 | — | — | — |" in text
    assert "| external + internal: channels_last + compiled costs | 24,000 | 24.0 | 1.50x | 1.90 |" in text
    assert "| external + internal: compiled + channels_last | failed: Unsupported: hooks |" in text
    assert "| data: training set on device, batched from seeds | 144,000 |" in text
    assert "one CIFAR epoch (50,000 images) takes 25.5 s: 20 epochs 8 min, 800 epochs 5.7 h." in text
    assert "| internal/layer1.0 | 3.00e-03 | 4.00e-08 |" in text and "| external | 2.00e-03 | — |" in text
    assert "| 3 | 25.5 | 0.610 |" in text
    assert "relative difference 2.00e-07 (the fast pass twice: 1.00e-08)." in text
    assert "- section data path: **failed** after 3 s: RuntimeError: bus error" in text


@pytest.mark.parametrize(
    ("name", "slug"),
    [("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"), ("NVIDIA H200", "nvidia-h200"), ("", "device")],
)
def test_report_file_names(name: str, slug: str):
    assert device_slug(name) == slug


def test_a_failing_section_is_reported_and_the_others_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """One section's failure (a worker's bus error, an unsupported compile) must not lose the check's other
    measurements: it is written into the report, the later sections run, and the exit status says so."""
    import gpu_check

    def broken_training(*args, **kwargs):
        raise RuntimeError("DataLoader worker (pid 7) is killed by signal: Bus error.\nmore detail")

    monkeypatch.setattr(gpu_check, "training_run", broken_training)
    status = gpu_check.main(["--device", "cpu", "--tiny", "--out-dir", str(tmp_path), "--sections", "training,steps"])
    (report,) = tmp_path.glob("gpu-*.md")
    text = report.read_text()
    assert status == 1
    assert (
        "**failed** after" in text and "RuntimeError: DataLoader worker (pid 7) is killed by signal: Bus error." in text
    )
    assert "| backbone alone: plain |" in text  # the steps section still ran and was reported
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--tiny", "--out-dir", str(tmp_path), "--sections", "steps,typo"])
