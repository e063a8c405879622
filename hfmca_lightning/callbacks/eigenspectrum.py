"""Eigenspectrum logging during training: scalars, eigenvalue series, histograms and figures
(docs/conventions.md §4)."""

from __future__ import annotations

import operator
from collections import deque
from functools import reduce
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger

from hfmca_lightning.analysis.spectral import decompose
from hfmca_lightning.callbacks.figures import FigureCallback
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.statistics import CorrelationStatistics
from hfmca_lightning.visualization import layer_spectra_figure, learning_dynamics_figure

__all__ = ["EigenspectrumCallback", "HISTOGRAM_BINS"]

HISTOGRAM_BINS = 20  # over [0, 1]: the same bins at every step, so W&B can draw the distribution over time


class EigenspectrumCallback(FigureCallback):
    """The one owner of every spectrum quantity logged during training.

    Every ``every_n_steps`` optimiser steps it decomposes (paper Alg. 4) the global-batch statistics of each
    cost pair that the module's ``training_step`` returned (``outputs["statistics"]``, keyed by cost name:
    ``external``, ``internal/L3``, ...; :class:`~hfmca_lightning.methods.HFMCAModule` does), with that
    cost's ``reg``, and logs, per pair ``<name>``:

    * ``spectrum/<name>/top1``, ``spectrum/<name>/top10_mean`` and ``spectrum/<name>/num_above_<threshold>``;
    * ``eigenvalues/<name>/01`` .. ``/<top_k>`` — the eigenvalue series, one scalar per rank;
    * to W&B loggers also ``spectrum/<name>/eigenvalues``, the whole spectrum as a ``wandb.Histogram`` over
      [0, 1] (W&B draws its distribution over time without any panel set-up).

    The statistics are those of one training batch (all ranks together): ``B`` groups (``B * L`` members)
    for the external pair, ``B * L * H' * W'`` groups (output positions) for an internal one. With
    ``accumulate_batches = N > 1`` they are summed over the last ``N`` training batches (the logged one and the
    ``N - 1`` before it; fewer right after a start or resume): ``N`` times the samples, at the price of mixing
    statistics of ``N`` consecutive parameter values (the adaptive filter of Alg. 3 makes the same trade).
    Values go straight to the
    loggers (once per scheduled step, at the step of that batch). At the end of every training
    epoch it draws two figures, written as PNG under ``<run dir>/figures`` and sent to W&B / TensorBoard:
    ``learning_dynamics`` (one heatmap per pair, x: step, y: the ``top_k`` largest eigenvalues) and
    ``layer_spectra`` (one column of eigenvalue dots per pair, red line: mean of the 10 largest). Logging
    and figures are rank 0's; the history is kept in checkpoints.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        top_k: int = 20,
        threshold: float = 0.5,
        output_dir: str | None = None,
        accumulate_batches: int = 1,
    ) -> None:
        super().__init__(output_dir)
        checks = (
            ("every_n_steps", every_n_steps, every_n_steps >= 1),
            ("top_k", top_k, top_k >= 1),
            ("threshold", threshold, 0 < threshold < 1),
            ("accumulate_batches", accumulate_batches, accumulate_batches >= 1),
        )
        for name, value, valid in checks:
            if not valid:
                raise ConfigurationError(
                    "EigenspectrumCallback needs every_n_steps >= 1, top_k >= 1, 0 < threshold < 1 and "
                    f"accumulate_batches >= 1; got {name}={value}",
                    parameter=name,
                )
        self.every_n_steps = every_n_steps
        self.accumulate_batches = accumulate_batches
        self._recent: deque[dict[str, CorrelationStatistics]] = deque(maxlen=accumulate_batches)
        self.top_k = top_k
        self.threshold = threshold
        self.history: dict[str, list[tuple[int, list[float]]]] = {}
        self.latest: dict[str, torch.Tensor] = {}
        self._last_logged_step = -1

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # after the optimiser step: the batch that produced these statistics is step - 1
        statistics = outputs.get("statistics") if isinstance(outputs, dict) else None
        if not statistics or step == self._last_logged_step:
            return
        self._recent.append(statistics)  # the last accumulate_batches batches' statistics
        if (step - 1) % self.every_n_steps != 0:
            return
        statistics = {name: reduce(operator.add, (recent[name] for recent in self._recent)) for name in statistics}
        self._last_logged_step = step
        costs = pl_module.cost_modules()  # type: ignore[operator]  # an HFMCA module's method (checked in setup)
        metrics: dict[str, float] = {}
        for name, stats in statistics.items():
            eigenvalues = decompose(stats, reg=costs[name].reg).eigenvalues.cpu()
            self.latest[name] = eigenvalues
            top = eigenvalues[: self.top_k].tolist()
            self.history.setdefault(name, []).append((step, top))
            metrics[f"spectrum/{name}/top1"] = float(eigenvalues[0])
            metrics[f"spectrum/{name}/top10_mean"] = float(eigenvalues[:10].mean())
            metrics[f"spectrum/{name}/num_above_{self.threshold:g}"] = float((eigenvalues > self.threshold).sum())
            metrics.update({f"eigenvalues/{name}/{rank:02d}": value for rank, value in enumerate(top, start=1)})
        if trainer.is_global_zero:
            self._log(trainer, metrics, step - 1)

    def _log(self, trainer: Trainer, metrics: dict[str, float], step: int) -> None:
        """Straight to the loggers, once, at the step of the batch the statistics came from (``self.log``
        from a callback would repeat the values at the next step)."""
        histograms: dict[str, Any] = {}
        if any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
            import wandb

            histograms = {
                f"spectrum/{name}/eigenvalues": wandb.Histogram(
                    np_histogram=np.histogram(values.numpy(), bins=HISTOGRAM_BINS, range=(0.0, 1.0))
                )
                for name, values in self.latest.items()
            }
        for logger in trainer.loggers:
            logger.log_metrics({**metrics, **histograms} if isinstance(logger, WandbLogger) else metrics, step=step)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self.history:
            return
        epoch = trainer.current_epoch
        ranks = max(len(values) for entries in self.history.values() for _, values in entries)
        history = {
            name: ([step for step, _ in entries], np.array([_pad(values, ranks) for _, values in entries]))
            for name, entries in self.history.items()
        }
        self.publish(
            trainer, learning_dynamics_figure(history), "learning_dynamics", f"learning_dynamics_epoch{epoch:03d}.png"
        )
        spectra = layer_spectra_figure(self.latest, title=f"Spectrum per layer pair, step {trainer.global_step}")
        self.publish(trainer, spectra, "layer_spectra", f"layer_spectra_epoch{epoch:03d}.png")

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {
            name: [(int(step), list(values)) for step, values in entries]
            for name, entries in state_dict["history"].items()
        }


def _pad(values: list[float], length: int) -> list[float]:
    return values + [float("nan")] * (length - len(values))
