"""``ConfiguredOptimizerSettings``: a resumed fit trains with its config's optimiser and schedule settings."""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim.lr_scheduler import LambdaLR

from hfmca_lightning.errors import ConfigurationError

__all__ = ["ConfiguredOptimizerSettings"]

_NOT_SETTINGS = frozenset({"self", "optimizer", "last_epoch", "verbose"})  # a scheduler's arguments that set no rate
_CYCLED = ("momentum", "betas")  # group settings that schedulers with cycle_momentum (OneCycleLR, CyclicLR) set


def _same(restored: Any, configured: Any) -> bool:
    """Whether a restored setting equals the configured one (tuples and lists alike; values that cannot be compared
    count as equal: they are left as restored)."""
    if isinstance(restored, torch.Tensor) or isinstance(configured, torch.Tensor):
        return True
    if isinstance(restored, (list, tuple)) and isinstance(configured, (list, tuple)):
        return list(restored) == list(configured)
    if isinstance(restored, (int, float, bool, str, type(None), Counter, dict)):
        return bool(restored == configured)
    return True


def _settings(scheduler: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The entries of a scheduler's ``state`` that are arguments of its class (``T_max``, ``step_size``, ...), not
    where it is (``last_epoch``, ``T_cur``, ...)."""
    names = set(inspect.signature(type(scheduler).__init__).parameters) - _NOT_SETTINGS
    return {name: value for name, value in state.items() if name in names}


def _rates(scheduler: Any) -> list[float] | None:
    """The rates of ``scheduler`` at its ``last_epoch`` from its settings alone, or None where it has no closed form."""
    if isinstance(scheduler, LambdaLR):
        return [
            float(base * rule(scheduler.last_epoch)) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)
        ]
    closed_form = getattr(scheduler, "_get_closed_form_lr", None)  # torch's step, cosine, linear, ... schedules
    return list(closed_form()) if callable(closed_form) else None


class ConfiguredOptimizerSettings(Callback):
    """When a fit resumes, Lightning restores each optimiser's and scheduler's state over the ones the config built,
    settings included, so a learning rate, weight decay or run length changed for the resumed run would be ignored.
    This callback notes the settings as built (``on_fit_start``, before the restore) and, resumed, puts back those
    that changed (``on_train_start``): a group's initial learning rate (its schedulers' ``base_lrs``), the optimiser's
    own settings (``weight_decay``, ``momentum``, ``betas``, ... but those a schedule cycles), and the schedulers'
    arguments (``T_max``, ``step_size``, ``max_epochs`` of lightly's warm-up cosine, ...); the rate is then the new
    schedule's at the run's point, as a run started with these settings would have it. A change to a schedule without
    a closed form (warm restarts, one-cycle, chained) is one ``ConfigurationError``; schedulers without ``base_lrs``
    (``ReduceLROnPlateau``) are left as restored. One line says what changed; with nothing changed nothing is touched,
    and a resumed run stays exact. The ``hfmca`` CLI adds it to every run."""

    def __init__(self) -> None:
        super().__init__()
        self._built: tuple[list[list[dict[str, Any]]], list[dict[str, Any]]] | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        groups = [
            [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
            for optimizer in trainer.optimizers
        ]
        self._built = groups, [dict(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        built, self._built = self._built, None
        if built is None or trainer.ckpt_path is None:
            return
        built_groups, built_states = built
        configs = trainer.lr_scheduler_configs
        scheduler_states = {id(config.scheduler): state for config, state in zip(configs, built_states)}
        changes: list[str] = []
        for optimizer, groups in zip(trainer.optimizers, built_groups):
            schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if c.scheduler.optimizer is optimizer]
            if any(not hasattr(scheduler, "base_lrs") for scheduler in schedulers):
                continue  # ReduceLROnPlateau, chained schedules: their state is their own
            changes += self._apply(optimizer, groups, schedulers, scheduler_states)
        if changes:
            rank_zero_info(
                "resumed with the config's optimiser settings, not the checkpoint's: "
                + ", ".join(dict.fromkeys(changes))
                + " (the schedule goes on from the run's point)"
            )

    @staticmethod
    def _apply(
        optimizer: torch.optim.Optimizer,
        groups: list[dict[str, Any]],
        schedulers: list[Any],
        scheduler_states: dict[int, dict[str, Any]],
    ) -> list[str]:
        """Put the configured settings of one optimiser and its schedulers back; what changed, in words."""
        changes: list[str] = []  # in words
        rate_changed = False  # the schedule's rate must be recomputed
        cycled = any(getattr(scheduler, "cycle_momentum", False) for scheduler in schedulers)
        for number, (group, configured) in enumerate(zip(optimizer.param_groups, groups)):
            for key in optimizer.defaults:
                if key == "lr" or (cycled and key in _CYCLED) or key not in configured:
                    continue
                if not _same(group.get(key), configured[key]):
                    changes.append(f"{key} {group.get(key)} -> {configured[key]}")
                    group[key] = configured[key]
            old, new = group.get("initial_lr", group["lr"]), configured.get("initial_lr", configured["lr"])
            if not _same(old, new):
                changes.append(f"lr {old:g} -> {new:g}")
                rate_changed = True
                if not schedulers:
                    group["lr"] = new
                if "initial_lr" in group:
                    group["initial_lr"] = new
                for scheduler in schedulers:
                    scheduler.base_lrs[number] = new
        for scheduler in schedulers:
            settings = _settings(scheduler, scheduler_states.get(id(scheduler), {}))
            altered = [name for name, value in settings.items() if not _same(getattr(scheduler, name, value), value)]
            name = type(scheduler).__name__
            changes += [f"{name} {key} {getattr(scheduler, key)} -> {settings[key]}" for key in altered]
            for key in altered:
                setattr(scheduler, key, settings[key])
            if not (rate_changed or altered):
                continue
            rates = _rates(scheduler) if len(schedulers) == 1 else None
            if rates is None:
                raise ConfigurationError(
                    f"resuming cannot carry {', '.join(changes)} into {name}'s schedule from the run's point: resume "
                    "with the checkpoint's optimiser and schedule settings, or start a new run"
                )
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate
            scheduler._last_lr = list(rates)  # what get_last_lr() and Lightning's LearningRateMonitor read
        return changes
