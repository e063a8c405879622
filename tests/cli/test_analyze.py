"""``hfmca analyze`` / ``hfmca compare`` on checkpoints trained in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hfmca_lightning.analysis import HealthStatistics, decompose
from hfmca_lightning.cli import main
from hfmca_lightning.cli.analyze import load_run
from hfmca_lightning.evaluation_data import denormalise, figure_images
from hfmca_lightning.methods.inspection import collect_for_analysis
from tests.helpers import DEMO, REPO, eigenvalue_error, tiny_overrides

TINY_SPECTRUM = {
    "init_args": {
        "backbone": {
            "class_path": "hfmca_lightning.models.SpectrumCNN",
            "init_args": {"channels": 6, "hidden_dim": 12, "noise_channels": 2},
        },
        "external_head": {
            "class_path": "hfmca_lightning.models.GridExternalHead",
            "init_args": {"feature_dim": 6, "grid_height": 3, "grid_width": 3, "hidden_dim": 12, "noise_channels": 2},
        },
    }
}


def train(tmp_path: Path, config: str) -> Path:
    model = (
        TINY_SPECTRUM
        if "selfsupervised" in config
        else {"init_args": {"backbone": TINY_SPECTRUM["init_args"]["backbone"]}}
    )
    if "simclr" in config:  # the baseline on the same (tiny) spectrum CNN: the backbones share module names
        model["init_args"].update(hidden_dim=12, output_dim=6)
    data = {
        "data.init_args.batch_size": 4,
        "data.init_args.source.init_args.train_per_class": 10,
        "trainer.limit_val_batches": 0,
    }
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / config),
            "--config",
            str(tiny_overrides(tmp_path, model=model, **data)),
            "--trainer.limit_train_batches",
            "3",
        ]
    )
    return tmp_path / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    runs = {name: train(root / name, f"spectrum_{name}.yaml") for name in ("selfsupervised", "unsupervised")}
    runs["simclr"] = train(root / "simclr", "baselines/simclr_cifar10.yaml")
    return runs


def test_analyze_writes_spectra_heatmaps_basis_functions_and_an_index(checkpoints, tmp_path, capsys):
    out = tmp_path / "analysis"
    main(
        [
            "analyze",
            "--ckpt_path",
            str(checkpoints["selfsupervised"]),
            "--out",
            str(out),
            "--num_batches",
            "2",
            "--num_images",
            "3",
            "--layers",
            "L1",
            "L3",
        ]
    )
    assert f"wrote {out / 'index.html'}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "basis_L1.png",
        "basis_L3.png",
        "density_ratio.png",
        "index.html",
        "spectra.json",
        "spectra.png",
    ]
    report = json.loads((out / "spectra.json").read_text())
    spectra = report["pairs"]
    assert list(spectra) == [*(f"internal/L{i}" for i in range(1, 10)), "external"]  # the paper's order, LF last
    # three steps: young BatchNorm running statistics, so each batch's own were used, as in training
    assert report["batch_norm"] == "batch"
    # The JSON holds the eigenspectrum of the statistics of the same batches, the constant function's apart.
    module, datamodule = load_run(checkpoints["selfsupervised"])
    batches = [batch for batch, _ in list(datamodule.train_dataloader())[:2]]
    collected = [collect_for_analysis(module, batch, batch_norm="batch") for batch in batches]
    stats = {name: sum((c.statistics[name] for c in collected[1:]), collected[0].statistics[name]) for name in spectra}
    reg = module.cost_modules()["internal/L4"].reg
    expected = decompose(stats["internal/L4"], reg=reg).eigenvalues
    # the same float64 statistics and decomposition, the batches added in another order: twice the one-computation
    # bound on the eigenvalues (3 e each; see eigenvalue_error)
    bound = 6 * eigenvalue_error(stats["internal/L4"], reg)
    assert spectra["internal/L4"]["trivial"] == pytest.approx(float(expected[0]), rel=0, abs=bound)
    torch.testing.assert_close(
        torch.tensor(spectra["internal/L4"]["eigenvalues"], dtype=torch.float64), expected[1:], rtol=0, atol=bound
    )
    assert spectra["internal/L4"]["groups"] == int(stats["internal/L4"].group_count)
    # ... and the label-free health of the backbone features of the same batches (each image's 9 views together)
    health = report["health"]
    sums = HealthStatistics.of(collected[0].features.reshape(4, 9, -1))
    for batch in collected[1:]:
        sums = sums.merge(HealthStatistics.of(batch.features.reshape(4, 9, -1)))
    expected = sums.metrics()
    assert set(expected) == {"rankme", "effective_rank", "alpha_req", "lidar"}
    for name, value in expected.items():
        assert health[name] == pytest.approx(value, rel=1e-9), name
    dimension = sums.first_sum.shape[0]
    assert (health["samples"], health["views"], health["dimension"]) == (8, 9, dimension)
    # valid ranges: no rank above the dimension or, centred, the samples less one (plus RankMe's and LiDAR's epsilon)
    assert 1 <= health["rankme"] <= dimension + 1e-3 and 1 <= health["effective_rank"] <= min(7, dimension) + 1e-9
    assert 1 <= health["lidar"] <= min(7, dimension) + 1e-3 and health["alpha_req"] >= 0
    page = (out / "index.html").read_text()
    for name in ("spectra.png", "density_ratio.png", "basis_L1.png", "internal/L9", "BatchNorm: each batch"):
        assert name in page
    assert "Label-free health of the backbone" in page and f"{health['lidar']:.3f}" in page
    # docs/analysis.md: a row per pair: groups, trivial, top eigenvalue, mean of the top 10, counts below 0.1, above 0.5
    pair, values = spectra["internal/L4"], spectra["internal/L4"]["eigenvalues"]
    cells = [pair["groups"], f"{pair['trivial']:.3f}", f"{values[0]:.3f}", f"{sum(values[:10]) / len(values[:10]):.3f}"]
    cells += [sum(v < 0.1 for v in values), sum(v > 0.5 for v in values), len(values)]
    assert "<tr><td>internal/L4</td>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>" in page


def test_analyze_overwrite_leaves_no_basis_figure_of_the_earlier_report(checkpoints, tmp_path):
    """``--overwrite`` into the folder of an earlier report with other layers: its ``basis_<layer>.png`` go once the
    new files are in place (as ``hfmca export`` removes an earlier export's embeddings), so the folder holds one
    report, the one its index.html shows."""
    out = tmp_path / "analysis"
    arguments = ["analyze", "--ckpt_path", str(checkpoints["selfsupervised"]), "--out", str(out)]
    arguments += ["--num_batches", "1", "--num_images", "1"]
    main([*arguments, "--layers", "L1", "L3"])
    assert {"basis_L1.png", "basis_L3.png"} <= {p.name for p in out.iterdir()}
    main([*arguments, "--layers", "L2", "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == [
        "basis_L2.png",
        "density_ratio.png",
        "index.html",
        "spectra.json",
        "spectra.png",
    ]
    assert "basis_L2.png" in (out / "index.html").read_text()


def test_with_batch_statistics_an_image_s_maps_do_not_depend_on_the_images_drawn_with_it(
    checkpoints, tmp_path, monkeypatch
):
    """``--batch_norm batch`` (auto's choice for this 3-step run): the figures' test images are normalised with the
    statistics of a training batch, not with their own, so test image 0's heatmaps and basis functions are the same
    drawn alone (``--num_images 1``) or with others (they were not: 8 images against 1 moved half the basis pixels
    of the demo), up to float32 rounding. The noise channels' draws are made the same for every image (one seeded
    draw per map size), so that they do not depend on the batch either."""
    import hfmca_lightning.cli.analyze as analyze_module
    from hfmca_lightning.models.layers import NoiseChannels

    def same_noise_for_every_image(self, x):
        with torch.random.fork_rng():
            torch.manual_seed(x.shape[-1])
            noise = torch.rand(1, self.num_channels, *x.shape[2:], dtype=x.dtype, device=x.device)
        return torch.cat([x, noise.expand(x.shape[0], -1, -1, -1)], dim=1)

    monkeypatch.setattr(NoiseChannels, "forward", same_noise_for_every_image)

    drawn: dict[str, Any] = {}
    overlay, basis = analyze_module.heatmap_overlay_figure, analyze_module.basis_functions_figure

    def overlay_spy(images, maps, **options):
        drawn["heatmaps"] = {name: values[0].clone() for name, values in maps.items()}  # test image 0's
        return overlay(images, maps, **options)

    def basis_spy(maps, values, **options):
        drawn.setdefault("basis", []).append(maps.clone())
        return basis(maps, values, **options)

    monkeypatch.setattr(analyze_module, "heatmap_overlay_figure", overlay_spy)
    monkeypatch.setattr(analyze_module, "basis_functions_figure", basis_spy)
    runs = {}
    for count in (1, 8):
        drawn.clear()
        out = tmp_path / f"images_{count}"
        arguments = ["--out", str(out), "--num_batches", "1", "--num_images", str(count), "--layers", "L1", "L2"]
        main(["analyze", "--ckpt_path", str(checkpoints["selfsupervised"]), *arguments])
        assert json.loads((out / "spectra.json").read_text())["batch_norm"] == "batch"
        runs[count] = dict(drawn)
    assert list(runs[1]["heatmaps"]) == list(runs[8]["heatmaps"]) == ["L1", "L2"]
    for name, alone in runs[1]["heatmaps"].items():
        with_others = runs[8]["heatmaps"][name]
        torch.testing.assert_close(with_others, alone, rtol=1e-4, atol=1e-5 * float(alone.abs().max()))
    assert len(runs[1]["basis"]) == len(runs[8]["basis"]) == 2
    for alone, with_others in zip(runs[1]["basis"], runs[8]["basis"]):
        torch.testing.assert_close(with_others, alone, rtol=1e-4, atol=1e-5 * float(alone.abs().max()))
    assert "normalised with the statistics of the first training batch" in (out / "index.html").read_text()


def test_analyze_draws_test_images_of_the_chosen_class(checkpoints, tmp_path, monkeypatch):
    import hfmca_lightning.cli.analyze as analyze_module

    drawn = {}
    original = analyze_module.heatmap_overlay_figure

    def spy(images, maps, **options):
        drawn["images"] = images
        assert set(maps) <= set(options["placements"])  # every drawn map is placed on the image by its geometry
        return original(images, maps, **options)

    monkeypatch.setattr(analyze_module, "heatmap_overlay_figure", spy)
    main(
        [
            "analyze",
            "--ckpt_path",
            str(checkpoints["selfsupervised"]),
            "--out",
            str(tmp_path / "by_class"),
            "--num_batches",
            "1",
            "--num_images",
            "2",
            "--image_class",
            "1",
        ]
    )
    _, datamodule = load_run(checkpoints["selfsupervised"])
    images, targets = figure_images(datamodule, 2, target=1)
    assert targets.tolist() == [1, 1]
    torch.testing.assert_close(drawn["images"], denormalise(datamodule, images), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--layers", "L42"], "--layers: L42 is not among this model's internal cost layers; choose from L1 L2"),
        (["--image_class", "99"], "the evaluation split has no images of class 99 from index 0 on"),
        (["--first_image", "100000"], "the evaluation split has no images from index 100000 on"),
    ],
    ids=["unknown layer", "class without test images", "first image past the split"],
)
def test_figure_options_that_select_nothing_are_refused_before_the_statistics_pass(
    checkpoints, tmp_path, monkeypatch, capsys, options, message
):
    import hfmca_lightning.cli.analyze as analyze_module

    def statistics_pass(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the statistics pass ran")

    monkeypatch.setattr(analyze_module, "_enough_batches", statistics_pass)
    arguments = ["analyze", "--ckpt_path", str(checkpoints["selfsupervised"]), "--out", str(tmp_path / "a")]
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, *options])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err.splitlines()[-1], err


def test_loaded_run_has_the_checkpoint_weights(checkpoints):
    module, _ = load_run(checkpoints["unsupervised"])
    saved = torch.load(checkpoints["unsupervised"], weights_only=True)["state_dict"]
    for key, value in module.state_dict().items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
        else:  # modules' extra state: the spectrum CNN's layout
            assert value == saved[key] == {"layout": "paper"}, key
    assert not module.training


def compare(ckpt_a: Path, ckpt_b: Path, out: Path, *options: str) -> None:
    """``hfmca compare`` of two checkpoints over one batch, with further command-line ``options``."""
    main(
        ["compare", "--ckpt_a", str(ckpt_a), "--ckpt_b", str(ckpt_b), "--out", str(out), "--num_batches", "1", *options]
    )


def test_compare_writes_cross_model_spectra(checkpoints, tmp_path):
    out = tmp_path / "compare"
    compare(checkpoints["selfsupervised"], checkpoints["unsupervised"], out)
    report = json.loads((out / "cross_spectra.json").read_text())
    # the two checkpoints, by path, in the report and on its page (their runs' names may be the same)
    paths = {"a": str(checkpoints["selfsupervised"]), "b": str(checkpoints["unsupervised"])}
    assert report["checkpoints"] == paths
    page = (out / "index.html").read_text()
    assert f"A: {paths['a']}" in page and f"B: {paths['b']}" in page
    spectra = report["pairs"]
    # the training names; no backbone column, which would repeat L9's output; no LF: the unsupervised run has no head
    assert list(spectra) == [f"internal/L{i}" for i in range(1, 10)]
    assert all(0 <= value < 1 for pair in spectra.values() for value in pair["eigenvalues"])
    assert (out / "cross_spectra.png").stat().st_size > 10_000
    # the tiny test split gives L1 fewer groups than 100 per feature: the page says so, at the analysis reg
    short = [name for name, pair in spectra.items() if pair["groups"] < pair["groups_needed"]]
    assert short and all(f"{name}: {spectra[name]['groups']:,} groups, fewer than the" in page for name in short)
    assert {pair["reg"] for pair in spectra.values()} == {1e-3}


def test_a_model_compared_with_itself_is_fully_aligned(checkpoints, tmp_path, monkeypatch):
    """With the noise channels' draws the same in both passes (a fixed seed per draw), the two passes see the same
    features, whose eigenvalues are ``(s / (s + reg))^2`` for the eigenvalues ``s`` of their second moments: at
    ``reg = 1e-8`` all above 0.95, at every layer."""
    from hfmca_lightning.cli.analyze import compare as compare_runs
    from hfmca_lightning.models.layers import NoiseChannels

    real_forward = NoiseChannels.forward

    def seeded(self, x):
        with torch.random.fork_rng():
            torch.manual_seed(x.shape[-1])
            return real_forward(self, x)

    monkeypatch.setattr(NoiseChannels, "forward", seeded)
    out = tmp_path / "self"
    compare_runs(checkpoints["unsupervised"], checkpoints["unsupervised"], out, num_batches=1, reg=1e-8)
    spectra = json.loads((out / "cross_spectra.json").read_text())["pairs"]
    for name, pair in spectra.items():
        assert min(pair["eigenvalues"]) > 0.95, name


def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    """Without fit's advice of ``--ckpt_path last``, which only fit, validate and test take."""
    with pytest.raises(SystemExit):
        main(["analyze", "--ckpt_path", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "hfmca: error: checkpoint not found" in err and "last" not in err, err


@pytest.mark.parametrize("command", ["analyze", "compare a", "compare b"])
def test_a_missing_checkpoint_names_its_option_and_creates_no_out_folder(tmp_path, capsys, command):
    """The checkpoint is checked before ``--out`` is made: a mistyped path leaves no empty folder behind, and
    ``compare``'s line names the option that was wrong."""
    present, missing, out = tmp_path / "present.ckpt", tmp_path / "nothere.ckpt", tmp_path / "out" / "analysis"
    present.write_bytes(b"")
    arguments, option = {
        "analyze": (["analyze", "--ckpt_path", str(missing)], "--ckpt_path"),
        "compare a": (["compare", "--ckpt_a", str(missing), "--ckpt_b", str(present)], "--ckpt_a"),
        "compare b": (["compare", "--ckpt_a", str(present), "--ckpt_b", str(missing)], "--ckpt_b"),
    }[command]
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.strip() == f"hfmca: error: checkpoint not found: {missing}. Check {option}."
    assert not (tmp_path / "out").exists()


def test_analyze_says_how_many_test_images_of_the_class_it_draws(checkpoints, tmp_path, capsys):
    """``--num_images`` above the class's test images: the line gives the count drawn, not the count asked for."""
    _, datamodule = load_run(checkpoints["selfsupervised"])
    available = len(figure_images(datamodule, 20, target=3)[0])
    assert available < 20
    arguments = ["--out", str(tmp_path / "a"), "--num_batches", "1", "--num_images", "20", "--image_class", "3"]
    main(["analyze", "--ckpt_path", str(checkpoints["selfsupervised"]), *arguments])
    err = capsys.readouterr().err
    assert f"hfmca: density-ratio heatmaps and basis functions of {available} test images\n" in err, err


@pytest.fixture(scope="module")
def narrow_three_pools(tmp_path_factory) -> Path:
    """The unsupervised spectrum run with 4 channels instead of 6, in the ``three_pools`` layout, on 16 x 16 images.
    On 32 x 32 images, beside the paper layout's maps (L1-L2 34 x 34, L3-L4 17, L5-L6 8, L7-L8 4, L9 1), its L1-L4
    maps have other sizes (32, 16), its L5-L8 maps differ only in channels, and its L9 map is 2 x 2 (its 16-pixel
    4 x 4 pool)."""
    root = tmp_path_factory.mktemp("narrow")
    backbone = {"class_path": "hfmca_lightning.models.SpectrumCNN", "init_args": {"channels": 4, "hidden_dim": 8}}
    backbone["init_args"].update(noise_channels=2, layout="three_pools", image_size=16)
    overrides = tiny_overrides(
        root,
        model={"init_args": {"backbone": backbone}},
        **{"data.init_args.batch_size": 4, "data.init_args.source.init_args.train_per_class": 10},
        **{"trainer.limit_val_batches": 0, "data.init_args.source.init_args.image_size": 16},
    )
    config = str(REPO / "configs" / "spectrum_unsupervised.yaml")
    main(["fit", "--config", config, "--config", str(overrides), "--trainer.limit_train_batches", "2"])
    return root / "checkpoints" / "last.ckpt"


def test_compare_pairs_layers_of_other_widths_and_names_those_of_other_sizes(
    checkpoints, narrow_three_pools, tmp_path, capsys
):
    """The cross-spectrum of ``K1`` and ``K2`` features at the same positions is defined for ``K1 != K2``: layers of
    other channel counts are compared (``min(K1, K2)`` eigenvalues); layers whose maps differ in spatial size (no
    common positions) are left out with a note that names them, and a command left with no pair at all says why, in
    one line (it said the data split was empty)."""
    out = tmp_path / "widths"
    compare(checkpoints["unsupervised"], narrow_three_pools, out)
    spectra = json.loads((out / "cross_spectra.json").read_text())["pairs"]
    assert list(spectra) == [f"internal/L{i}" for i in range(5, 9)]  # 6 against 4 channels
    assert all(len(pair["eigenvalues"]) == 4 - 1 for pair in spectra.values())  # the constant function's apart
    assert all(0 <= value < 1 for pair in spectra.values() for value in pair["eigenvalues"])
    skipped = (
        "internal/L1 (A 6 x 34 x 34, B 4 x 32 x 32); internal/L2 (A 6 x 34 x 34, B 4 x 32 x 32); "
        "internal/L3 (A 6 x 17 x 17, B 4 x 16 x 16); internal/L4 (A 6 x 17 x 17, B 4 x 16 x 16); "
        "internal/L9 (A 6 x 1 x 1, B 4 x 2 x 2)."
    )
    assert f"Left out, maps of different spatial sizes (the cross-spectrum needs the same positions): {skipped}" in (
        (out / "index.html").read_text()
    )
    assert "hfmca: warning: Left out, maps of different spatial sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        compare(checkpoints["unsupervised"], narrow_three_pools, tmp_path / "none", "--layers", "blocks.L9")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert last == (
        "hfmca: error: no layer of the two models can be compared: internal/L9 (A 6 x 1 x 1, B 4 x 2 x 2). The "
        "cross-spectrum pairs the features at the same positions, so the maps must have the same spatial size "
        "(channels may differ); choose such layers with --layers"
    )


def test_compare_puts_hfmca_beside_simclr(checkpoints, tmp_path):
    """A baseline's checkpoint compares with an HFMCA one at the same backbone modules (by name)."""
    out = tmp_path / "hfmca_vs_simclr"
    compare(checkpoints["selfsupervised"], checkpoints["simclr"], out)
    spectra = json.loads((out / "cross_spectra.json").read_text())["pairs"]
    assert list(spectra) == [f"internal/L{i}" for i in range(1, 10)]
    assert all(0 <= value < 1 for pair in spectra.values() for value in pair["eigenvalues"])
    assert "SimCLR" in (out / "index.html").read_text()


def test_compare_equals_the_eigenvalues_of_the_two_models_features(checkpoints, tmp_path):
    """The cross spectrum at the output is that of group_statistics between the two models' features."""
    from hfmca_lightning.losses.statistics import group_statistics

    out = tmp_path / "check"
    compare(
        checkpoints["selfsupervised"], checkpoints["simclr"], out, "--layers", "blocks.L2", "--batch_norm", "running"
    )
    spectra = json.loads((out / "cross_spectra.json").read_text())["pairs"]
    assert list(spectra) == ["internal/L2", "backbone"]
    model_a, data = load_run(checkpoints["selfsupervised"])
    model_b, _ = load_run(checkpoints["simclr"])
    images, _ = next(iter(data.val_dataloader()[1]))
    with torch.no_grad():
        stats = group_statistics(model_a(images).double()[:, None], model_b(images).double())
    expected = decompose(stats, reg=1e-3).eigenvalues
    bound = 6 * eigenvalue_error(stats, 1e-3)  # the command's float64 computation and this one (see eigenvalue_error)
    assert spectra["backbone"]["trivial"] == pytest.approx(float(expected[0]), rel=0, abs=bound)
    torch.testing.assert_close(
        torch.tensor(spectra["backbone"]["eigenvalues"], dtype=torch.float64), expected[1:], rtol=0, atol=bound
    )


def test_analyze_takes_a_baseline_checkpoint(checkpoints, tmp_path):
    out = tmp_path / "simclr_analysis"
    main(
        [
            "analyze",
            "--ckpt_path",
            str(checkpoints["simclr"]),
            "--out",
            str(out),
            "--num_batches",
            "1",
            "--num_images",
            "2",
            "--internal_layers",
            "blocks.L2",
            "blocks.L4",
            "blocks.L6",
            "--layers",
            "L2",
        ]
    )
    report = json.loads((out / "spectra.json").read_text())
    spectra = report["pairs"]
    assert list(spectra) == ["internal/L2", "internal/L4", "internal/L6"]
    # the baseline's backbone outputs of its two views: all four health values, from the one batch's 4 images
    health = report["health"]
    assert (health["samples"], health["views"]) == (4, 2) and None not in health.values()
    assert all(0 <= value <= 1 for pair in spectra.values() for value in pair["eigenvalues"])
    assert (out / "density_ratio.png").exists() and (out / "basis_L2.png").exists()


def test_analyze_of_a_baseline_is_at_the_analysis_reg_in_forward_order_and_says_when_groups_are_short(
    checkpoints, tmp_path, monkeypatch
):
    """The pairs added to a baseline are at reg 1e-3, as the training-time spectra of its hooked layers (they were at
    the training default 0.1: top-10 means about half the logged ones); layers given out of forward order are taken
    in it (a traceback from the heatmaps before); a pair short of its groups says so on the page; the basis-function
    figure leaves out the constant function, as every other figure does."""
    from hfmca_lightning.cli import analyze

    drawn: list[list[float]] = []

    def basis_functions_figure(maps: Any, eigenvalues: Any, **options: Any) -> Any:
        assert maps.shape[0] == len(eigenvalues)
        drawn.append(eigenvalues.tolist())
        return real_figure(maps, eigenvalues, **options)

    real_figure = analyze.basis_functions_figure
    monkeypatch.setattr(analyze, "basis_functions_figure", basis_functions_figure)
    out = tmp_path / "analysis"
    layers = ["--internal_layers", "blocks.L6", "blocks.L2", "blocks.L4", "--layers", "L2"]
    main(["analyze", "--ckpt_path", str(checkpoints["simclr"]), "--out", str(out), "--num_batches", "1", *layers])
    spectra = json.loads((out / "spectra.json").read_text())["pairs"]
    assert list(spectra) == ["internal/L2", "internal/L4", "internal/L6"]
    assert {pair["reg"] for pair in spectra.values()} == {1e-3}
    short = spectra["internal/L6"]
    assert short["groups"] < short["groups_needed"] == 100 * 6  # 6 channels
    page = (out / "index.html").read_text()
    assert f"internal/L6: {short['groups']:,} groups, fewer than the 600 its spectrum needs" in page
    assert drawn == [spectra["internal/L2"]["eigenvalues"][: len(drawn[0])]] and len(drawn[0]) > 1


def test_analyze_health_is_over_as_many_samples_as_the_training_time_metrics():
    """2 D samples (docs/conventions.md §9): the batches drawn for the spectra beyond them are not added."""
    from hfmca_lightning.cli.analyze import HEALTH_SAMPLES_PER_DIM, HealthSums

    sums = HealthSums()
    for _ in range(5):
        sums.add(torch.randn(8 * 2, 4), torch.zeros(8, 2, 3, 4, 4))  # 8 samples of 2 views, 4-d features
    assert HEALTH_SAMPLES_PER_DIM * 4 == 8 and sums.summary()["samples"] == 8


def test_residual_blocks_are_found_by_default():
    from hfmca_lightning.methods.inspection import residual_blocks
    from hfmca_lightning.models import CIFARResNet18

    assert residual_blocks(CIFARResNet18()) == [
        f"net.layer{stage}.{block}" for stage in range(1, 5) for block in range(2)
    ]


def _two_demo_steps_analysed(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """The shrunk demo (with ``overrides``) trained 2 steps, then ``hfmca analyze`` of its checkpoint: the pairs of
    its spectra.json."""
    overrides_file = tiny_overrides(tmp_path, **overrides)
    main(["fit", "--config", str(DEMO), "--config", str(overrides_file), "--trainer.limit_train_batches", "2"])
    out = tmp_path / "analysis"
    main(
        ["analyze", "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt"), "--out", str(out), "--num_images", "2"]
    )
    return json.loads((out / "spectra.json").read_text())["pairs"]


def test_analyze_of_the_demo_looks_inside_its_conv_stages(tmp_path, capsys):
    """The demo's SmallConvNet trains without internal costs; ``analyze`` still reports every stage's spectrum (float64
    statistics of ``features.0`` .. ``features.2``), the external pair's, heatmaps and basis functions."""
    import copy

    from tests.helpers import DEMO_TINY_MODEL

    model = copy.deepcopy(DEMO_TINY_MODEL)
    model["init_args"]["backbone"]["init_args"]["num_stages"] = 3
    model["init_args"]["projector"]["init_args"]["input_dim"] = 32
    spectra = _two_demo_steps_analysed(tmp_path, model=model)
    assert list(spectra) == ["internal/features.0", "internal/features.1", "internal/features.2", "external"]
    # min(K_in, K_out) eigenvalues, less the constant function's: RGB -> 8 -> 16 -> 32 channels; 16-d views and head
    counts = {"internal/features.0": 2, "internal/features.1": 7, "internal/features.2": 15, "external": 15}
    assert {name: len(pair["eigenvalues"]) for name, pair in spectra.items()} == counts
    figures = sorted(p.name for p in (tmp_path / "analysis").glob("*.png"))
    assert figures == [
        "basis_features.0.png",
        "basis_features.1.png",
        "basis_features.2.png",
        "density_ratio.png",
        "spectra.png",
    ]
    assert "BatchNorm running statistics have seen only 2 batches" in capsys.readouterr().err
    assert_every_figure_loads_in_a_browser(tmp_path / "analysis" / "index.html", expected=len(figures))


def assert_every_figure_loads_in_a_browser(page: Path, expected: int) -> None:
    """Chromium, headless (where installed, e.g. Debian's ``chromium``), loads the report and counts the figures it
    could decode (the page's own ``data-figures-loaded``); elsewhere only the page's references are checked."""
    import re
    import shutil
    import subprocess

    sources = re.findall(r"<img src='([^']+)'>", page.read_text())
    assert len(sources) == expected and all((page.parent / source).is_file() for source in sources)
    browser = next(
        (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
    )
    if browser is None:
        return
    dom = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--allow-file-access-from-files",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert f'data-figures-loaded="{expected}"' in dom, dom[-2000:]


@pytest.mark.extended
@pytest.mark.integration  # a short training run
def test_analyze_reports_the_training_time_spectra_of_the_step(tmp_path, capsys):
    """After a few steps (young BatchNorm running statistics), ``analyze`` of the last checkpoint reports every
    internal pair's mean of the top 10 within 0.05 of the spectra the training logged at that step, and says that it
    used the batches' own BatchNorm statistics; with the running ones (eval mode) the spectra are far off."""
    import csv

    model = copy_of_tiny_spectrum()
    callbacks = [
        {"class_path": "hfmca_lightning.callbacks.EigenspectrumCallback", "init_args": {"every_n_steps": 1}},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "checkpoints"), "save_last": True},
        },
    ]
    overrides = tiny_overrides(
        tmp_path,
        model=model,
        **{
            "data.init_args.batch_size": 4,
            "data.init_args.source.init_args.train_per_class": 20,  # 20 steps: L9 (36 groups a step) needs 17
            "trainer.limit_val_batches": 0,
            "trainer.log_every_n_steps": 1,
            "trainer.callbacks": callbacks,
        },
    )
    main(["fit", "--config", str(REPO / "configs" / "spectrum_selfsupervised.yaml"), "--config", str(overrides)])
    (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
    rows = list(csv.DictReader(open(metrics)))
    last_step = max(int(row["step"]) for row in rows if row.get("spectrum/internal/L1/top10_mean"))
    logged = {
        name: float(row[f"spectrum/{name}/top10_mean"])
        for row in rows
        if int(row["step"]) == last_step
        for name in (f"internal/L{i}" for i in range(1, 10))
        if row.get(f"spectrum/{name}/top10_mean")
    }
    assert len(logged) == 9
    reports = {}
    for norm in ("auto", "running"):
        out = tmp_path / norm
        main(
            [
                "analyze",
                "--ckpt_path",
                str(tmp_path / "checkpoints" / "last.ckpt"),
                "--out",
                str(out),
                "--batch_norm",
                norm,
                "--num_images",
                "2",
            ]
        )
        pairs = json.loads((out / "spectra.json").read_text())["pairs"]
        reports[norm] = {
            name: sum(pairs[name]["eigenvalues"][:10]) / len(pairs[name]["eigenvalues"][:10]) for name in logged
        }
    assert "using each batch's own statistics" in capsys.readouterr().err
    for name, value in logged.items():
        assert abs(reports["auto"][name] - value) <= 0.05, (name, reports["auto"][name], value)
    assert max(abs(reports["running"][name] - value) for name, value in logged.items()) > 0.05


def copy_of_tiny_spectrum() -> dict:
    import copy

    return copy.deepcopy(TINY_SPECTRUM)


@pytest.mark.parametrize(
    "changes",
    [
        {"drawer": {"class_path": "hfmca_lightning.data.ResidentDrawer", "init_args": {"batches_per_call": 2}}},
        {"views": {"class_path": "hfmca_lightning.data.MultiCrop", "init_args": {"global_crops": 2, "local_crops": 2}}},
    ],
    ids=["training set on the device", "multi-crop"],
)
def test_analyze_draws_its_groups_through_the_runs_own_spec_and_drawer(tmp_path, changes):
    """A run trained with the training set kept on the device (its loader yields indices and seeds) or on multi-crop
    views (groups of two sizes): ``analyze`` draws the training groups as training did and reports every pair."""
    spectra = _two_demo_steps_analysed(tmp_path, **{f"data.init_args.{key}": value for key, value in changes.items()})
    assert "external" in spectra and len(spectra) >= 2
    assert all(
        pair["eigenvalues"] and all(0 <= value <= 1 for value in pair["eigenvalues"]) for pair in spectra.values()
    )
