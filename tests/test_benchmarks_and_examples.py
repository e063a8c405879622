"""The benchmark harnesses and the DataModule example run tiny on CPU and print complete tables."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_script(path: str, args: list[str], monkeypatch) -> object:
    monkeypatch.setattr(sys, "argv", [path, *args])
    namespace = runpy.run_path(str(REPO / path), run_name="benchmark")
    return namespace["main"](args)


def test_harness_prints_a_complete_table_for_hfmca_simclr_and_fastsiam(monkeypatch, tmp_path):
    out = tmp_path / "table1.md"
    table = run_script(
        "benchmarks/harness.py",
        ["--data", "synthetic", "--backbone", "small", "--epochs", "1", "2", "--head-dim", "32", "--batch-size", "16",
         "--limit-train-batches", "2", "--methods", "hfmca", "simclr", "fastsiam", "--workers", "0", "--per-class", "10",
         "--knn-k", "10", "--hfmca-views", "4", "--linear-epochs", "5", "--out", str(out)],
        monkeypatch,
    )
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith(
        "| Method | Views | kNN / linear top-1 @ epoch 1 | kNN / linear top-1 @ epoch 2 | Linear top-1 (offline, final) | Wall time | Peak memory | Views/s"
    )
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| HFMCA-SS(*)", "| SimCLR", "| FastSiam"]
    for row in rows[1:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 8 and all(cells) and "nan" not in row, row
        knn, linear = (float(value) for value in cells[3].split(" / "))
        assert 0 <= knn <= 100 and 0 <= linear <= 100 and 0 <= float(cells[4]) <= 100
    assert out.read_text().strip().endswith(rows[-1].strip())


def test_augmentation_sweep_reports_accuracy_and_external_cost(monkeypatch):
    table = run_script(
        "benchmarks/augmentation_sweep.py",
        ["--data", "synthetic", "--backbone", "small", "--epochs", "1", "--head-dim", "16", "--knobs", "crop", "gray",
         "--strengths", "0", "1", "--limit-train-batches", "2", "--hfmca-views", "4", "--batch-size", "16",
         "--workers", "0", "--per-class", "10", "--knn-k", "10", "--linear-epochs", "5"],
        monkeypatch,
    )
    assert "### crop strength" in table and "### gray strength" in table
    rows = [line for line in table.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 4
    for row in rows:
        _, accuracy, cost = [cell.strip() for cell in row.strip("|").split("|")]
        assert 0 <= float(accuracy) <= 100 and float(cost) < 0


def test_datamodule_example_runs(monkeypatch):
    accuracy = run_script("examples/custom_ssl_module.py", ["--epochs", "1", "--limit-train-batches", "3"], monkeypatch)
    assert 0.0 <= accuracy <= 1.0


def test_data_pipeline_benchmark_prints_startup_and_decode_figures(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks/data_pipeline.py", "--root", str(tmp_path), "--files", "3000", "--jpegs", "3"])
    runpy.run_path(str(REPO / "benchmarks" / "data_pipeline.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "MultiViewDataModule.setup(): " in out and "for 3,000 training images" in out
    assert "decode + 9 views of 224 px" in out and "views/s" in out


def test_throughput_benchmark_has_a_row_per_memory_setting(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks/throughput.py", "--backbone", "small", "--batch-size", "4", "--steps", "1", "--workers", "0", "--views", "4"])
    runpy.run_path(str(REPO / "benchmarks" / "throughput.py"), run_name="__main__")
    out = capsys.readouterr().out
    for row in ("step: backbone fwd/bwd alone", "activation checkpointing", "checkpointing, chunks of 4", "step: HFMCA external + internal"):
        (line,) = [line for line in out.splitlines() if row in line]
        assert "views/s" in line and "failed" not in line, line
