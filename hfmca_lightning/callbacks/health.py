"""Label-free health of any SSL run, online: RankMe, effective rank, alpha-ReQ and LiDAR of the embeddings the
training steps already compute (:mod:`hfmca_lightning.analysis.health`), and a collapse alarm."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from hfmca_lightning.analysis.health import HealthStatistics
from hfmca_lightning.callbacks.step_outputs import step_embeddings, unknown_embedding_key
from hfmca_lightning.data.batch_formats import BatchFormat, first_views
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning, check_at_least
from hfmca_lightning.methods.update_guard import raise_if_a_step_failed_in

__all__ = ["CollapseError", "HealthMetrics"]


class CollapseError(RuntimeError):
    """The run's effective rank fell below the alarm's fraction of its best (``stop_on_collapse``)."""


class HealthMetrics(Callback):
    """Every ``every_n_steps`` optimiser steps (or, where an estimate needs more steps' samples than that, as soon as it
    has them), the label-free health of the embeddings: logged as ``health/rankme``,
    ``health/effective_rank``, ``health/alpha_req``, ``health/lidar`` (two or more views per sample) and
    ``health/samples``, usable by ``ModelCheckpoint(monitor=...)`` as any metric (docs/conventions.md §9). Each
    estimate is one row of the loggers, at the step it was computed at (``log_every_n_steps`` does not apply).

    The embeddings are the training steps' own, no extra forward pass: a step's ``outputs["features"]`` (``(B * L,
    D)`` with each sample's ``L`` views together, as :class:`~hfmca_lightning.methods.HFMCAModule` returns them, or
    ``(B, L, D)``) or ``outputs["embedding"]`` (stable-pretraining's views concatenated, ``(L * B, D)``;
    :mod:`~hfmca_lightning.callbacks.step_outputs`), else the outputs of ``pl_module.backbone`` during the step (the
    baselines call it once per view: ``L`` outputs ``(B, D)``; one call over all views: ``(B * L, D)`` as
    ``views_first`` says). They are summed
    (:class:`~hfmca_lightning.analysis.health.HealthStatistics`, float64) over the steps just before each logged
    one, until at least ``samples_per_dim * D`` samples (all processes together: the sums are all-reduced) — an
    estimate of ``N`` samples can show a rank of at most ``N``.

    The collapse alarm: one warning line when the effective rank falls below ``collapse_fraction`` of the best it
    reached; with ``stop_on_collapse`` the run then stops with one line (:class:`CollapseError`, exit 1), before any
    later checkpoint, so the last one written is from before the collapse.

    Args:
        every_n_steps: log every this many optimiser steps.
        samples_per_dim: samples per embedding dimension an estimate waits for.
        embedding_key: the key of a training step's output that holds its embeddings (default: ``features``, else
            ``embedding``).
        views_first: whether 2-D embeddings (a step's output, or one backbone call over all views) are the views
            concatenated view after view (default: for ``embedding`` only).
        collapse_fraction: the alarm's fraction of the best effective rank (0 turns it off).
        stop_on_collapse: stop the run when the alarm rings.

    Raises:
        ConfigurationError: when ``every_n_steps`` or ``samples_per_dim`` is below 1, or ``collapse_fraction`` is not
            in [0, 1).

    Example::

        trainer = Trainer(callbacks=[HealthMetrics(every_n_steps=100, stop_on_collapse=True),
                                     ModelCheckpoint(monitor="health/effective_rank", mode="max")])
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        samples_per_dim: int = 2,
        embedding_key: str | None = None,
        views_first: bool | None = None,
        collapse_fraction: float = 0.25,
        stop_on_collapse: bool = False,
    ) -> None:
        check_at_least(every_n_steps, 1, "every_n_steps", "HealthMetrics")
        check_at_least(samples_per_dim, 1, "samples_per_dim", "HealthMetrics")
        if not 0 <= collapse_fraction < 1:
            raise ConfigurationError(
                f"HealthMetrics: collapse_fraction must be in [0, 1); got {collapse_fraction}",
                parameter="collapse_fraction",
            )
        if stop_on_collapse and collapse_fraction == 0:
            raise ConfigurationError(
                f"HealthMetrics: collapse_fraction {collapse_fraction} never raises the collapse alarm, so "
                "stop_on_collapse would never stop the run; give a fraction in (0, 1)",
                parameter="collapse_fraction",
            )
        self.every_n_steps, self.samples_per_dim = every_n_steps, samples_per_dim
        self.embedding_key, self.views_first = embedding_key, views_first
        self.collapse_fraction, self.stop_on_collapse = collapse_fraction, stop_on_collapse
        self.sums: HealthStatistics | None = None
        self.window_steps: int | None = None  # steps an estimate needs, known from the first batch
        self.best_effective_rank, self.best_step, self.alarmed = 0.0, -1, False
        self.pending = False  # a logged step passed without enough samples: sum on and log as soon as there are
        self._hooked: list[Tensor] = []
        self._handle: Any = None
        self._from_outputs = False  # the steps return their embeddings: no hook needed

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, samples_per_dim=self.samples_per_dim)

    # --- which steps collect -----------------------------------------------------------------------------------------

    def _collects(self, step: int) -> bool:
        """Whether the batches of optimiser step ``step`` (counted from 1) are summed: the window before a logged
        step, or every step until the first window is known or while an estimate still waits for samples."""
        if self.window_steps is None or self.pending:
            return True
        return (-step) % self.every_n_steps < self.window_steps

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._hooked.clear()
        backbone = getattr(pl_module, "backbone", None)
        if not isinstance(backbone, nn.Module) or self._from_outputs or self._handle is not None:
            return
        if self._collects(trainer.global_step + 1):
            self._handle = backbone.register_forward_hook(self._record)

    def _record(self, module: nn.Module, inputs: Any, output: Any) -> None:
        # the training step's own calls only: not another callback's evaluation pass (eval mode, no grad)
        if isinstance(output, Tensor) and output.dim() == 2 and module.training and torch.is_grad_enabled():
            self._hooked.append(output.detach())

    def _release(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _embeddings(self, outputs: Any, batch: Any, trainer: Trainer) -> Tensor | None:
        """``(B, L, D)`` embeddings of the step, or None where it has none."""
        batch_format: BatchFormat = getattr(getattr(trainer, "datamodule", None), "batch_format", "stacked")
        samples = first_views(batch, batch_format)[1].shape[0]
        given = step_embeddings(outputs, self.embedding_key, samples, self.views_first)
        self._from_outputs = given is not None
        if given is not None:
            return given
        if self.embedding_key is not None:
            raise unknown_embedding_key("HealthMetrics", self.embedding_key, outputs, "hook the backbone")
        calls = [call for call in self._hooked if call.shape[0] == samples]
        if calls and len({call.shape[1] for call in calls}) == 1:
            return torch.stack(calls, dim=1)
        if len(self._hooked) == 1 and self._hooked[0].shape[0] % samples == 0:  # one call over every view
            rows, dim = self._hooked[0], self._hooked[0].shape[-1]
            if self.views_first:
                return rows.reshape(-1, samples, dim).transpose(0, 1)
            return rows.reshape(samples, -1, dim)
        return None

    # --- summing and logging -----------------------------------------------------------------------------------------

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._release()
        stepped = self._stepped(trainer, batch_idx)
        step = trainer.global_step  # after this batch's optimiser step (if it made one)
        collecting = self._collects(step if stepped else step + 1)
        embeddings = self._embeddings(outputs, batch, trainer) if collecting else None
        self._hooked.clear()
        if embeddings is None:
            return
        added = HealthStatistics.of(embeddings)
        self.sums = added if self.sums is None or self.sums.views != added.views else self.sums.merge(added)
        if self.window_steps is None:
            needed = self.samples_per_dim * embeddings.shape[-1]
            self.window_steps = max(1, math.ceil(needed / (embeddings.shape[0] * max(1, trainer.world_size))))
            if not self._collects(step if stepped else step + 1):
                self.sums = None  # the first step, summed to learn the window, is not in it
                return
        if not stepped or (step % self.every_n_steps != 0 and not self.pending):
            return
        raise_if_a_step_failed_in(pl_module)
        sums = self._reduced(trainer)
        if float(sums.samples) < self.samples_per_dim * sums.first_sum.shape[0]:
            self.pending = True
            return  # wait for more samples (the first window, or a short epoch)
        self.sums, self.pending = None, False
        self._log(trainer, pl_module, sums.metrics() | {"samples": float(sums.samples)}, step)

    @staticmethod
    def _stepped(trainer: Trainer, batch_idx: int) -> bool:
        """Whether batch ``batch_idx`` ended an optimiser step (the last micro-batch of an accumulation), as
        Lightning decides it."""
        accumulate = max(1, trainer.accumulate_grad_batches)
        return (batch_idx + 1) % accumulate == 0 or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def _reduced(self, trainer: Trainer) -> HealthStatistics:
        assert self.sums is not None
        if trainer.world_size == 1:
            return self.sums
        tensors = [trainer.strategy.reduce(tensor.clone(), reduce_op="sum") for tensor in self.sums.tensors()]
        return HealthStatistics.from_tensors(tensors, self.sums.views)

    def _log(self, trainer: Trainer, pl_module: LightningModule, metrics: dict[str, float], step: int) -> None:
        """The estimate of optimiser step ``step``: straight to the loggers, once, under the step of its batch (as
        Lightning logs a step's row: ``step - 1``), and in ``trainer.callback_metrics`` for ``ModelCheckpoint(
        monitor=...)`` (``logger=False``: Lightning would log the value again at every logging step until the epoch
        ends, rows of a stale estimate that a resumed run would not repeat)."""
        named = {f"health/{name}": value for name, value in metrics.items()}
        for name, value in named.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, logger=False)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(named, step=step - 1)
        rank = metrics["effective_rank"]
        if rank > self.best_effective_rank:
            self.best_effective_rank, self.best_step = rank, step
        if self.collapse_fraction and not self.alarmed and rank < self.collapse_fraction * self.best_effective_rank:
            self.alarmed = True
            line = (
                f"the representation is collapsing: its effective rank fell to {rank:.3g} at step {step}, below "
                f"{self.collapse_fraction:g} of its best ({self.best_effective_rank:.3g} at step {self.best_step})"
            )
            if self.stop_on_collapse:
                raise CollapseError(f"{line}; the run stops, its last checkpoint is from before")
            rank_zero_warn(line, category=HFMCAWarning)

    # --- exact resume ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "sums": None if self.sums is None else [tensor.cpu() for tensor in self.sums.tensors()],
            "views": None if self.sums is None else self.sums.views,
            "window_steps": self.window_steps,
            "best": (self.best_effective_rank, self.best_step),
            "alarmed": self.alarmed,
            "pending": self.pending,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sums = state_dict.get("sums")
        self.sums = None if sums is None else HealthStatistics.from_tensors(list(sums), state_dict["views"])
        self.window_steps = state_dict.get("window_steps")
        self.best_effective_rank, self.best_step = state_dict.get("best", (0.0, -1))
        self.alarmed = bool(state_dict.get("alarmed", False))
        self.pending = bool(state_dict.get("pending", False))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.sums is not None:  # restored from a checkpoint on the CPU
            tensors = [tensor.to(pl_module.device) for tensor in self.sums.tensors()]
            self.sums = HealthStatistics.from_tensors(tensors, self.sums.views)
