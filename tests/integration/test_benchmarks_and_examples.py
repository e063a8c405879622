"""The benchmark harnesses and the DataModule example run tiny on CPU and print complete tables."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_script(path: str, args: list[str], monkeypatch) -> object:
    monkeypatch.setattr(sys, "argv", [path, *args])
    namespace = runpy.run_path(str(REPO / path), run_name="benchmark")
    return namespace["main"](args)


def table_rows(table: str, after: str | None = None) -> list[list[str]]:
    """Cells of the Markdown table's rows (header first); ``after``: of the table following that line."""
    lines = table.splitlines()
    if after is not None:
        lines = lines[lines.index(after) + 1 :]
        lines = lines[: next((i for i, line in enumerate(lines) if i > 1 and not line.startswith("|")), len(lines))]
    else:
        lines = lines[: next((i for i, line in enumerate(lines) if line == "Runs"), len(lines))]
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in lines
        if line.startswith("| ") and "---" not in line
    ]


HARNESS_TINY = [
    "--data",
    "synthetic",
    "--backbone",
    "small",
    "--head-dim",
    "32",
    "--batch-size",
    "16",
    "--limit-train-batches",
    "2",
    "--workers",
    "0",
    "--per-class",
    "10",
    "--knn-k",
    "10",
    "--hfmca-views",
    "4",
    "--linear-epochs",
    "5",
]


def test_harness_trains_one_run_per_budget_with_its_own_schedule(monkeypatch, tmp_path):
    out = tmp_path / "table1.md"
    table = run_script(
        "benchmarks/harness.py",
        [*HARNESS_TINY, "--epochs", "1", "3", "--methods", "hfmca", "simclr", "hfmca_internal", "--out", str(out)],
        monkeypatch,
    )
    rows = table_rows(table)
    assert rows[0][:4] == ["Method", "Views", "kNN / linear top-1, 1-epoch run", "kNN / linear top-1, 3-epoch run"]
    assert [row[0] for row in rows[1:]] == ["HFMCA-SS(*)", "SimCLR", "HFMCA-SS"]  # one row per method
    for row in rows[1:]:
        assert len(row) == 8 and all(row) and "nan" not in " ".join(row), row
        for cell in row[2:4]:
            knn, linear = (float(value) for value in cell.split(" / "))
            assert 0 <= knn <= 100 and 0 <= linear <= 100
        assert 0 <= float(row[4]) <= 100
    runs = table_rows(table, after="Runs")
    assert runs[0][:4] == ["Method", "Budget (epochs)", "Epochs trained", "Schedule"]
    assert [(row[0], row[1]) for row in runs[1:]] == [
        (method, budget) for method in ("HFMCA-SS(*)", "SimCLR", "HFMCA-SS") for budget in ("1", "3")
    ]
    for method, budget, trained, schedule, rates, *_ in runs[1:]:
        # each column its own run: as many epochs as its budget, a cosine over exactly those epochs, annealed to 0
        assert trained == budget and schedule == f"cosine over {budget} epochs", (method, budget, trained, schedule)
        start, end = (float(value) for value in rates.split(" -> "))
        assert start == 0.06 and end < 1e-12, rates
    assert out.read_text().strip().endswith(runs[-1][-1] + " |")


def test_harness_single_run_mode_is_labelled_and_reads_every_column_from_one_run(monkeypatch):
    table = run_script(
        "benchmarks/harness.py",
        [
            *HARNESS_TINY,
            "--epochs",
            "1",
            "2",
            "--methods",
            "hfmca",
            "vicregl",
            "--protocol",
            "single-run",
            "--linear-epochs",
            "2",
        ],
        monkeypatch,
    )
    assert "single run (not the paper's protocol)" in table.splitlines()[0]
    rows = table_rows(table)
    assert rows[0][2:4] == ["kNN / linear top-1 @ epoch 1", "kNN / linear top-1 @ epoch 2"]
    assert [row[0] for row in rows[1:]] == ["HFMCA-SS(*)", "VICRegL"]
    runs = table_rows(table, after="Runs")
    assert len(runs) == 3 and all(run[2:4] == ["2", "cosine over 2 epochs"] for run in runs[1:])
    for row in rows[1:]:
        first, second = (float(cell.split(" / ")[0]) for cell in row[2:4])
        assert second >= first  # best up to the epoch of one run never decreases


def test_augmentation_sweep_reports_accuracy_and_external_cost_and_draws_the_learning_curves(monkeypatch, tmp_path):
    table = run_script(
        "benchmarks/augmentation_sweep.py",
        [
            "--data",
            "synthetic",
            "--backbone",
            "small",
            "--epochs",
            "1",
            "--head-dim",
            "16",
            "--knobs",
            "crop",
            "gray",
            "--strengths",
            "0",
            "1",
            "--limit-train-batches",
            "2",
            "--hfmca-views",
            "4",
            "--batch-size",
            "16",
            "--workers",
            "0",
            "--per-class",
            "10",
            "--knn-k",
            "10",
            "--linear-epochs",
            "5",
            "--smoothing",
            "1",
            "--out",
            str(tmp_path / "table2.md"),
        ],
        monkeypatch,
    )
    assert "### crop strength" in table and "### gray strength" in table
    rows = [line for line in table.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 4
    for row in rows:
        _, accuracy, cost = [cell.strip() for cell in row.strip("|").split("|")]
        assert 0 <= float(accuracy) <= 100 and float(cost) < 0
    figure = tmp_path / "table2_external_cost.png"
    assert figure.stat().st_size > 10_000 and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_external_cost_curves_figure_draws_one_curve_per_strength_and_panel_per_protocol():
    from hfmca_lightning.visualization import external_cost_curves_figure

    curves = {
        "crop": {0.0: [-9.0, -10.0, -11.0, -12.0], 1.0: [-3.0, -4.0, -4.5, -5.0]},
        "gray": {0.5: [-8.0, -8.5, -9.0, -9.5]},
    }
    figure = external_cost_curves_figure(curves, smoothing=2)
    crop, gray = figure.axes
    assert crop.get_title() == "crop strength" and gray.get_title() == "gray strength"
    assert [line.get_label() for line in crop.get_lines()] == ["0", "1"] and len(gray.get_lines()) == 1
    x, y = crop.get_lines()[0].get_data()
    assert list(y) == [-9.5, -10.5, -11.5] and list(x) == [2, 3, 4]  # 2-step moving average, placed at its last step


def test_datamodule_example_runs(monkeypatch):
    accuracy = run_script("examples/custom_ssl_module.py", ["--epochs", "1", "--limit-train-batches", "3"], monkeypatch)
    assert 0.0 <= accuracy <= 1.0


def test_the_lightly_and_solo_learn_convention_examples_train(monkeypatch):
    """examples/lightly_convention.py (MMCR on lightly's MMCRTransform, DINO on MultiCrop, batch_format lightly) and
    examples/solo_convention.py (batch_format solo) train from the DataModule to finite losses and a kNN result."""
    losses = run_script("examples/lightly_convention.py", ["--epochs", "1", "--steps", "2"], monkeypatch)
    assert set(losses) == {"MMCR", "DINO"} and all(torch.isfinite(torch.tensor(loss)) for loss in losses.values())
    loss = run_script("examples/solo_convention.py", ["--epochs", "1", "--steps", "2"], monkeypatch)
    assert torch.isfinite(torch.tensor(loss))


@pytest.mark.parametrize("method", ["simclr", "dino"])
def test_the_stable_pretraining_convention_example_trains_with_every_callback(method, monkeypatch, tmp_path):
    """examples/stable_pretraining_convention.py: a module that takes plain dicts only and writes into them, with a
    validation_step without a loader index, trains from the DataModule (dict / dict_named batches, one evaluation
    loader); kNN, the linear probe, RankMe and the spectra, and the health metrics read its embedding / label."""
    import csv

    monkeypatch.chdir(tmp_path)
    args = ["--method", method, "--epochs", "2", "--steps", "3"]
    metrics = run_script("examples/stable_pretraining_convention.py", args, monkeypatch)
    for name in ("knn/top1", "knn/top1_max", "linear/top1", "health/lidar", "health/rankme"):
        assert 0 <= metrics[name] < float("inf"), name
    assert metrics["knn/top1"] <= 1 and metrics["linear/top1"] <= 1
    (path,) = tmp_path.glob(f"runs/stable_pretraining_convention/{method}/version_0/metrics.csv")
    columns = set(next(csv.reader(path.open())))
    assert {"rankme/backbone", "knn/top1", "linear/top1", "health/effective_rank"} <= columns
    assert any(name.startswith("spectrum/internal/") for name in columns)  # the backbone's stages, hooked


def test_data_pipeline_benchmark_prints_startup_and_decode_figures(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(
        sys, "argv", ["benchmarks/data_pipeline.py", "--root", str(tmp_path), "--files", "3000", "--jpegs", "3"]
    )
    runpy.run_path(str(REPO / "benchmarks" / "data_pipeline.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "MultiViewDataModule.setup(): " in out and "for 3,000 training images" in out
    assert "decode + 9 views of 224 px" in out and "views/s" in out


@pytest.mark.slow  # a benchmark's smoke run (make test-slow)
def test_throughput_benchmark_has_a_row_per_memory_setting(monkeypatch, capsys):
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "benchmarks/throughput.py",
            "--backbone",
            "small",
            "--batch-size",
            "4",
            "--steps",
            "1",
            "--workers",
            "0",
            "--views",
            "4",
            "--default-malloc",
        ],
    )
    runpy.run_path(str(REPO / "benchmarks" / "throughput.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "; default malloc" in out.splitlines()[0]  # (in-process: the test process keeps its allocator)
    for row in (
        "data: torchvision per view on 0 CPU workers",
        "data: batched per batch on 0 CPU workers",
        "data: uint8 + batched on device",
        "data: training set on device (ResidentDrawer)",
        "data: training set on device, 8 batches per call",
        "step: backbone fwd/bwd alone",
        "activation checkpointing",
        "checkpointing, chunks of 4",
        "step: HFMCA external + internal",
    ):
        (line,) = [line for line in out.splitlines() if row in line]
        assert "views/s" in line and "failed" not in line, line


@pytest.mark.slow  # 10 s on a 2-core CPU; a script of benchmarks/, not the package
def test_demo_views_benchmark_trains_the_demo_with_each_setting(monkeypatch):
    table = run_script(
        "benchmarks/demo_views.py",
        [
            "--epochs",
            "2",
            "--per-class",
            "10",
            "--workers",
            "0",
            "--limit-train-batches",
            "2",
            "--settings",
            "l4",
            "l9",
            "multicrop",
            "simclr",
        ],
        monkeypatch,
    )
    rows = table_rows(table)
    assert [row[0] for row in rows[1:]] == [
        "HFMCA-SS(*), L = 4 (2x2 grid, no noise)",
        "HFMCA-SS(*), L = 9 (3x3 grid, 20 noise channels)",
        "HFMCA-SS(*), 2 global + 6 local crops (2x4 grid, no noise)",
        "SimCLR (2 views)",
    ]
    for row in rows[1:]:
        assert 0 <= float(row[1]) <= 100 and row[2].endswith(" s") and len(row[4].split(", ")) == 2


def test_demo_views_settings_change_only_views_grid_and_noise():
    import yaml

    namespace = runpy.run_path(str(REPO / "benchmarks" / "demo_views.py"), run_name="benchmark")
    base = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo_views = base["data"]["init_args"]["views"]
    assert demo_views["class_path"] == "hfmca_lightning.data.SimCLRViews"
    l9 = namespace["setting_config"](base, "l9", None)
    assert l9["data"]["init_args"]["views"]["init_args"]["count"] == 9
    head = l9["model"]["init_args"]["external_head"]["init_args"]
    assert (head["grid_height"], head["grid_width"], head["noise_channels"]) == (3, 3, 20)
    l9["data"]["init_args"]["views"]["init_args"]["count"], l9["model"]["init_args"]["external_head"] = (
        demo_views["init_args"]["count"],
        base["model"]["init_args"]["external_head"],
    )
    assert l9 == base
    crops = namespace["setting_config"](base, "multicrop", None)
    assert crops["data"]["init_args"]["views"] == {
        "class_path": "hfmca_lightning.data.MultiCrop",
        "init_args": {"global_crops": 2, "local_crops": 6, "gray_strength": demo_views["init_args"]["gray_strength"]},
    }  # 8 views; the demo's greyscale kept, its crop strength (SimCLRViews') not
    head = crops["model"]["init_args"]["external_head"]["init_args"]
    assert (head["grid_height"], head["grid_width"], head["noise_channels"]) == (2, 4, 0)
    crops["data"]["init_args"]["views"], crops["model"]["init_args"]["external_head"] = (
        demo_views,
        base["model"]["init_args"]["external_head"],
    )
    assert crops == base
    simclr = namespace["setting_config"](base, "simclr", None)
    assert (
        simclr["model"]["class_path"].endswith("SimCLR")
        and simclr["model"]["init_args"]["backbone"] == base["model"]["init_args"]["backbone"]
    )
    assert simclr["data"]["init_args"]["views"] == {
        "class_path": "hfmca_lightning.data.SimCLRViews",
        "init_args": {**demo_views["init_args"], "count": 2},
    }


def test_external_cost_curves_shorter_than_the_smoothing_window_are_drawn_raw_from_step_one():
    from hfmca_lightning.visualization import external_cost_curves_figure

    (panel,) = external_cost_curves_figure({"crop": {0.5: [-3.0, -4.0, -5.0]}}, smoothing=20).axes
    x, y = panel.get_lines()[0].get_data()
    assert list(x) == [1, 2, 3] and list(y) == [-3.0, -4.0, -5.0]


def test_internal_cost_breakdown_prints_the_statistics_and_cost_parts(monkeypatch, capsys):
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "benchmarks/internal_cost_breakdown.py",
            "--backbone",
            "small",
            "--batch-size",
            "4",
            "--steps",
            "1",
            "--views",
            "4",
            "--default-malloc",
        ],
    )
    runpy.run_path(str(REPO / "benchmarks" / "internal_cost_breakdown.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "; default malloc" in out
    assert "step: backbone fwd/bwd alone" in out and "step: HFMCA external + internal" in out
    # both hooked convolutions of the small network, their backward nodes and the labelled factorisations
    for part in (
        "statistics forward, input (3, 32, 32)",
        "statistics forward, input (32, 16, 16)",
        "statistics backward",
        "cost factorisations",
    ):
        assert part in out, part
    added = next(line for line in out.splitlines() if "added by the internal costs" in line)
    assert float(added.split()[5]) > 0, added  # GFLOP


def test_internal_cost_breakdown_counts_in_place_products():
    count = runpy.run_path(str(REPO / "benchmarks" / "internal_cost_breakdown.py"))["matrix_product_flops"]
    a, b, c = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(6, 7)
    # what the backward passes of the statistics use: in-place accumulating products
    assert count(lambda: torch.zeros(2, 3, 5).baddbmm_(a, b)) == 2 * 2 * 3 * 4 * 5
    assert count(lambda: torch.zeros(6, 6).addmm_(c, c.T)) == 2 * 6 * 7 * 6
    assert count(lambda: torch.bmm(a, b)) == 2 * 2 * 3 * 4 * 5


def test_internal_cost_breakdown_reads_the_channels_last_statistics(monkeypatch, capsys):
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "benchmarks/internal_cost_breakdown.py",
            "--backbone",
            "small",
            "--batch-size",
            "4",
            "--steps",
            "1",
            "--views",
            "4",
            "--default-malloc",
            "--channels-last",
        ],
    )
    runpy.run_path(str(REPO / "benchmarks" / "internal_cost_breakdown.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "; channels-last" in out.splitlines()[0]
    for part in ("statistics forward, input (3, 32, 32)", "statistics backward", "cost factorisations"):
        assert part in out, part


def test_the_harness_builds_each_method_as_its_shipped_config(monkeypatch):
    """One source of truth: the harness's SimSiam and FastSiam have the 2048 / 2048 / 512 heads of the paper's Table 1
    and configs/baselines/*, not the classes' defaults; every method's settings are its config's."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from common import DISPLAY, build_method, shipped_model_arguments

    for method in ("simsiam", "fastsiam"):
        module = build_method(method, "resnet18")
        widths = [
            layer.out_features for layer in module.projection_head.modules() if isinstance(layer, torch.nn.Linear)
        ]
        assert widths[-1] == 2048 and set(widths) == {2048}, (method, widths)
        predictor = [
            layer.out_features for layer in module.prediction_head.modules() if isinstance(layer, torch.nn.Linear)
        ]
        assert predictor == [512, 2048], (method, predictor)
    for method in DISPLAY:
        shipped = shipped_model_arguments(method)
        module = build_method(method, "small")
        if method.startswith("hfmca"):
            assert module.external_cost.reg == shipped["external_cost"]["init_args"]["reg"]
            noise = [m.num_channels for m in module.external_head.modules() if type(m).__name__ == "NoiseChannels"]
            assert noise == [shipped["external_head"]["init_args"]["noise_channels"]]
        else:  # every shipped setting reached the module's saved hyper-parameters
            for key, value in shipped.items():
                assert module.hparams[key] == (tuple(value) if isinstance(value, list) else value), (method, key)


@pytest.mark.slow  # a benchmark's smoke run (make test-slow)
# the shipped spectrum configs' heatmaps take statistics of more test images than this tiny data set has (it says so)
@pytest.mark.filterwarnings("ignore::hfmca_lightning.errors.HFMCAWarning")
def test_spectrum_study_writes_the_papers_figures_and_a_table_of_its_spectra(monkeypatch, tmp_path):
    """The §5 study, tiny: three scenarios trained, Fig. 4 / Fig. 5 / learning dynamics drawn, and every number of
    the table recomputed from the spectra it was built from (each scenario's ``analysis/spectra.json``)."""
    import json

    import numpy as np

    out = tmp_path / "study"
    table = run_script(
        "benchmarks/spectrum_study.py",
        [
            "--data",
            "synthetic",
            "--iterations",
            "4",
            "--channels",
            "8",
            "--hidden-dim",
            "16",
            "--noise-channels",
            "2",
            "--batch-size",
            "4",
            "--workers",
            "0",
            "--csv-only",
            "--analysis-batches",
            "2",
            "--out",
            str(out),
        ],
        monkeypatch,
    )
    figures = {path.name for path in out.glob("*.png")}
    assert figures == {
        "cross_layer_spectra.png",
        "cross_scenario_spectra.png",
        *(f"learning_dynamics_{s}.png" for s in ("unsupervised", "supervised", "selfsupervised")),
    }
    assert (out / "table.md").read_text() == table
    scenarios = ("unsupervised", "supervised", "selfsupervised")
    rows = table_rows(table, after=table.splitlines()[0])
    assert rows[0][1:] == [f"{s}: {column}" for s in scenarios for column in ("< 0.1", "> 0.5", "top-10 mean")]
    spectra = {s: json.loads((out / s / "analysis" / "spectra.json").read_text())["pairs"] for s in scenarios}
    assert [row[0] for row in rows[1:]] == [*(f"internal/L{i}" for i in range(1, 10)), "external"]
    for row in rows[1:]:
        for index, scenario in enumerate(scenarios):
            cells = row[1 + 3 * index : 4 + 3 * index]
            if row[0] not in spectra[scenario]:  # the unsupervised scenario has no LF
                assert cells == ["", "", ""] and row[0] == "external" and scenario == "unsupervised"
                continue
            values = np.array(spectra[scenario][row[0]]["eigenvalues"])
            assert cells == [str((values < 0.1).sum()), str((values > 0.5).sum()), f"{values[:10].mean():.3f}"]
    for first, second in (("supervised", "unsupervised"), ("supervised", "selfsupervised")):
        crossed = json.loads((out / f"compare_{first}_{second}" / "cross_spectra.json").read_text())["pairs"]
        assert ("external" in crossed) == (second == "selfsupervised")  # LF only between two runs with heads


def test_health_cost_benchmark_prints_the_callbacks_overhead_ratio_and_its_parts(monkeypatch, capsys):
    """benchmarks/health_cost.py --tiny: the with / without ratio of the step, one summed step and one log."""
    import re

    measured = run_script("benchmarks/health_cost.py", ["--tiny"], monkeypatch)
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("per-step overhead ratio, wall clock")]
    ratio = re.fullmatch(r"per-step overhead ratio, wall clock \([^)]*\): ([+-]\d+\.\d+)%", line)
    assert ratio is not None, line
    assert float(ratio.group(1)) == pytest.approx(100 * measured["overhead"], abs=0.006)
    for part in ("one summed step: ", "one log: ", "training step without the callback: "):
        (found,) = [line for line in out.splitlines() if line.startswith(part)]
        assert float(found[len(part) :].split(" ms")[0]) > 0, found
    assert "eigendecompositions alone" in out and "per-step overhead ratio, CPU time" in out
    assert re.search(r"^target <= 2%: (met|not met) \(wall clock\), (met|not met) \(CPU time\)$", out, re.MULTILINE)
    assert measured["metrics"] > 0 and measured["step"] > 0


def test_health_correlation_benchmark_prints_a_row_per_metric_with_rank_correlations(monkeypatch):
    """benchmarks/health_correlation.py --tiny: every copy's metrics and accuracies, and Spearman's rho of each metric
    with kNN and linear top-1 per method and pooled, in [-1, 1]."""
    table = run_script("benchmarks/health_correlation.py", ["--tiny", "--methods", "hfmca", "simclr"], monkeypatch)
    values = table_rows(table, after="")
    assert values[0] == [
        "method", "weights", "RankMe", "effective rank", "alpha-ReQ", "LiDAR", "kNN top-1 (%)", "linear top-1 (%)"
    ]  # fmt: skip
    assert [row[:2] for row in values[1:]] == [
        [method, weights] for method in ("HFMCA-SS(*)", "SimCLR") for weights in ("init", "epoch 1", "epoch 2")
    ]
    for row in values[1:]:
        assert all(float(cell) > 0 for cell in row[2:6]) and all(0 <= float(cell) <= 100 for cell in row[6:]), row
    import re

    for after, copies in (
        (next(line for line in table.splitlines() if line.startswith("Spearman's rank correlation")), 3),
        ("The same over the trained copies (the initialisation left out):", 2),
    ):
        rows = table_rows(table, after=after)
        assert rows[0][:5] == ["metric"] + [
            f"{name} ({copies}): {accuracy}" for name in ("HFMCA-SS(*)", "SimCLR") for accuracy in ("kNN", "linear")
        ]
        # the common initialisation counts once in the pooled column
        assert all(re.fullmatch(rf"pooled \(({2 * copies - 1}|{2 * copies})\): (kNN|linear)", c) for c in rows[0][5:])
        assert [row[0] for row in rows[1:]] == ["RankMe", "effective rank", "alpha-ReQ", "LiDAR"]
        for row in rows[1:]:
            assert len(row) == 7 and all(cell == "-" or -1 <= float(cell) <= 1 for cell in row[1:]), row
            assert all(cell != "-" for cell in row[5:]), row  # pooled over 4 to 6 copies: never constant here


def test_spearman_of_the_health_correlation_benchmark_matches_its_definition():
    namespace = runpy.run_path(str(REPO / "benchmarks" / "health_correlation.py"), run_name="benchmark")
    spearman = namespace["spearman"]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [1, 4, 9, 16, 100]) == pytest.approx(1.0)  # ranks, not values
    # ties at their mean rank: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([1, 1, 1], [1, 2, 3]) != spearman([1, 1, 1], [1, 2, 3])  # constant: NaN
