"""Spectra of a baseline (no HFMCA costs) logged online under the HFMCA runs' keys: its residual blocks' float64
statistics and the pair of its projections of views 0 and 1, from its own training steps."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.analysis import rankme
from hfmca_lightning.callbacks import EigenspectrumCallback, LinearProbe
from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.losses import group_statistics
from hfmca_lightning.methods.baselines import SimCLR, SimSiam
from hfmca_lightning.models import CIFARResNet18, SmallConvNet
from tests.helpers import FLOAT32_UNIT, eigenvalue_error, quiet_trainer


def reference_eigenvalues(stats, reg):
    """sigma = eig(C^-1 P^T A^-1 P), numpy, from the statistics' means."""
    r1, r2, cross = (m.numpy() for m in stats.means())
    a, c = r1 + reg * np.eye(len(r1)), r2 + reg * np.eye(len(r2))
    return np.sort(np.linalg.eigvals(np.linalg.solve(c, cross.T @ np.linalg.solve(a, cross))).real)[::-1]


def data(views: int = 2) -> MultiViewDataModule:
    return MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=3, image_size=16),
        views=SimCLRViews(count=views),
        batch_size=12,
        num_workers=0,
    )


def frozen(module):
    """Learning rate 0: the weights after the step are those of the step, so a second forward reproduces it."""
    module.optimizer_factory = lambda parameters: torch.optim.SGD(parameters, lr=0.0)
    return module


def test_a_baseline_logs_the_spectra_of_its_projections_and_residual_blocks(tmp_path):
    torch.manual_seed(0)
    module = frozen(SimCLR(CIFARResNet18(), hidden_dim=32, output_dim=8))
    spectrum = EigenspectrumCallback(every_n_steps=1, top_k=5, min_groups=1)
    datamodule = data()
    trainer = quiet_trainer(
        max_steps=1,
        logger=CSVLogger(tmp_path, name="run"),
        # the probe's own forward passes after the step are not the step's
        callbacks=[spectrum, LinearProbe()],
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule)
    (row,) = [row for row in csv.DictReader(open(Path(trainer.log_dir) / "metrics.csv")) if row.get("rankme/backbone")]
    blocks = [f"layer{stage}.{index}" for stage in range(1, 5) for index in range(2)]
    assert set(spectrum.history) == {"external", *(f"internal/{block}" for block in blocks)}

    # the reference: the same batch through the unchanged weights, training-mode BatchNorm, no gradients
    views, _ = next(iter(datamodule.train_dataloader()))
    with torch.no_grad():
        features = [module.backbone(views[:, view]) for view in range(2)]
        projections = [module.projection_head(f).double() for f in features]
    low, high = (torch.cat([p, torch.ones(len(p), 1, dtype=torch.float64)], dim=1) for p in projections)
    stats = group_statistics(low[:, None], high)
    expected = reference_eigenvalues(stats, 1e-3)
    tolerance = 6 * eigenvalue_error(stats, 1e-3) + 1e-5  # two forwards' float32 rounding of the features, ~1e-6
    assert (
        float(row["spectrum/external/trivial"]) == np.float32(expected[0])
        or abs(float(row["spectrum/external/trivial"]) - expected[0]) <= tolerance
    )
    logged = [float(row[f"eigenvalues/external/{rank:02d}"]) for rank in range(1, 6)]
    np.testing.assert_allclose(logged, expected[1:6], rtol=0, atol=tolerance)
    assert float(row["spectrum/external/groups"]) == 12
    assert float(row["spectrum/internal/layer1.0/groups"]) == 2 * 12 * 16 * 16  # two views, 16x16 positions
    # RankMe of the backbone features of both views of the batch
    assert (
        float(row["rankme/backbone"]) == np.float32(float(rankme(torch.cat(features))))
        or abs(float(row["rankme/backbone"]) - float(rankme(torch.cat(features))))
        <= 1e-4 * float(rankme(torch.cat(features))) + FLOAT32_UNIT
    )


def test_internal_pairs_are_recorded_only_on_the_steps_their_window_needs(monkeypatch):
    """SmallConvNet's stages (its ``internal_layers``, hooked by default): the deepest holds few positions per batch,
    so its window spans several steps, recorded just before each log and on no other step; the projections' pair
    (cheap) every step."""
    from hfmca_lightning.callbacks import spectrum_hooks

    calls: list[tuple[bool, bool]] = []
    real_start = spectrum_hooks.HookedSpectrumPairs.start

    def start(self, internal: bool, features: bool) -> None:
        calls.append((internal, features))
        real_start(self, internal, features)

    monkeypatch.setattr(spectrum_hooks.HookedSpectrumPairs, "start", start)
    torch.manual_seed(0)
    module = frozen(SimSiam(SmallConvNet(width=4, num_stages=3), hidden_dim=16, output_dim=8, prediction_dim=4))
    spectrum = EigenspectrumCallback(every_n_steps=4, top_k=3, groups_per_feature=3)
    quiet_trainer(max_steps=9, callbacks=[spectrum], limit_val_batches=0).fit(module, data())
    assert set(spectrum.history) == {"external", "internal/features.0", "internal/features.1", "internal/features.2"}
    # the deepest stage: 16 channels, 2 x 2 positions of 2 views of 12 images per step = 96 groups; 3 * 16 needed
    assert spectrum._internal_steps == 1
    assert [features for _, features in calls] == [step % 4 == 1 for step in range(1, 10)]
    assert [step for step, (internal, _) in enumerate(calls, start=1) if internal] == [1, 5, 9]
    # the projections' pair: 8 + 1 features, 27 groups needed, 12 per step: three steps per window
    assert [step for step, _ in spectrum.history["external"]] == [5, 9]
    assert spectrum.window_groups["external"] == 48
    assert [step for step, _ in spectrum.history["internal/features.2"]] == [1, 5, 9]


def test_hooked_pair_settings_on_a_module_with_cost_pairs_are_refused():
    """``hooked_layers`` / ``hooked_reg`` choose the pairs hooked on modules without cost pairs: given with an
    HFMCAModule (whose spectra come from its costs) they would do nothing, so the fit stops before its first step."""
    import pytest

    from hfmca_lightning.errors import ConfigurationError
    from tests.helpers import bn_free_module

    given = (
        ({"hooked_layers": ["features"]}, "hooked_layers"),
        ({"hooked_reg": 0.5}, "hooked_reg"),
        ({"hooked_reg": 1e-3}, "hooked_reg"),  # the default's value, given: before, accepted and unused
    )
    for settings, named in given:
        trainer = quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[EigenspectrumCallback(**settings)])
        with pytest.raises(ConfigurationError, match=f"EigenspectrumCallback: {named} set the pairs hooked on"):
            trainer.fit(bn_free_module(), data(views=4))


def test_an_unknown_hooked_layer_is_named_as_the_callbacks_setting():
    import pytest

    from hfmca_lightning.errors import ConfigurationError

    callback = EigenspectrumCallback(hooked_layers=["no.such.layer"])
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[callback])
    module = SimCLR(SmallConvNet(width=8, num_stages=2), hidden_dim=16, output_dim=8)
    with pytest.raises(
        ConfigurationError, match="EigenspectrumCallback hooked_layers: 'no.such.layer' is not a module"
    ):
        trainer.fit(module, data())
