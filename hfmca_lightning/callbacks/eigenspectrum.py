"""Eigenspectrum logging during training: scalars, eigenvalue series, histograms and figures
(docs/conventions.md §4)."""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger

from hfmca_lightning.analysis.rankme import rankme
from hfmca_lightning.analysis.spectrum_window import GROUPS_PER_FEATURE, SpectrumWindow
from hfmca_lightning.callbacks.figures import FigureCallback
from hfmca_lightning.callbacks.spectrum_hooks import HookedSpectrumPairs
from hfmca_lightning.callbacks.step_outputs import EMBEDDING_KEYS, step_tensor, unknown_embedding_key
from hfmca_lightning.errors import ConfigurationError, check_at_least
from hfmca_lightning.losses.statistics import CorrelationStatistics
from hfmca_lightning.methods.inspection import paper_order
from hfmca_lightning.methods.update_guard import raise_if_a_step_failed_in
from hfmca_lightning.visualization import layer_spectra_figure, learning_dynamics_figure

__all__ = ["EigenspectrumCallback", "HISTOGRAM_BINS"]

HISTOGRAM_BINS = 20  # over [0, 1]: the same bins at every step, so W&B can draw the distribution over time
HOOKED_REG = 1e-3  # the regulariser of the pairs hooked on modules without cost pairs


class EigenspectrumCallback(FigureCallback):
    """The one owner of every spectrum quantity logged during training.

    Every ``every_n_steps`` optimiser steps it decomposes (paper Alg. 4) the statistics of each cost pair that the
    module's ``training_step`` returned (``outputs["statistics"]``, global-batch, keyed by pair: ``external``,
    ``internal/L3``, ...; :class:`~hfmca_lightning.methods.HFMCAModule` does; modules without cost pairs are hooked,
    below), summed over the last consecutive steps (every micro-batch of each, with gradient accumulation) that
    together hold at least ``min_groups`` groups of that pair (default ``groups_per_feature`` times its larger
    feature dimension: :class:`~hfmca_lightning.analysis.spectrum_window.SpectrumWindow`). A pair whose window is
    not full yet is not logged. The window mixes the statistics of consecutive parameter values, as the adaptive
    filter of Alg. 3 does; with ``beta > 0`` the spectra still come from the window's raw statistics, not the
    filter's estimates.

    The largest eigenvalue of uncentred statistics belongs to the constant function (close to 1 for features whose
    span holds the constants: sigmoid, ReLU), so it is reported apart. Logged per pair ``<name>``:

    * ``spectrum/<name>/trivial``: the constant function's eigenvalue;
    * ``spectrum/<name>/top1``, ``top10_mean`` and ``num_above_<threshold>`` of the other eigenvalues;
    * ``spectrum/<name>/groups``: how many groups the window holds;
    * ``eigenvalues/<name>/01`` .. ``/<top_k>``: the largest non-trivial eigenvalues, one series each;
    * to W&B loggers also ``spectrum/<name>/eigenvalues``, the non-trivial spectrum as a ``wandb.Histogram`` over
      [0, 1] (W&B draws its distribution over time without any panel set-up);
    * ``rankme/backbone``: RankMe (:func:`~hfmca_lightning.analysis.rankme`) of the backbone features of the step's
      batch (of every process, under DDP): those ``training_step`` returns (``outputs["features"]``, or
      stable-pretraining's ``outputs["embedding"]``: :mod:`~hfmca_lightning.callbacks.step_outputs`), else a hooked
      module's backbone outputs.

    Values go straight to the loggers, at the step of the window's last batch. At the end of every training epoch
    it draws two figures, written as PNG under ``<run dir>/figures`` and sent to W&B / TensorBoard:
    ``learning_dynamics`` (one heatmap per pair, x: step, y: the ``top_k`` largest non-trivial eigenvalues) and
    ``layer_spectra`` (one column of eigenvalue dots per pair, red line: mean of the 10 largest). Logging and figures
    are rank 0's; the history and the whole window are kept in checkpoints, under a key of the callback's settings
    (several instances keep their own).

    A module without cost pairs (a baseline: no ``cost_modules``) is hooked instead
    (:class:`~hfmca_lightning.callbacks.spectrum_hooks.HookedSpectrumPairs`): float64 statistics of its backbone's
    ``hooked_layers`` (default: its named stages or residual blocks), recorded on the steps before each log that
    their windows need, and the pair of its projections of views 0 and 1, all at ``hooked_reg``; the keys are those
    of an HFMCA run.

    Args:
        every_n_steps: log every this many optimiser steps (from the first).
        top_k: eigenvalue series logged per pair.
        threshold: the ``num_above_<threshold>`` count.
        output_dir: where figures go (default ``<run dir>/figures``).
        min_groups: the fewest groups a window holds (default ``groups_per_feature * max(K1, K2)`` per pair).
        groups_per_feature: see ``min_groups`` (default 100; set one of the two).
        hooked_layers: for modules without cost pairs, the backbone layers hooked (default: its named stages or
            residual blocks).
        hooked_reg: for modules without cost pairs, the regulariser of the hooked pairs' spectra (default 1e-3).
        embedding_key: the training output key of RankMe's features (default: ``features``, else ``embedding``).

    Raises:
        ConfigurationError: when a setting is out of its range (``every_n_steps``, ``top_k``, ``min_groups`` and
            ``groups_per_feature`` ``>= 1``, ``0 < threshold < 1``, ``hooked_reg > 0``), or ``min_groups`` and
            ``groups_per_feature`` are both set.

    Example::

        model = HFMCAModule(SmallConvNet(), external_head=GridExternalHead(128, grid_height=2, grid_width=2))
        data = MultiViewDataModule(SyntheticShapes(), views=SimCLRViews(count=4))
        spectra = EigenspectrumCallback(every_n_steps=50, top_k=20)
        Trainer(max_epochs=10, callbacks=[spectra]).fit(model, datamodule=data)
        eigenvalues = spectra.latest["external"]  # the last logged non-trivial eigenvalues, descending
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        top_k: int = 20,
        threshold: float = 0.5,
        output_dir: str | None = None,
        min_groups: int | None = None,
        groups_per_feature: int | None = None,
        hooked_layers: list[str] | None = None,
        hooked_reg: float | None = None,
        embedding_key: str | None = None,
    ) -> None:
        super().__init__(output_dir)
        owner = "EigenspectrumCallback"
        for name, count in (("every_n_steps", every_n_steps), ("top_k", top_k)):
            check_at_least(count, 1, name, owner)
        for name, optional in (("min_groups", min_groups), ("groups_per_feature", groups_per_feature)):
            if optional is not None:
                check_at_least(optional, 1, name, owner)
        if not 0 < threshold < 1:  # NaN too
            raise ConfigurationError(f"{owner} needs 0 < threshold < 1; got {threshold}", parameter="threshold")
        if hooked_reg is not None and not 0 < hooked_reg < math.inf:
            raise ConfigurationError(f"{owner} needs a finite hooked_reg > 0; got {hooked_reg}", parameter="hooked_reg")
        if min_groups is not None and groups_per_feature is not None:
            raise ConfigurationError(
                f"EigenspectrumCallback: set min_groups ({min_groups}: the same window for every pair) or "
                f"groups_per_feature ({groups_per_feature}: a window scaled by each pair's dimension), not both",
                parameter="groups_per_feature",
            )
        groups_per_feature = GROUPS_PER_FEATURE if groups_per_feature is None else groups_per_feature
        self.every_n_steps = every_n_steps
        self.min_groups = min_groups
        self.groups_per_feature = groups_per_feature
        self.window = SpectrumWindow(min_groups, groups_per_feature)
        self.top_k = top_k
        self.threshold = threshold
        self.history: dict[str, list[tuple[int, list[float]]]] = {}
        self._steps_seen = 0  # optimiser steps taken when the last batch ended (micro-batches share a step)
        self.hooked_layers, self.hooked_reg = hooked_layers, HOOKED_REG if hooked_reg is None else hooked_reg
        self._hooked_reg_given = hooked_reg is not None
        self.embedding_key = embedding_key
        self._hooked: HookedSpectrumPairs | None = None
        self._internal_steps: int | None = None  # hooked internal pairs: steps recorded before each log

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_steps=self.every_n_steps,
            top_k=self.top_k,
            min_groups=self.min_groups,
            groups_per_feature=self.groups_per_feature,
            hooked_layers=self.hooked_layers,
            hooked_reg=self.hooked_reg,
        )

    @property
    def latest(self) -> dict[str, torch.Tensor]:
        """Per pair, the non-trivial eigenvalues of the last logged spectrum."""
        return self.window.latest

    @property
    def window_groups(self) -> dict[str, int]:
        """Per pair, the groups the last logged spectrum came from."""
        return self.window.groups

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        has_costs = callable(getattr(pl_module, "cost_modules", None))
        given = [name for name, set_ in (("hooked_layers", self.hooked_layers is not None),
                 ("hooked_reg", self._hooked_reg_given)) if set_]  # fmt: skip
        if has_costs and given:
            raise ConfigurationError(
                f"EigenspectrumCallback: {' and '.join(given)} set the pairs hooked on modules without cost pairs, "
                f"but {type(pl_module).__name__} has its own (their spectra use the costs' settings): remove "
                f"{'them' if len(given) > 1 else 'it'}",
                parameter=given[0],
            )
        if stage == "fit" and self._hooked is None and not has_costs:
            self._hooked = HookedSpectrumPairs(self.hooked_layers, self.hooked_reg)
            self._hooked.attach(pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._hooked is None:
            return
        step = trainer.global_step + 1  # the step this batch makes
        until_log = (1 - step) % self.every_n_steps  # steps from this one to the next logged one
        internal = self._internal_steps is None or until_log < self._internal_steps
        self._hooked.start(internal=internal, features=until_log == 0)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._hooked is not None:
            self._hooked.stop()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # after the optimiser step: the batch that produced these statistics is step - 1
        stepped, self._steps_seen = step > self._steps_seen, step  # the last micro-batch of an optimiser step
        returned = step_tensor(outputs, self.embedding_key, EMBEDDING_KEYS)
        if returned is None and self.embedding_key is not None:
            raise unknown_embedding_key(
                "EigenspectrumCallback", self.embedding_key, outputs, "read `features` or `embedding`"
            )
        features = returned[1].detach() if returned is not None else None
        statistics: dict[str, CorrelationStatistics] | None
        if self._hooked is not None:
            statistics, hooked_features = self._hooked.collect()
            self._count_internal_steps(statistics)
            features = features if features is not None else hooked_features
        else:
            statistics = outputs.get("statistics") if isinstance(outputs, dict) else None
        if statistics:
            self.window.add(statistics)  # every batch and micro-batch
        if not statistics or not stepped or (step - 1) % self.every_n_steps != 0:
            return
        raise_if_a_step_failed_in(pl_module)
        self.window.close()
        regs = (
            dict.fromkeys(statistics, self.hooked_reg)
            if self._hooked is not None
            else {name: cost.reg for name, cost in pl_module.cost_modules().items()}  # type: ignore[operator]  # HFMCA's
        )
        metrics: dict[str, float] = {}
        for name in statistics:
            eigenvalues = self.window.spectrum(name, regs[name])
            if eigenvalues is None:
                continue
            nontrivial = eigenvalues[1:]
            top = nontrivial[: self.top_k].tolist()
            self.history.setdefault(name, []).append((step, top))
            metrics[f"spectrum/{name}/trivial"] = float(eigenvalues[0])
            metrics[f"spectrum/{name}/groups"] = float(self.window.groups[name])
            if len(nontrivial):
                metrics[f"spectrum/{name}/top1"] = float(nontrivial[0])
                metrics[f"spectrum/{name}/top10_mean"] = float(nontrivial[:10].mean())
                metrics[f"spectrum/{name}/num_above_{self.threshold:g}"] = float((nontrivial > self.threshold).sum())
            metrics.update({f"eigenvalues/{name}/{rank:02d}": value for rank, value in enumerate(top, start=1)})
        if isinstance(features, torch.Tensor) and features.dim() == 2:
            if trainer.world_size > 1:  # the whole batch of every process, as the spectra's windows
                features = cast(torch.Tensor, pl_module.all_gather(features)).flatten(0, 1)  # (W, n, D): one tensor
            if min(features.shape) > 1:
                metrics["rankme/backbone"] = float(rankme(features))
        if trainer.is_global_zero and metrics:
            self._log(trainer, metrics, step - 1)

    def _count_internal_steps(self, statistics: dict[str, CorrelationStatistics]) -> None:
        """From the first recorded step: how many steps of the hooked internal pairs fill their windows (one host
        read, once)."""
        internal = {name: stats for name, stats in statistics.items() if name.startswith("internal/")}
        if self._internal_steps is not None or not internal:
            return
        counts = torch.stack([stats.group_count for stats in internal.values()]).tolist()
        self._internal_steps = max(
            -(-self.window.groups_needed(stats) // max(1, int(count)))
            for stats, count in zip(internal.values(), counts)
        )

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
                if f"spectrum/{name}/trivial" in metrics
            }
        for logger in trainer.loggers:
            logger.log_metrics({**metrics, **histograms} if isinstance(logger, WandbLogger) else metrics, step=step)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self.history:
            return
        epoch = trainer.current_epoch
        ranks = max(len(values) for entries in self.history.values() for _, values in entries)
        history = {  # at the steps the metrics are logged under (the batch's: optimiser steps taken - 1)
            name: ([step - 1 for step, _ in entries], np.array([_pad(values, ranks) for _, values in entries]))
            for name, entries in ((name, self.history[name]) for name in paper_order(self.history))
        }
        self.publish(
            trainer, learning_dynamics_figure(history), "learning_dynamics", f"learning_dynamics_epoch{epoch:03d}.png"
        )
        groups = min(self.window_groups.values(), default=0)
        spectra = layer_spectra_figure(
            {name: self.latest[name] for name in paper_order(self.latest)},
            title=f"Spectrum per layer pair, step {trainer.global_step} (windows of >= {groups} groups)",
        )
        self.publish(trainer, spectra, "layer_spectra", f"layer_spectra_epoch{epoch:03d}.png")

    def state_dict(self) -> dict[str, Any]:
        """The history, the optimiser steps seen and the whole window (a few ``K x K`` sums per pair, the last spectra),
        so a resumed run logs and draws what an uninterrupted one would."""
        return {
            "history": self.history,
            "internal_steps": self._internal_steps,
            "steps_seen": self._steps_seen,
            "window": self.window.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave.

        Args:
            state_dict: the callback's entry of a checkpoint.
        """
        self.history = {
            name: [(int(step), list(values)) for step, values in entries]
            for name, entries in state_dict["history"].items()
        }
        self._internal_steps = state_dict.get("internal_steps")
        self._steps_seen = int(state_dict["steps_seen"])
        self.window.load_state_dict(state_dict["window"])

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Restored sums go to the module's device (checkpoints may be loaded on the CPU)."""
        self.window.to(pl_module.device)
        self._steps_seen = max(self._steps_seen, trainer.global_step)


def _pad(values: list[float], length: int) -> list[float]:
    return values + [float("nan")] * (length - len(values))
