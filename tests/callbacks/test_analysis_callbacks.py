"""Eigenspectrum and density-ratio callbacks on a real (tiny) spectrum-CNN run."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.analysis import eigenspectrum
from hfmca_lightning.callbacks import DensityRatioHeatmapCallback, EigenspectrumCallback
from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes
from hfmca_lightning.errors import ConfigurationError
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
    spectrum = EigenspectrumCallback(every_n_steps=1, top_k=5)
    heatmaps = DensityRatioHeatmapCallback(num_images=3, layers=["L1", "L5"])
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
    """Before each training step, the spectra of the batch about to be trained on, computed independently:
    the public ``eigenspectrum`` of the view / group features (external) and numpy's eigenvalues of
    ``C^-1 P^T A^-1 P`` (every pair), from a separate no-grad forward with the same weights."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, np.ndarray]] = {}
        self.external: dict[int, np.ndarray] = {}
        self.relative_error: dict[int, dict[str, float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        views = batch[0]
        with torch.no_grad():
            collected = pl_module.collect(views)
            view_features, group_features = pl_module.encode_views(views)
        costs = pl_module.cost_modules()
        step = trainer.global_step + 1  # the step number once this batch's optimiser step is done
        self.by_step[step] = {
            name: reference_eigenvalues(stats, costs[name].reg) for name, stats in collected.statistics.items()
        }
        self.external[step] = eigenspectrum(view_features, group_features, reg=costs["external"].reg).numpy()
        self.relative_error[step] = {
            name: eigenvalue_error(stats, costs[name].reg) for name, stats in collected.statistics.items()
        }


def cost_module_attributes(module: HFMCAModule) -> dict[str, dict]:
    """Every cost module's plain attributes (not parameters, buffers or submodules)."""
    return {
        name: {k: v for k, v in vars(cost).items() if not k.startswith("_")}
        for name, cost in module.cost_modules().items()
    }


def test_logged_spectra_equal_the_eigenspectrum_of_the_same_batch_once_per_schedule(tmp_path):
    torch.manual_seed(0)
    module = tiny_spectrum_module(noise_channels=0)  # no noise: the reference forward sees the training features
    # float64 statistics: the training forward (with gradients) and the reference's (without) then differ by float64
    # rounding only, where float32 products may fold their sums differently in the two
    module.internal_costs.precision = "float64"
    attributes_before = cost_module_attributes(module)
    reference = ReferenceSpectra()
    spectrum = EigenspectrumCallback(every_n_steps=2, top_k=5)
    trainer = quiet_trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[reference, spectrum],
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    trainer.fit(module, tiny_data())
    rows = list(csv.DictReader(open(Path(trainer.log_dir) / "metrics.csv")))
    names = {"external", *(f"internal/L{i}" for i in range(1, 10))}
    for name in names:
        logged = [row for row in rows if row.get(f"eigenvalues/{name}/01")]
        assert [int(row["step"]) for row in logged] == [0, 2], f"{name}: logged once at steps 1 and 3 (batches 0 and 2)"
        for row, step in zip(logged, (1, 3)):
            expected = reference.by_step[step][name]
            got = [float(row[f"eigenvalues/{name}/{rank:02d}"]) for rank in range(1, 6)]
            # two float64 eigen-solvers (SVD of the whitened cross-correlation W; numpy's eigenvalues of
            # C^-1 P^T A^-1 P): W carries a relative error e = 4 n u (kappa(A) + kappa(C)) in each, so its singular
            # values move by at most e ||W|| <= e (Weyl; ||W|| < 1) and sigma = s^2 by at most 3 e; the CSV prints
            # float32 (2^-24 of values <= 1)
            tolerance = 6 * reference.relative_error[step][name] + FLOAT32_UNIT
            np.testing.assert_allclose(got, expected[:5], rtol=0, atol=tolerance)
            assert float(row[f"spectrum/{name}/top1"]) == pytest.approx(expected[0], rel=0, abs=tolerance)
            top10 = expected[:10].mean()
            assert float(row[f"spectrum/{name}/top10_mean"]) == pytest.approx(top10, rel=0, abs=tolerance)
            assert float(row[f"spectrum/{name}/num_above_0.5"]) == float((expected > 0.5).sum())
    for step in (1, 3):  # the public eigenspectrum and numpy's eigenvalues of the same features: two solvers
        external = reference.external[step]
        tolerance = 6 * reference.relative_error[step]["external"]
        np.testing.assert_allclose(external, reference.by_step[step]["external"], rtol=0, atol=tolerance)
    # Nothing per batch lives on the cost modules: their plain attributes are what the constructor set.
    assert cost_module_attributes(module) == attributes_before


def test_figures_are_written_under_the_run_directory(trained):
    _, _, trainer = trained
    figures = sorted(
        p.name for p in (trainer.log_dir and __import__("pathlib").Path(trainer.log_dir) / "figures").glob("*.png")
    )
    assert figures == ["density_ratio_epoch000.png", "layer_spectra_epoch000.png", "learning_dynamics_epoch000.png"]


def test_history_round_trips_through_the_callback_state(trained):
    _, spectrum, _ = trained
    restored = EigenspectrumCallback()
    restored.load_state_dict(spectrum.state_dict())
    assert restored.history == spectrum.history


def test_heatmap_callback_rejects_unknown_layers():
    module = tiny_spectrum_module()
    callback = DensityRatioHeatmapCallback(layers=["L42"])
    trainer = Trainer(
        max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(ConfigurationError, match=r"\['L42'\] are not internal cost layers"):
        trainer.fit(module, tiny_data())


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
        num_views=4,
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
    images, _ = data.evaluation_images(24)
    expected = collect_statistics(module, [images])
    for name, stats in expected.items():
        got = used["statistics"][name]
        assert (
            int(got.group_count)
            == int(stats.group_count)
            > int(collect_statistics(module, [images[:3]])[name].group_count)
        )
        # float64 sums over the same images in batches of 7 and of 24: non-negative terms (sigmoid maps and their
        # window means), so two orders differ by at most 2 gamma_n of the sum itself, n = the pair's members
        bound = 2 * gamma(int(stats.member_count), FLOAT64_UNIT)
        torch.testing.assert_close(got.cross_sum, stats.cross_sum, rtol=bound, atol=0)


def test_heatmap_statistics_image_count_must_be_positive():
    with pytest.raises(ConfigurationError, match="statistics_images >= 1"):
        DensityRatioHeatmapCallback(statistics_images=0)


def test_heatmaps_can_show_images_of_one_class(tmp_path, monkeypatch):
    import hfmca_lightning.callbacks.heatmaps as heatmaps_module

    drawn = {}
    original = heatmaps_module.heatmap_overlay_figure

    def spy(images, maps, **options):
        drawn["images"], drawn["placements"] = images, options["placements"]
        return original(images, maps, **options)

    monkeypatch.setattr(heatmaps_module, "heatmap_overlay_figure", spy)
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=4), num_views=4, batch_size=6, num_workers=0
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
    images, targets = data.evaluation_images(3, target=2, start=1)
    assert targets.tolist() == [2, 2, 2]
    torch.testing.assert_close(drawn["images"], data.denormalise(images), rtol=0, atol=0)
    # maps are placed on the image by their geometry: L1's input carries L0's padding ring, L3's one 2x2 pool more
    assert drawn["placements"]["L1"] == WindowGeometry(1, 1, 1) and drawn["placements"]["L3"] == WindowGeometry(6, 2, 3)
    split = data.labelled_splits()[1]
    expected = [index for index, target in enumerate(split.targets) if target == 2 and index >= 1][:3]
    torch.testing.assert_close(
        images, torch.stack([data.eval_transform(split[index][0]) for index in expected]), rtol=0, atol=0
    )


def test_a_class_without_images_is_one_clear_error():
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2), num_views=4, batch_size=6, num_workers=0
    )
    with pytest.raises(ConfigurationError, match="no images of class 7"):
        data.evaluation_images(3, target=7)


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


def test_spectra_can_come_from_statistics_summed_over_the_last_batches():
    from hfmca_lightning.analysis.spectral import decompose

    class Record(Callback):
        def __init__(self) -> None:
            self.statistics: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.statistics.append(outputs["statistics"])

    record, spectrum = Record(), EigenspectrumCallback(every_n_steps=3, top_k=5, accumulate_batches=3)
    module = tiny_spectrum_module()
    quiet_trainer(
        max_epochs=1,
        callbacks=[record, spectrum],
        limit_val_batches=0,
    ).fit(module, tiny_data())
    assert len(record.statistics) == 4  # 24 images, batch 6; logged after batches 0 and 3
    costs = module.cost_modules()
    for name in ("external", "internal/L1", "internal/L9"):
        (first_step, first), (last_step, last) = spectrum.history[name]
        assert (first_step, last_step) == (1, 4)
        alone = decompose(record.statistics[0][name], reg=costs[name].reg).eigenvalues[:5]
        summed = record.statistics[1][name] + record.statistics[2][name] + record.statistics[3][name]
        assert float(summed.group_count) == 3 * float(record.statistics[3][name].group_count)
        # the same statistics decomposed by the same code (the sum: float64 additions of three batches, at most
        # 2 gamma_3 relative, moving sigma by at most 3 times that relative error of W: see eigenvalue_error)
        np.testing.assert_allclose(first, alone.tolist(), rtol=0, atol=0)  # one batch seen so far
        expected = decompose(summed, reg=costs[name].reg).eigenvalues[:5].tolist()
        np.testing.assert_allclose(last, expected, rtol=0, atol=6 * eigenvalue_error(summed, costs[name].reg))
    with pytest.raises(ConfigurationError) as error:
        EigenspectrumCallback(accumulate_batches=0)
    assert error.value.parameter == "accumulate_batches"
