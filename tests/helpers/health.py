"""What the health callback's tests share: a user LightningModule that returns ``{"loss", "features"}`` only (its
embeddings healthy, collapsing onto one direction, or most spread at a chosen step), its data, and what a module
logged under ``health/``, step by step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from hfmca_lightning.analysis.health import LIDAR_DELTA, HealthStatistics
from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from tests.helpers.error_bounds import FLOAT64_UNIT, gamma

HEALTH_NAMES = ("rankme", "effective_rank", "alpha_req", "lidar", "samples")


def health_images(batch_size: int = 4, views: int = 2) -> MultiViewDataModule:
    """32 SyntheticShapes images of 8 px (``32 / batch_size`` steps per epoch), ``views`` SimCLR views, no workers:
    the project's data module, whose checkpoints resume mid-epoch exactly."""
    source = SyntheticShapes(num_classes=4, train_per_class=8, test_per_class=2, image_size=8)
    return MultiViewDataModule(source, views=SimCLRViews(count=views), batch_size=batch_size, num_workers=0)


def gaussian_views(samples: int = 64, views: int = 2, dim: int = 8, batch_size: int = 8) -> DataLoader:
    """``(views (B, views, dim), targets (B,))`` batches of isotropic Gaussian vectors, in order: a sample's views
    are its own vector plus a tenth of independent noise each."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(samples, 1, dim, generator=generator)
    noise = 0.1 * torch.randn(samples, views, dim, generator=generator)
    return DataLoader(TensorDataset(centres + noise, torch.zeros(samples, dtype=torch.long)), batch_size=batch_size)


class HealthProbe(LightningModule):
    """A user module (no ``backbone``, none of the package's base classes) whose training steps return
    ``{"loss", "features"}``, ``features (B * L, D)`` with each sample's ``L`` views together.

    A view is a vector ``(B, L, F)`` as it comes, or an image ``(B, L, C, H, W)`` average-pooled to ``2 x 2``
    (``F = 4 C``); it goes through a linear ``encoder`` to ``dim`` (none when ``dim`` is None: the pooled pixels
    themselves, which no batch size changes), then dimension ``k`` is scaled by ``mask(step)_k``, ``step`` the
    optimiser steps done before the training step:

    * ``decay``: ``mask_0 = 1`` and ``mask_k = decay ** step`` (``k >= 1``): the embeddings collapse onto one
      direction as ``decay ** step`` goes to 0 (``decay = 1``: healthy). A factor on all dimensions alike would not
      do: every metric here is invariant to scale.
    * ``peak``: ``mask_k = exp(-|step - peak| k / D)``: the embeddings are most spread at step ``peak``.

    The loss pulls a sample's first two views together and keeps the first views' variance (VICReg's invariance and
    variance terms); it trains the encoder by SGD at ``lr``. With ``folder``, what the module logged under
    ``health/`` is written to ``folder/health<rank>.json`` at the end of training (spawned processes).
    """

    def __init__(
        self,
        dim: int | None = 6,
        inputs: int = 12,
        lr: float = 0.05,
        decay: float = 1.0,
        peak: int | None = None,
        folder: str | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(inputs, dim) if dim is not None else None
        self.anchor = nn.Parameter(torch.ones(()))  # a parameter to train when there is no encoder
        self.lr, self.decay, self.peak, self.folder = lr, decay, peak, folder
        self.health: list[tuple[int, str, float]] = []  # (global step when logged, name, value as logged)

    def mask(self, step: int, dim: int) -> Tensor:
        k = torch.arange(dim, dtype=torch.float32)
        if self.peak is not None:
            return torch.exp(-abs(step - self.peak) * k / dim)
        return torch.where(k == 0, 1.0, self.decay**step)

    def embed(self, views: Tensor) -> Tensor:
        """``(B, L, ...)`` views -> ``(B * L, D)`` embeddings (before the mask)."""
        flat = views.flatten(0, 1)
        if flat.dim() == 4:
            flat = nn.functional.adaptive_avg_pool2d(flat, 2).flatten(1)
        return self.encoder(flat) if self.encoder is not None else flat * self.anchor

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        views = batch[0]
        features = self.embed(views)
        features = features * self.mask(self.global_step, features.shape[-1]).to(features)
        z = features.reshape(views.shape[0], views.shape[1], -1)
        invariance = (z[:, 0] - z[:, 1]).pow(2).mean()
        variance = nn.functional.relu(1 - z[:, 0].std(dim=0)).mean()
        return {"loss": invariance + variance, "features": features.detach()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name.startswith("health/"):
            self.health.append((self.trainer.global_step, name.removeprefix("health/"), float(value)))
        super().log(name, value, *args, **kwargs)

    def on_train_end(self) -> None:
        if self.folder is not None:
            path = Path(self.folder) / f"health{self.trainer.global_rank}.json"
            path.write_text(json.dumps(self.health))


def logged_health(records: list[tuple[int, str, float]]) -> dict[int, dict[str, float]]:
    """``{global step: {name: value}}`` of ``(step, name, value)`` records, each step's names logged once."""
    steps: dict[int, dict[str, float]] = {}
    for step, name, value in records:
        assert name not in steps.setdefault(step, {}), f"health/{name} logged twice at step {step}"
        steps[step][name] = value
    return steps


def record_health(module: LightningModule) -> list[tuple[int, str, float]]:
    """Record what ``module`` (any LightningModule, in this process) logs under ``health/`` from now on:
    ``(global step when logged, name, value)``."""
    records: list[tuple[int, str, float]] = []
    log = module.log

    def recording(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name.startswith("health/"):
            records.append((module.trainer.global_step, name.removeprefix("health/"), float(value)))
        log(name, value, *args, **kwargs)

    module.log = recording  # type: ignore[method-assign]
    return records


class RecordEmbeddings(Callback):
    """Records, independently of the health callback, the output of ``module`` (a submodule of the trained module)
    in every training step: ``calls[step]``, the outputs of the step that ends at optimiser step ``step``, in call
    order (float64 copies)."""

    def __init__(self, module: nn.Module) -> None:
        self.calls: dict[int, list[Tensor]] = {}
        self.step: int | None = None
        module.register_forward_hook(self._record)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.step = trainer.global_step + 1

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.step = None

    def _record(self, module: nn.Module, inputs: Any, output: Tensor) -> None:
        if self.step is not None:
            self.calls.setdefault(self.step, []).append(output.detach().double().clone())


def window_steps(samples_per_dim: int, dim: int, global_batch: int) -> int:
    """Steps of ``global_batch`` samples a health estimate of ``dim``-dimensional embeddings sums (at least
    ``samples_per_dim * dim`` samples)."""
    return math.ceil(samples_per_dim * dim / global_batch)


def order_tolerances(embeddings: Tensor) -> dict[str, float]:
    """How far each metric of :class:`~hfmca_lightning.analysis.health.HealthStatistics` of ``embeddings (n, q, D)``
    may move when its float64 sums are taken in another order (a step at a time, per process then all-reduced, or
    all at once): ``rankme``, ``effective_rank`` and ``lidar`` relative, ``alpha_req`` absolute, ``samples`` 0.

    Each sum moves by at most ``2 gamma_N`` of its terms' magnitudes (Higham §3.1), so each moment by that of
    ``|x|^T |x| / n + |m| |m|^T`` (centring's cancellation included), and each of its eigenvalues by the Frobenius
    norm of that (Weyl) plus a backward-stable eigensolver's ``4 D u ||M||`` on either side; relative to the
    smallest eigenvalue, ``eps``. Every eigenvalue then moves by at most ``eps`` relative (``|dM| <= eps M``); LiDAR's
    generalised eigenvalues of (``Sigma_b``, ``Sigma_w + delta I``) by ``eps_b + eps_w``; RankMe's singular values by
    half the relative move of the first views' Gram matrix's eigenvalues. An entropy rank moves by at most
    ``2 eps (H + 1) <= 2 eps (log D + 1)`` relative (``p + epsilon >= p``: no worse with RankMe's epsilon); the
    exponent by ``sum |x_i - mean x| / sum (x_i - mean x)^2`` times ``eps`` (``x_i = log i``). First order, with a
    margin of 1.5."""
    x = embeddings.detach().double()
    n, q, d = x.shape
    u = FLOAT64_UNIT

    def relative_move(matrix: Tensor, terms: Tensor, count: int) -> float:
        values = torch.linalg.eigvalsh(matrix)
        error = 2 * gamma(count, u) * torch.linalg.matrix_norm(terms) + 8 * d * u * values.abs().max()
        return float(error / values.min())

    def covariance_move(rows: Tensor, extra: int = 0) -> float:
        mean = rows.mean(dim=0)
        centred = rows - mean
        terms = rows.abs().T @ rows.abs() / len(rows) + torch.outer(mean.abs(), mean.abs())
        return relative_move(centred.T @ centred / len(rows), terms, len(rows) + extra + 3)

    first = covariance_move(x[:, 0])
    gram = relative_move(x[:, 0].T @ x[:, 0] / n, x[:, 0].abs().T @ x[:, 0].abs() / n, n)
    means = x.mean(dim=1)
    between = covariance_move(means, extra=q)
    spread = (x - means[:, None]).flatten(0, 1)
    flat = x.flatten(0, 1).abs()
    within = spread.T @ spread / (n * q) + LIDAR_DELTA * torch.eye(d, dtype=torch.float64)
    within_terms = (flat.T @ flat + q * means.abs().T @ means.abs()) / (n * q)
    within_move = relative_move(within, within_terms, n * q + 3)
    logs = torch.log(torch.arange(1, d + 1, dtype=torch.float64))
    centred_logs = logs - logs.mean()
    slope = float(centred_logs.abs().sum() / (centred_logs**2).sum()) if d > 1 else 0.0
    entropy = 1.5 * 2 * (math.log(d) + 1)
    return {
        "rankme": entropy * gram / 2,
        "effective_rank": entropy * first,
        "alpha_req": 1.5 * slope * first,
        "lidar": entropy * (between + within_move),
        "samples": 0.0,
    }


def assert_health_equal(logged: dict[str, float], embeddings: Tensor, names: tuple[str, ...] = HEALTH_NAMES) -> None:
    """``logged`` (one step's ``health/`` values, float64 as the callback logged them) are
    ``HealthStatistics.of(embeddings).metrics()`` and the count of samples, to :func:`order_tolerances`."""
    assert set(logged) == set(names), sorted(logged)
    expected = HealthStatistics.of(embeddings).metrics() | {"samples": float(embeddings.shape[0])}
    tolerances = order_tolerances(embeddings)
    for name in names:
        assert tolerances[name] < 1e-6, (name, tolerances[name])  # a tolerance that still tells values apart
        if name == "alpha_req":
            assert abs(logged[name] - expected[name]) <= tolerances[name], (name, logged[name], expected[name])
        else:
            assert abs(logged[name] - expected[name]) <= tolerances[name] * abs(expected[name]), (
                name,
                logged[name],
                expected[name],
            )
