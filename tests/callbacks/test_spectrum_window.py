"""The eigenspectrum callback's window: enough groups that the logged spectra show the dependence there is, at the
shipped configs' batch sizes and regularisations, and no more."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from hfmca_lightning.analysis import decompose
from hfmca_lightning.callbacks import EigenspectrumCallback
from hfmca_lightning.losses import HFMCACost, group_statistics
from hfmca_lightning.losses.statistics import CorrelationStatistics
from tests.helpers import quiet_trainer

SCALE = 0.1  # feature standard deviation around their mean 0.5, as sigmoid features at initialisation


class SyntheticPairs(LightningModule):
    """A module whose every training step returns the statistics of fresh draws of one pair: ``groups`` groups of
    ``members`` members, ``K``-d features ``z = 0.5 + SCALE (a * s + b * e)`` and ``h = 0.5 + SCALE s``, with ``s``
    shared by a group and ``e`` drawn per member: canonical correlations ``a^2 / (a^2 + b^2)`` per feature, none
    where ``a = 0`` (independent features)."""

    def __init__(self, groups: int, members: int, shared: torch.Tensor, reg: float) -> None:
        super().__init__()
        self.groups, self.members = groups, members
        self.shared = shared.double()
        self.own = (1 - shared.double() ** 2).sqrt()
        self.cost = HFMCACost(reg=reg, name="external")
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.generator = torch.Generator().manual_seed(0)

    def cost_modules(self) -> dict[str, HFMCACost]:
        return {"external": self.cost}

    def training_step(self, batch, batch_idx):
        k = self.shared.shape[0]
        s = torch.randn(self.groups, 1, k, generator=self.generator, dtype=torch.float64)
        e = torch.randn(self.groups, self.members, k, generator=self.generator, dtype=torch.float64)
        low = 0.5 + SCALE * (self.shared * s + self.own * e)
        high = 0.5 + SCALE * s[:, 0]
        return {"loss": self.weight * 0, "statistics": {"external": group_statistics(low, high)}}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def population_eigenvalues(shared: torch.Tensor, reg: float) -> torch.Tensor:
    """The truth: Alg. 4's eigenvalues of the population moments of :class:`SyntheticPairs` at ``reg``:
    ``R1 = mu mu^T + SCALE^2 I``, ``R2 = mu mu^T + SCALE^2 I``, ``P = mu mu^T + SCALE^2 diag(a)``."""
    k = shared.shape[0]
    mean = torch.full((k, 1), 0.5, dtype=torch.float64)
    outer = mean @ mean.T
    identity = torch.eye(k, dtype=torch.float64)
    one = torch.ones((), dtype=torch.float64)
    stats = CorrelationStatistics(
        outer + SCALE**2 * identity,
        outer + SCALE**2 * identity,
        outer + SCALE**2 * torch.diag(shared.double()),
        one,
        one,
    )
    return decompose(stats, reg=reg).eigenvalues


def logged_spectra(tmp_path: Path, module: SyntheticPairs, steps: int, every_n_steps: int) -> list[np.ndarray]:
    """Every logged row of non-trivial eigenvalues (``eigenvalues/external/NN``) of a run of ``steps`` steps."""
    spectrum = EigenspectrumCallback(every_n_steps=every_n_steps, top_k=module.shared.shape[0] - 1)
    trainer = quiet_trainer(
        max_epochs=1, logger=CSVLogger(tmp_path, name="run"), callbacks=[spectrum], log_every_n_steps=every_n_steps
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1))
    rows = list(csv.DictReader(open(Path(trainer.log_dir) / "metrics.csv")))
    k = module.shared.shape[0]
    logged = [row for row in rows if row.get("eigenvalues/external/01")]
    for row in logged:  # the window's size is part of what is logged
        assert float(row["spectrum/external/groups"]) >= 100 * k
    return [np.array([float(row[f"eigenvalues/external/{rank:02d}"]) for rank in range(1, k)]) for row in logged]


def test_independent_features_log_no_dependence_at_the_cifar_setting(tmp_path):
    """configs/cifar10_ss.yaml: the external pair, 64 images of 9 views, K = 128, reg 0.1 (one batch: eigenvalues
    after the first average ~0.10)."""
    module = SyntheticPairs(groups=64, members=9, shared=torch.zeros(128), reg=0.1)
    spectra = logged_spectra(tmp_path, module, steps=301, every_n_steps=100)
    assert len(spectra) == 2  # steps 201 and 301: 200 steps of 64 groups fill the first window
    for values in spectra:
        assert values.mean() < 0.05, values.mean()


def test_independent_features_log_no_dependence_at_the_spectrum_setting(tmp_path):
    """configs/spectrum_*.yaml: L9's pair, 32 images of one output position with 4 member positions each, K = 64,
    reg 1e-3 (one batch: eigenvalues after the first average ~0.28)."""
    module = SyntheticPairs(groups=32, members=4, shared=torch.zeros(64), reg=1e-3)
    spectra = logged_spectra(tmp_path, module, steps=301, every_n_steps=100)
    assert len(spectra) == 2  # steps 201 and 301: 200 steps of 32 groups fill the window
    for values in spectra:
        assert values.mean() < 0.01, values.mean()  # docs/analysis.md: below 0.01 from 6,400 groups


def test_a_planted_dependence_is_logged_within_0_02_of_its_canonical_correlations(tmp_path):
    """The spectrum setting's LF pair (32 groups of 9 views, K = 64, reg 1e-3) with ten planted canonical correlations
    from 0.9 down to 0.45 and none elsewhere: the logged top 10 within 0.02 of the population's eigenvalues at the
    same reg (one batch is more than 0.02 off)."""
    canonical = torch.zeros(64)
    canonical[:10] = torch.linspace(0.9, 0.45, 10)
    shared = canonical.sqrt()  # a^2 / (a^2 + b^2) with a^2 + b^2 = 1
    truth = population_eigenvalues(shared, reg=1e-3)[1:11].numpy()  # after the constant function's
    one_batch = SyntheticPairs(groups=32, members=9, shared=shared, reg=1e-3).training_step(None, 0)["statistics"]
    assert np.abs(decompose(one_batch["external"], reg=1e-3).eigenvalues[1:11].numpy() - truth).max() > 0.02
    module = SyntheticPairs(groups=32, members=9, shared=shared, reg=1e-3)
    (values,) = logged_spectra(tmp_path, module, steps=201, every_n_steps=200)
    np.testing.assert_allclose(values[:10], truth, rtol=0, atol=0.02)


def test_adding_steps_sums_each_pair_and_refuses_other_dimensions():
    """The open interval is the sum of the steps added (all pairs in one multi-tensor addition), the steps' own
    statistics untouched; statistics of other dimensions for a pair are refused as ``CorrelationStatistics`` does."""
    from hfmca_lightning.analysis.spectrum_window import SpectrumWindow
    from hfmca_lightning.losses import group_statistics

    torch.manual_seed(0)
    steps = [
        {"external": group_statistics(torch.rand(8, 4, 6), torch.rand(8, 5)), "internal/L1": group_statistics(
            torch.rand(8, 2, 3), torch.rand(8, 4))}
        for _ in range(3)
    ]  # fmt: skip
    first = {name: stats.low_outer_sum.clone() for name, stats in steps[0].items()}
    window = SpectrumWindow(min_groups=1)
    for step in steps:
        window.add(step)
    for name in ("external", "internal/L1"):
        expected = steps[0][name] + steps[1][name] + steps[2][name]
        for got, want in zip(
            (window.open[name].low_outer_sum, window.open[name].cross_sum, window.open[name].group_count),
            (expected.low_outer_sum, expected.cross_sum, expected.group_count),
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same float64 additions in the same order
        torch.testing.assert_close(steps[0][name].low_outer_sum, first[name], rtol=0, atol=0)
    with pytest.raises(
        ValueError,
        match=r"statistics of external changed dimensions within a window: \(K1=6, K2=5\) then \(K1=7, K2=5\)",
    ):
        window.add({"external": group_statistics(torch.rand(8, 4, 7), torch.rand(8, 5))})
