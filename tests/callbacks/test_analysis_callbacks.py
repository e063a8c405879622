"""Eigenspectrum and density-ratio callbacks on a real (tiny) spectrum-CNN run."""

from __future__ import annotations

import numpy as np
import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.callbacks import DensityRatioHeatmapCallback, EigenspectrumCallback
from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import GridExternalHead, SpectrumCNN


def tiny_spectrum_module() -> HFMCAModule:
    backbone = SpectrumCNN(channels=6, hidden_dim=12, noise_channels=2)
    return HFMCAModule(
        backbone,
        external_head=GridExternalHead(6, 2, 2, 12, noise_channels=2),
        external_cost=HFMCACost(reg=1e-3, beta=0.5, name="external"),
        internal_costs=InternalCosts(backbone.internal_layers, reg=1e-3, beta=0.5),
    )


def tiny_data() -> MultiViewDataModule:
    return MultiViewDataModule(SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=3), num_views=4, batch_size=6, num_workers=0)


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
    trainer = Trainer(
        max_epochs=1, logger=CSVLogger(tmp, name="run"), callbacks=[spectrum, heatmaps], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(module, tiny_data())
    return module, spectrum, trainer


def test_logged_spectra_equal_the_eigenspectrum_of_the_same_statistics(trained):
    module, spectrum, trainer = trained
    assert set(spectrum.history) == {"external", *(f"internal/L{i}" for i in range(1, 10))}
    for name, cost in module.cost_modules().items():
        step, logged = spectrum.history[name][-1]
        assert step == trainer.global_step == 4
        np.testing.assert_allclose(logged, reference_eigenvalues(cost.last_statistics, cost.reg)[:5], rtol=1e-7, atol=1e-10)
        assert float(trainer.callback_metrics[f"eigenvalues/{name}/01"]) == pytest.approx(logged[0], rel=1e-6)
        expected_count = float((reference_eigenvalues(cost.last_statistics, cost.reg) > 0.5).sum())
        assert float(trainer.callback_metrics[f"spectrum/{name}/num_above_0.5"]) == expected_count
    assert len(spectrum.history["external"]) == 4  # every step


def test_figures_are_written_under_the_run_directory(trained):
    _, _, trainer = trained
    figures = sorted(p.name for p in (trainer.log_dir and __import__("pathlib").Path(trainer.log_dir) / "figures").glob("*.png"))
    assert figures == ["density_ratio_epoch000.png", "layer_spectra_epoch000.png", "learning_dynamics_epoch000.png"]


def test_history_round_trips_through_the_callback_state(trained):
    _, spectrum, _ = trained
    restored = EigenspectrumCallback()
    restored.load_state_dict(spectrum.state_dict())
    assert restored.history == spectrum.history


def test_heatmap_callback_rejects_unknown_layers():
    module = tiny_spectrum_module()
    callback = DensityRatioHeatmapCallback(layers=["L42"])
    trainer = Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"\['L42'\] are not internal cost layers"):
        trainer.fit(module, tiny_data())
