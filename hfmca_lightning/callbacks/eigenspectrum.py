"""Eigenspectrum logging during training: scalars, eigenvalue series and figures (SPEC §4)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer

from hfmca_lightning.analysis.spectral import decompose
from hfmca_lightning.callbacks.figures import FigureCallback
from hfmca_lightning.visualization import layer_spectra_figure, learning_dynamics_figure

__all__ = ["EigenspectrumCallback"]


class EigenspectrumCallback(FigureCallback):
    """Every ``every_n_steps`` training steps, the spectrum of each cost pair from its current statistics.

    Works with any module that has ``cost_modules() -> {name: HFMCACost}`` (``HFMCAModule``). Logs, per
    pair ``<name>`` (``external``, ``internal/L3``, ...):

    * ``spectrum/<name>/num_above_<threshold>`` — how many eigenvalues exceed ``threshold``
      (the module itself logs ``spectrum/<name>/top1`` and ``top10_mean``);
    * ``eigenvalues/<name>/01`` .. ``/<top_k>`` — the eigenvalue series, one scalar per rank;

    and at the end of every training epoch two figures, written as PNG under ``<run dir>/figures`` and
    sent to W&B / TensorBoard loggers: ``learning_dynamics`` (one heatmap per pair, x: step, y: the
    ``top_k`` largest eigenvalues) and ``layer_spectra`` (one column of eigenvalue dots per pair, red
    line: mean of the 10 largest). Rank 0 only under DDP; the history is kept in checkpoints.
    """

    def __init__(self, every_n_steps: int = 50, top_k: int = 20, threshold: float = 0.5, output_dir: str | None = None) -> None:
        super().__init__(output_dir)
        if every_n_steps < 1 or top_k < 1 or not 0 < threshold < 1:
            raise ValueError(f"need every_n_steps >= 1, top_k >= 1 and 0 < threshold < 1; got {every_n_steps}, {top_k}, {threshold}")
        self.every_n_steps = every_n_steps
        self.top_k = top_k
        self.threshold = threshold
        self.history: dict[str, list[tuple[int, list[float]]]] = {}
        self.latest: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if (step - 1) % self.every_n_steps != 0 or not hasattr(pl_module, "cost_modules"):
            return
        for name, cost in pl_module.cost_modules().items():
            if cost.last_statistics is None:
                continue
            eigenvalues = decompose(cost.last_statistics, reg=cost.reg).eigenvalues.cpu()
            self.latest[name] = eigenvalues
            top = eigenvalues[: self.top_k].tolist()
            self.history.setdefault(name, []).append((step, top))
            metrics = {f"spectrum/{name}/num_above_{self.threshold:g}": float((eigenvalues > self.threshold).sum())}
            metrics.update({f"eigenvalues/{name}/{rank:02d}": value for rank, value in enumerate(top, start=1)})
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self.history:
            return
        epoch = trainer.current_epoch
        ranks = max(len(values) for entries in self.history.values() for _, values in entries)
        history = {
            name: ([step for step, _ in entries], np.array([_pad(values, ranks) for _, values in entries]))
            for name, entries in self.history.items()
        }
        self.publish(trainer, learning_dynamics_figure(history), "learning_dynamics", f"learning_dynamics_epoch{epoch:03d}.png")
        spectra = layer_spectra_figure(self.latest, title=f"Spectrum per layer pair, step {trainer.global_step}")
        self.publish(trainer, spectra, "layer_spectra", f"layer_spectra_epoch{epoch:03d}.png")

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {name: [(int(step), list(values)) for step, values in entries] for name, entries in state_dict["history"].items()}


def _pad(values: list[float], length: int) -> list[float]:
    return values + [float("nan")] * (length - len(values))
