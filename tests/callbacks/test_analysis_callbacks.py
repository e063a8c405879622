"""Eigenspectrum and density-ratio callbacks on a real (tiny) spectrum-CNN run."""

from __future__ import annotations

import csv
import operator
from functools import reduce
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.analysis import eigenspectrum
from hfmca_lightning.callbacks import DensityRatioHeatmapCallback, EigenspectrumCallback
from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation_data import denormalise, figure_batches, figure_images, labelled_splits
from hfmca_lightning.losses import WindowGeometry
from hfmca_lightning.methods import HFMCAModule
from tests.helpers import (
    FLOAT32_UNIT,
    FLOAT64_UNIT,
    eigenvalue_error,
    gamma,
    quiet_trainer,
    tiny_data,
    tiny_spectrum_module,
)


def reference_eigenvalues(stats, reg):
    """sigma = eig(C^-1 P^T A^-1 P), numpy, from the statistics' means."""
    r1, r2, cross = (m.numpy() for m in stats.means())
    a, c = r1 + reg * np.eye(len(r1)), r2 + reg * np.eye(len(r2))
    return np.sort(np.linalg.eigvals(np.linalg.solve(c, cross.T @ np.linalg.solve(a, cross))).real)[::-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("analysis_callbacks")
    module = tiny_spectrum_module()
    spectrum = EigenspectrumCallback(every_n_steps=1, top_k=5, min_groups=1)
    heatmaps = DensityRatioHeatmapCallback(num_images=3, layers=["L1", "L5"], statistics_images=9)  # the 9 test images
    trainer = quiet_trainer(
        max_epochs=1,
        logger=CSVLogger(tmp, name="run"),
        callbacks=[spectrum, heatmaps],
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    trainer.fit(module, tiny_data())
    return module, spectrum, trainer


class ReferenceSpectra(Callback):
    """Before each training step, the statistics of the batch about to be trained on, computed independently by a
    separate no-grad forward with the same weights, and the public ``eigenspectrum`` of its view / group features."""

    def __init__(self) -> None:
        self.statistics: dict[int, dict] = {}
        self.external: dict[int, np.ndarray] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        views = batch[0]
        with torch.no_grad():
            collected = pl_module.collect(views)
            view_features, group_features = pl_module.encode_views(views)
        step = trainer.global_step + 1  # the step number once this batch's optimiser step is done
        self.statistics[step] = collected.statistics
        reg = pl_module.cost_modules()["external"].reg
        self.external[step] = eigenspectrum(view_features, group_features, reg=reg).numpy()


def cost_module_attributes(module: HFMCAModule) -> dict[str, dict]:
    """Every cost module's plain attributes (not parameters, buffers or submodules)."""
    return {
        name: {k: v for k, v in vars(cost).items() if not k.startswith("_")}
        for name, cost in module.cost_modules().items()
    }


def test_logged_spectra_are_those_of_the_steps_since_the_last_log_once_per_schedule(tmp_path):
    """With ``min_groups: 1`` the window is the steps since the last log: step 1 alone, then steps 2 and 3. Logged:
    the eigenvalues after the first (the constant function's, logged as ``trivial``) of numpy's ``C^-1 P^T A^-1 P``
    of the summed statistics, and the window's group count."""
    torch.manual_seed(0)
    module = tiny_spectrum_module(noise_channels=0)  # no noise: the reference forward sees the training features
    # float64 statistics: the training forward (with gradients) and the reference's (without) then differ by float64
    # rounding only, where float32 products may fold their sums differently in the two
    module.internal_costs.precision = "float64"
    attributes_before = cost_module_attributes(module)
    reference = ReferenceSpectra()
    spectrum = EigenspectrumCallback(every_n_steps=2, top_k=5, min_groups=1)
    trainer = quiet_trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[reference, spectrum],
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    trainer.fit(module, tiny_data())
    rows = list(csv.DictReader(open(Path(trainer.log_dir) / "metrics.csv")))
    costs = module.cost_modules()
    names = {"external", *(f"internal/L{i}" for i in range(1, 10))}
    windows = {1: (1,), 3: (2, 3)}
    for name in names:
        logged = [row for row in rows if row.get(f"eigenvalues/{name}/01")]
        assert [int(row["step"]) for row in logged] == [0, 2], f"{name}: logged once at steps 1 and 3 (batches 0 and 2)"
        for row, step in zip(logged, windows):
            stats = reduce(operator.add, (reference.statistics[s][name] for s in windows[step]))
            expected = reference_eigenvalues(stats, costs[name].reg)
            got = [float(row[f"eigenvalues/{name}/{rank:02d}"]) for rank in range(1, 6)]
            # two float64 eigen-solvers (SVD of the whitened cross-correlation W; numpy's eigenvalues of
            # C^-1 P^T A^-1 P): W carries a relative error e = 4 n u (kappa(A) + kappa(C)) in each, so its singular
            # values move by at most e ||W|| <= e (Weyl; ||W|| < 1) and sigma = s^2 by at most 3 e; the sum of two
            # steps adds float64 rounding of the same order; the CSV prints float32 (2^-24 of values <= 1)
            tolerance = 6 * eigenvalue_error(stats, costs[name].reg) + FLOAT32_UNIT
            assert float(row[f"spectrum/{name}/trivial"]) == pytest.approx(expected[0], rel=0, abs=tolerance)
            np.testing.assert_allclose(got, expected[1:6], rtol=0, atol=tolerance)
            assert float(row[f"spectrum/{name}/top1"]) == pytest.approx(expected[1], rel=0, abs=tolerance)
            top10 = expected[1:11].mean()
            assert float(row[f"spectrum/{name}/top10_mean"]) == pytest.approx(top10, rel=0, abs=tolerance)
            assert float(row[f"spectrum/{name}/num_above_0.5"]) == float((expected[1:] > 0.5).sum())
            assert float(row[f"spectrum/{name}/groups"]) == float(stats.group_count)
    for step in (1, 3):  # the public eigenspectrum and numpy's eigenvalues of the same features: two solvers
        stats = reference.statistics[step]["external"]
        tolerance = 6 * eigenvalue_error(stats, costs["external"].reg)
        expected = reference_eigenvalues(stats, costs["external"].reg)
        np.testing.assert_allclose(reference.external[step], expected, rtol=0, atol=tolerance)
    # Nothing per batch lives on the cost modules: their plain attributes are what the constructor set.
    assert cost_module_attributes(module) == attributes_before


def test_figures_are_written_under_the_run_directory(trained):
    _, _, trainer = trained
    figures = sorted(
        p.name for p in (trainer.log_dir and __import__("pathlib").Path(trainer.log_dir) / "figures").glob("*.png")
    )
    assert figures == ["density_ratio_epoch000.png", "layer_spectra_epoch000.png", "learning_dynamics_epoch000.png"]


def test_heatmap_callback_rejects_unknown_layers():
    module = tiny_spectrum_module()
    callback = DensityRatioHeatmapCallback(layers=["L42"])
    trainer = Trainer(
        max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(
        ConfigurationError, match=r"layers: L42 is not among the module's internal cost layers; choose from L1 "
    ):
        trainer.fit(module, tiny_data())


def test_heatmap_callback_refuses_a_run_without_a_data_module_before_training():
    """Its figures come from a MultiViewDataModule's images: plain loaders are one line at fit start, not a crash at
    the first figure epoch."""
    module = tiny_spectrum_module()
    loader = tiny_data().train_dataloader()
    trainer = quiet_trainer(max_epochs=1, callbacks=[DensityRatioHeatmapCallback(layers=["L1"])], limit_val_batches=0)
    with pytest.raises(
        ConfigurationError, match=r"from the images of a MultiViewDataModule, and this run has no data "
    ):
        trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == 0


def test_heatmaps_decompose_statistics_accumulated_over_many_images_not_the_drawn_ones(tmp_path, monkeypatch):
    """The decomposition the figure is drawn with comes from the first ``statistics_images`` evaluation images
    (float64, eval mode), not from the 3 drawn images."""
    import hfmca_lightning.callbacks.heatmaps as heatmaps_module
    from hfmca_lightning.methods.inspection import collect_statistics

    used = {}
    original = heatmaps_module.density_ratio_heatmaps

    def spy(module, images, statistics=None):
        used["statistics"], used["images"] = statistics, images.shape[0]
        return original(module, images, statistics)

    monkeypatch.setattr(heatmaps_module, "density_ratio_heatmaps", spy)
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=10),
        views=SimCLRViews(count=4),
        batch_size=6,
        eval_batch_size=7,
        num_workers=0,
    )
    callback = DensityRatioHeatmapCallback(num_images=3, layers=["L1"], statistics_images=24, output_dir=str(tmp_path))
    module = tiny_spectrum_module(noise_channels=0)
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=0,
        callbacks=[callback],
    )
    trainer.fit(module, data)
    assert used["images"] == 3 and callback.last_statistics_images == 24
    images = torch.cat(list(figure_batches(data, 24)))  # the split's first 24
    expected = collect_statistics(module, [images])
    for name, stats in expected.items():
        got = used["statistics"][name]
        assert (
            int(got.group_count)
            == int(stats.group_count)
            > int(collect_statistics(module, [images[:3]])[name].group_count)
        )
        # float64 sums over the same images in batches of 7 and of 24: non-negative terms (sigmoid maps and their
        # window means), so two orders differ by at most 2 gamma_n of the sum itself, n = the pair's members. The maps
        # are float32 forward passes, and oneDNN blocks a convolution by batch size and thread count, so a map value
        # may differ by a few float32 units between the two batchings, each non-negative term and so the sums by as
        # much relative (measured: up to 1.3e-10 with 2 threads): 8 units more.
        bound = 2 * gamma(int(stats.member_count), FLOAT64_UNIT) + 8 * FLOAT32_UNIT
        torch.testing.assert_close(got.cross_sum, stats.cross_sum, rtol=bound, atol=0)


def test_heatmap_statistics_image_count_must_be_positive():
    with pytest.raises(ConfigurationError, match="statistics_images must be >= 1"):
        DensityRatioHeatmapCallback(statistics_images=0)
    with pytest.raises(ConfigurationError, match="first_image must be >= 0; got -5"):  # read from the split's end
        DensityRatioHeatmapCallback(first_image=-5)
    # before: a TypeError after the first epoch
    with pytest.raises(ConfigurationError, match="num_images must be a whole number >= 1; got 2.5"):
        DensityRatioHeatmapCallback(num_images=2.5)
    # before: the default layers, drawn without a word
    with pytest.raises(ConfigurationError, match="layers is empty; name the internal cost layers to draw"):
        DensityRatioHeatmapCallback(layers=[])


def test_heatmap_images_that_do_not_exist_stop_the_fit_before_its_first_step():
    """``image_class`` names a class the evaluation split lacks: refused when fitting starts, not at the first figure
    ``every_n_epochs`` epochs later."""
    steps = []

    class Steps(Callback):
        def on_train_batch_start(self, *args) -> None:
            steps.append(1)

    callback = DensityRatioHeatmapCallback(layers=["L1"], image_class=99, every_n_epochs=5)
    trainer = quiet_trainer(max_epochs=5, limit_val_batches=0, callbacks=[callback, Steps()])
    with pytest.raises(ConfigurationError, match="the evaluation split has no images of class 99"):
        trainer.fit(tiny_spectrum_module(), tiny_data())
    assert steps == []


def test_heatmaps_can_show_images_of_one_class(tmp_path, monkeypatch):
    import hfmca_lightning.callbacks.heatmaps as heatmaps_module

    drawn = {}
    original = heatmaps_module.heatmap_overlay_figure

    def spy(images, maps, **options):
        drawn["images"], drawn["placements"] = images, options["placements"]
        return original(images, maps, **options)

    monkeypatch.setattr(heatmaps_module, "heatmap_overlay_figure", spy)
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=4),
        views=SimCLRViews(count=4),
        batch_size=6,
        num_workers=0,
    )
    callback = DensityRatioHeatmapCallback(
        num_images=3, layers=["L1"], statistics_images=12, image_class=2, first_image=1, output_dir=str(tmp_path)
    )
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=0,
        callbacks=[callback],
    )
    trainer.fit(tiny_spectrum_module(noise_channels=0), data)
    images, targets = figure_images(data, 3, target=2, start=1)
    assert targets.tolist() == [2, 2, 2]
    torch.testing.assert_close(drawn["images"], denormalise(data, images), rtol=0, atol=0)
    # maps are placed on the image by their geometry: L1's input carries L0's padding ring, L3's one 2x2 pool more
    assert drawn["placements"]["L1"] == WindowGeometry(1, 1, 1) and drawn["placements"]["L3"] == WindowGeometry(6, 2, 3)
    split = labelled_splits(data)[1]
    expected = [index for index, target in enumerate(split.targets) if target == 2 and index >= 1][:3]
    torch.testing.assert_close(
        images, torch.stack([data.eval_transform(split[index][0]) for index in expected]), rtol=0, atol=0
    )


def test_a_class_without_images_is_one_clear_error():
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2),
        views=SimCLRViews(count=4),
        batch_size=6,
        num_workers=0,
    )
    with pytest.raises(ConfigurationError, match="no images of class 7"):
        figure_images(data, 3, target=7)


def test_heatmaps_are_drawn_where_their_map_positions_lie_in_the_image():
    from hfmca_lightning.visualization import heatmap_overlay_figure

    images = torch.rand(1, 3, 32, 32)
    maps = {"L2": torch.rand(1, 34, 34), "L6": torch.rand(1, 8, 8), "plain": torch.rand(1, 16, 16)}
    placements = {"L2": WindowGeometry(3, 1, 2), "L6": WindowGeometry(16, 4, 7)}
    figure = heatmap_overlay_figure(images, maps, placements=placements)
    extents = {name: figure.axes[column].get_images()[-1].get_extent() for column, name in enumerate(maps, start=1)}
    assert extents["L2"] == [-1.5, 32.5, 32.5, -1.5]  # position j centred on pixel j - 1: the padding ring lies outside
    assert extents["L6"] == [-1.5, 30.5, 30.5, -1.5]  # centre 4 j - 7 + 7.5 = 4 j + 0.5, four pixels wide
    assert extents["plain"] == [-0.5, 31.5, 31.5, -0.5]  # no placement: stretched over the image
    assert figure.axes[1].get_xlim() == (-0.5, 31.5)  # the view stays on the image


class RecordStatistics(Callback):
    def __init__(self) -> None:
        self.statistics: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.statistics.append(outputs["statistics"])


def test_a_window_holds_the_newest_logged_intervals_that_reach_min_groups():
    """Logs at steps 1, 3, 5, 7 (every 2); with min_groups = 19 (more than three batches of 6 groups), the window at
    step 5 holds the intervals {2, 3} and {4, 5}, at step 7 {4, 5} and {6, 7}; nothing before the first full window
    (step 3: {1} and {2, 3} hold 18 groups, one too few)."""
    from hfmca_lightning.analysis.spectral import decompose

    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=16, test_per_class=3),
        views=SimCLRViews(count=4),
        batch_size=6,
        num_workers=0,
    )
    record = RecordStatistics()
    # external: 6 groups per batch, so more than three batches' worth
    spectrum = EigenspectrumCallback(every_n_steps=2, top_k=5, min_groups=3 * 6 + 1)
    module = tiny_spectrum_module()
    quiet_trainer(max_epochs=1, callbacks=[record, spectrum], limit_val_batches=0).fit(module, data)
    assert len(record.statistics) == 8
    reg = module.cost_modules()["external"].reg
    history = spectrum.history["external"]
    assert [step for step, _ in history] == [5, 7]
    for (_, logged), window in zip(history, (((2, 3), (4, 5)), ((4, 5), (6, 7)))):
        # steps 1..8 are batches 0..7; each interval summed on its own, then the intervals
        steps = [record.statistics[a - 1]["external"] + record.statistics[b - 1]["external"] for a, b in window]
        summed = steps[0] + steps[1]
        assert float(summed.group_count) == 4 * 6
        # the same statistics, added in the same order, decomposed by the same code
        expected = decompose(summed, reg=reg).eigenvalues[1:6].tolist()
        np.testing.assert_allclose(logged, expected, rtol=0, atol=0)
    assert spectrum.window_groups["external"] == 24
    # internal pairs hold hundreds of groups per batch: every interval fills a window of 18 alone
    assert [step for step, _ in spectrum.history["internal/L1"]] == [1, 3, 5, 7]


def test_the_window_round_trips_through_the_checkpoint_state():
    record = RecordStatistics()
    spectrum = EigenspectrumCallback(every_n_steps=2, top_k=5)
    quiet_trainer(max_epochs=1, callbacks=[record, spectrum], limit_val_batches=0).fit(
        tiny_spectrum_module(), tiny_data()
    )
    restored = EigenspectrumCallback(every_n_steps=2, top_k=5)
    restored.load_state_dict(torch.load(_saved(spectrum.state_dict()), weights_only=True))
    assert restored.history == spectrum.history
    assert_same_window(restored, spectrum)
    assert set(restored.window.open) == set(spectrum.window.open) != set()  # 4 batches: the last is after the last log
    assert (
        restored.latest.keys() == spectrum.latest.keys() != set() and restored.window_groups == spectrum.window_groups
    )


def assert_same_window(got: EigenspectrumCallback, expected: EigenspectrumCallback, rtol: float = 0.0) -> None:
    """The same chunks and open sums (group counts and sums), the same last spectra and their group counts."""
    for which in ("chunks", "open"):
        mine, theirs = getattr(got.window, which), getattr(expected.window, which)
        assert set(mine) == set(theirs), which
        for name in theirs:
            pairs = zip(mine[name], theirs[name]) if which == "chunks" else [(mine[name], theirs[name])]
            if which == "chunks":
                assert len(mine[name]) == len(theirs[name])
            for a, b in pairs:
                assert float(a.group_count) == float(b.group_count)
                torch.testing.assert_close(a.cross_sum, b.cross_sum, rtol=rtol, atol=0)
                torch.testing.assert_close(a.low_outer_sum, b.low_outer_sum, rtol=rtol, atol=0)
    assert got.window_groups == expected.window_groups
    assert set(got.latest) == set(expected.latest)
    for name, values in expected.latest.items():
        torch.testing.assert_close(got.latest[name], values, rtol=rtol, atol=1e-12)


def test_with_gradient_accumulation_windows_hold_every_micro_batch():
    """accumulate_grad_batches 2, a log every step: each logged window holds both micro-batches of its step (12
    groups of the external pair: two batches of 6), the first as every later one."""
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=16, test_per_class=3),
        views=SimCLRViews(count=4),
        batch_size=6,
        num_workers=0,
    )
    spectrum = EigenspectrumCallback(every_n_steps=1, top_k=3, min_groups=1)

    class Groups(Callback):
        def __init__(self) -> None:
            self.logged: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx % 2 == 1:  # the micro-batch that completes an optimiser step, after the spectrum's hook
                self.logged.append(spectrum.window_groups["external"])

    groups = Groups()
    trainer = quiet_trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[spectrum, groups], limit_val_batches=0)
    trainer.fit(tiny_spectrum_module(), data)
    assert trainer.global_step == 4 and len(spectrum.history["external"]) == 4
    assert groups.logged == [12, 12, 12, 12]


def test_two_spectrum_callbacks_keep_their_own_state_in_checkpoints(tmp_path):
    def callbacks() -> tuple[EigenspectrumCallback, EigenspectrumCallback]:
        return (
            EigenspectrumCallback(every_n_steps=1, top_k=3, min_groups=1),
            EigenspectrumCallback(every_n_steps=3, top_k=3, min_groups=1),
        )

    fast, slow = callbacks()
    assert fast.state_key != slow.state_key
    trainer = quiet_trainer(max_epochs=1, callbacks=[fast, slow], limit_val_batches=0)
    trainer.fit(tiny_spectrum_module(), tiny_data())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    saved = torch.load(tmp_path / "run.ckpt", weights_only=False)["callbacks"]
    restored_fast, restored_slow = callbacks()
    restored_fast.load_state_dict(saved[restored_fast.state_key])
    restored_slow.load_state_dict(saved[restored_slow.state_key])
    assert restored_fast.history == fast.history and restored_slow.history == slow.history
    assert len(fast.history["external"]) != len(slow.history["external"])


def _saved(state: dict):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize(
    ("name", "value"),
    [
        *(("min_groups", 0), ("groups_per_feature", 0), ("every_n_steps", 0), ("threshold", 1.0)),
        # before: a slice TypeError at the first log, or a log every 5 steps for 2.5
        *(("top_k", 2.5), ("every_n_steps", 2.5), ("min_groups", 10.5)),
        *(("hooked_reg", float("inf")), ("hooked_reg", 0.0), ("threshold", float("nan"))),
    ],
)
def test_bad_window_settings_are_one_clear_error(name, value):
    with pytest.raises(ConfigurationError) as error:
        EigenspectrumCallback(**{name: value})
    assert error.value.parameter == name


def test_min_groups_and_groups_per_feature_together_are_refused():
    """min_groups replaces the window that groups_per_feature scales: both set, one was silently ignored."""
    with pytest.raises(ConfigurationError, match="set min_groups .* or groups_per_feature .*, not both") as error:
        EigenspectrumCallback(min_groups=500, groups_per_feature=1000)
    assert error.value.parameter == "groups_per_feature"
    assert EigenspectrumCallback().window.groups_per_feature == 100
    assert EigenspectrumCallback(groups_per_feature=7).window.groups_per_feature == 7


def test_a_resumed_run_has_the_spectrum_state_of_an_uninterrupted_one(tmp_path):
    """The shrunk demo with a spectrum callback, 2 epochs straight, or 1 epoch, its checkpoint, and the second from
    it: the final checkpoints hold the same history, window (chunks and open interval), last spectra and group
    counts."""
    from tests.helpers import fit, interrupted_fit

    settings = {"every_n_steps": 2, "top_k": 3, "min_groups": 20}
    callbacks = [
        {"class_path": "hfmca_lightning.callbacks.KNNEvaluation", "init_args": {"k": 20}},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": "checkpoints", "save_last": True},
        },
        {"class_path": "hfmca_lightning.callbacks.EigenspectrumCallback", "init_args": settings},
    ]
    states = []
    for folder, interrupted in ((tmp_path / "straight", False), (tmp_path / "resumed", True)):
        callbacks[1]["init_args"]["dirpath"] = str(folder / "checkpoints")
        extra = {"trainer.callbacks": callbacks}
        if interrupted:
            interrupted_fit(folder, 1, "--trainer.max_epochs", "2", **extra)
            fit(folder, "--trainer.max_epochs", "2", "--ckpt_path", "last", **extra)
        else:
            fit(folder, "--trainer.max_epochs", "2", **extra)
        restored = EigenspectrumCallback(**settings)
        saved = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]
        restored.load_state_dict(saved[restored.state_key])
        states.append(restored)
    straight, resumed = states
    assert resumed.history == straight.history and len(straight.history["external"]) == 3  # steps 3, 5, 7
    assert straight.latest and straight.window_groups
    assert_same_window(resumed, straight)


def test_basis_maps_leave_out_the_constant_function():
    """As every count, mean and figure (docs/conventions.md §4): the maps and eigenvalues after the trivial one."""
    from hfmca_lightning.analysis.density_ratio import basis_function_maps
    from hfmca_lightning.methods.inspection import collect_statistics, layer_basis_maps, layer_pairs

    torch.manual_seed(0)
    module = tiny_spectrum_module(noise_channels=0).eval()
    images = torch.rand(6, 3, 32, 32)
    statistics = collect_statistics(module, [images])
    maps, eigenvalues = layer_basis_maps(module, images[0], "L2", statistics)
    (pair,) = [pair for pair in layer_pairs(module, images[:1], statistics) if pair.name == "L2"]
    every = basis_function_maps(pair.decomposition, pair.low_map[0])
    assert torch.equal(eigenvalues, pair.decomposition.eigenvalues[1:]) and torch.equal(maps, every[1:])
    assert maps.shape[0] == every.shape[0] - 1 > 0


def test_the_learning_dynamics_figure_puts_each_spectrum_at_the_step_it_is_logged_under(tmp_path, monkeypatch):
    """The figure took the optimiser steps taken (the logged step + 1): every column sat one step to the right of
    the metrics it draws."""
    import csv

    from hfmca_lightning.callbacks import eigenspectrum as eigenspectrum_module

    drawn: dict[str, list[int]] = {}
    real_figure = eigenspectrum_module.learning_dynamics_figure

    def learning_dynamics_figure(history, **options):
        drawn.update({name: list(steps) for name, (steps, _) in history.items()})
        return real_figure(history, **options)

    monkeypatch.setattr(eigenspectrum_module, "learning_dynamics_figure", learning_dynamics_figure)
    spectrum = EigenspectrumCallback(every_n_steps=2, top_k=3, min_groups=1, output_dir=str(tmp_path / "figures"))
    trainer = quiet_trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[spectrum],
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    trainer.fit(tiny_spectrum_module(), tiny_data())
    (metrics,) = tmp_path.rglob("metrics.csv")
    logged = [int(row["step"]) for row in csv.DictReader(open(metrics)) if row.get("spectrum/external/top1")]
    assert len(logged) > 1 and drawn["external"] == logged
