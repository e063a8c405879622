"""``ConfiguredOptimizerSettings``: a resumed fit trains with its config's optimiser and schedule settings."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from hfmca_lightning.errors import ConfigurationError

__all__ = ["ConfiguredOptimizerSettings"]

# A scheduler's state that says where the run is, not how it was configured: kept as restored.
_POSITION = frozenset(
    {
        "last_epoch",
        "_step_count",
        "_last_lr",
        "_is_initial",
        "_get_lr_called_within_step",
        "base_lrs",  # the groups' initial rates: compared as those
        "T_cur",  # CosineAnnealingWarmRestarts
        "T_i",
        "best",  # ReduceLROnPlateau
        "num_bad_epochs",
        "cooldown_counter",
    }
)
_CYCLED = ("momentum", "betas")  # group settings that schedulers with cycle_momentum (OneCycleLR, CyclicLR) set


def _same(restored: Any, configured: Any) -> bool:
    """Whether a restored setting equals the configured one (tuples and lists alike, tensors by value)."""
    if isinstance(restored, torch.Tensor) or isinstance(configured, torch.Tensor):
        return torch.equal(torch.as_tensor(restored), torch.as_tensor(configured))
    if isinstance(restored, (list, tuple)) and isinstance(configured, (list, tuple)):
        return len(restored) == len(configured) and all(_same(a, b) for a, b in zip(restored, configured))
    if isinstance(restored, dict) and isinstance(configured, dict) and not isinstance(restored, Counter):
        return restored.keys() == configured.keys() and all(_same(restored[k], configured[k]) for k in restored)
    if callable(restored) or callable(configured):
        return True  # functions: not state (a LambdaLR's are the config's; objects' fields are compared)
    return bool(restored == configured)


def _settings(*values: Any) -> list[Any]:
    """Each value without where the run is (the position entries of the sub-schedulers' states of a sequential or
    chained schedule)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict) and not isinstance(value, Counter):
            return {key: strip(item) for key, item in value.items() if key not in _POSITION}
        if isinstance(value, (list, tuple)):
            return [strip(item) for item in value]
        return value

    return [strip(value) for value in values]


def _described(what: str, restored: Any, configured: Any) -> str:
    """``what old -> new`` for plain values, ``what`` for others."""
    plain = (int, float, str, bool)
    return (
        f"{what} {restored} -> {configured}" if isinstance(restored, plain) and isinstance(configured, plain) else what
    )


def _has_closed_form(scheduler: Any) -> bool:
    """Whether :func:`_rates` can give the rates of ``scheduler`` from its settings alone: a ``LambdaLR`` (lightly's
    warm-up cosine too), or torch's step, cosine, linear, ... schedules."""
    return isinstance(scheduler, LambdaLR) or callable(getattr(scheduler, "_get_closed_form_lr", None))


def _rates(scheduler: Any) -> list[float]:
    """The rates of ``scheduler`` (one with :func:`_has_closed_form`) at its ``last_epoch``."""
    if isinstance(scheduler, LambdaLR):
        return [
            float(base * rule(scheduler.last_epoch)) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)
        ]
    return [float(rate) for rate in scheduler._get_closed_form_lr()]


def _kinds(trainer: Trainer) -> list[list[str]]:
    """Each scheduler's class and how often it steps (``interval``, ``frequency``): what its ``last_epoch`` counts."""
    return [
        [type(config.scheduler).__name__, str(config.interval), str(config.frequency)]
        for config in trainer.lr_scheduler_configs
    ]


class ConfiguredOptimizerSettings(Callback):
    """When a fit resumes, Lightning restores each optimiser's and scheduler's state over the ones the config built,
    settings included, so a learning rate, weight decay or run length changed for the resumed run would be ignored.
    This callback notes the settings as built (``on_fit_start``, before the restore) and, resumed, puts back those
    that changed (``on_train_start``): each group's initial learning rate (its schedulers' ``base_lrs``), the
    optimiser's own settings (``weight_decay``, ``momentum``, ``betas``, ... but those a schedule cycles) and the
    schedulers' settings (``T_max``, ``step_size``, lightly's warm-up cosine's ``max_epochs``, a lambda object's
    fields, ...: their state but where the run is). The rate is then the new schedule's at the run's point, as a run
    started with these settings would have it. A change of a schedule without a closed form (warm restarts, one-cycle,
    cyclic, multiplicative, sequential and chained schedules, two schedulers of one optimiser), of a scheduler's class
    or of how often it steps is one ``ConfigurationError`` before training; ``ReduceLROnPlateau`` takes the new
    settings and keeps the rate the metric took it to. Functions (the lambdas of ``LambdaLR`` and
    ``MultiplicativeLR``) are not state: the config's apply from the run's point. One line says what changed; with
    nothing changed nothing is touched (a ``LambdaLR``'s rate is recomputed as its step computes it), and a resumed
    run stays exact. The ``hfmca`` CLI adds it to every run."""

    def __init__(self) -> None:
        super().__init__()
        self._built: tuple[list[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
        self._kinds: list[list[str]] | None = None  # this run's schedulers, in its checkpoints
        self._restored_kinds: list[list[str]] | None = None  # those of the run a checkpoint comes from

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": self._kinds or []}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._kinds = state_dict.get("schedulers")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        groups = [
            [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
            for optimizer in trainer.optimizers
        ]
        self._built = groups, [dict(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        self._restored_kinds, self._kinds = self._kinds, _kinds(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        built, self._built = self._built, None
        if built is None or trainer.ckpt_path is None:
            return
        if self._restored_kinds is not None and self._restored_kinds != self._kinds:
            raise ConfigurationError(
                f"the checkpoint's run stepped its schedule as {self._restored_kinds} (class, interval, frequency), "
                f"this config as {self._kinds}: its position cannot be carried over; resume with the checkpoint's "
                "schedule, or start a new run"
            )
        built_groups, built_states = built
        configs = trainer.lr_scheduler_configs
        states = {id(config.scheduler): state for config, state in zip(configs, built_states)}
        changes: list[str] = []
        for optimizer, groups in zip(trainer.optimizers, built_groups):
            schedulers = [config.scheduler for config in configs if config.scheduler.optimizer is optimizer]
            changes += _apply(optimizer, groups, schedulers, states)
        if changes:
            rank_zero_info(
                "resumed with the config's optimiser settings, not the checkpoint's: "
                + ", ".join(dict.fromkeys(changes))
                + " (the schedule goes on from the run's point)"
            )


def _apply(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], schedulers: list[Any], states: dict[int, Any]
) -> list[str]:
    """Put the configured settings of one optimiser and its schedulers back; what changed, in words."""
    changes: list[str] = []
    cycled = any(getattr(scheduler, "cycle_momentum", False) for scheduler in schedulers)
    rate_changes: list[str] = []  # changes of the schedule's rates
    for number, (group, configured) in enumerate(zip(optimizer.param_groups, groups)):
        for key, value in configured.items():
            if key in ("lr", "initial_lr") or (cycled and key in _CYCLED) or _same(group.get(key), value):
                continue
            # the optimiser's own settings; others are a schedule's (OneCycleLR's max_lr, min_lr, ...)
            (changes if key in optimizer.defaults else rate_changes).append(f"{key} {group.get(key)} -> {value}")
            group[key] = value
        if any(isinstance(scheduler, ReduceLROnPlateau) for scheduler in schedulers):
            continue  # its rate is where the metric took it: no initial rate to compare
        old, new = group.get("initial_lr", group["lr"]), configured.get("initial_lr", configured["lr"])
        if not _same(old, new):
            rate_changes.append(f"lr {old:g} -> {new:g}")
            if not schedulers:
                group["lr"] = new
            if "initial_lr" in group:
                group["initial_lr"] = new
            for scheduler in schedulers:
                if hasattr(scheduler, "base_lrs"):
                    scheduler.base_lrs[number] = new
    for scheduler in schedulers:
        built, restored = states.get(id(scheduler), {}), scheduler.state_dict()  # alike: sub-schedulers as states
        name = type(scheduler).__name__
        altered = [
            key
            for key, value in built.items()
            if key not in _POSITION and not _same(*_settings(restored.get(key), value))
        ]
        rate_changes += [_described(f"{name} {key}", restored.get(key), built[key]) for key in altered]
        if isinstance(scheduler, ReduceLROnPlateau):
            for key in altered:
                setattr(scheduler, key, built[key])
            changes += rate_changes
            rate_changes = []
            continue
        if not rate_changes and not isinstance(scheduler, LambdaLR):
            continue  # a LambdaLR's rule is the config's function: its rate is recomputed (what its step computes)
        if len(schedulers) > 1 or not _has_closed_form(scheduler):
            why = "two schedulers set its rate" if len(schedulers) > 1 else f"{name} has no closed form"
            raise ConfigurationError(
                f"resuming cannot carry {', '.join(dict.fromkeys(rate_changes))} into the schedule from the run's "
                f"point ({why}): resume with the checkpoint's learning rate and schedule, or start a new run"
            )
        for key in altered:
            _restore(scheduler, key, built[key])
        rates = _rates(scheduler)
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        scheduler._last_lr = rates  # what get_last_lr() and Lightning's LearningRateMonitor read
    return changes + rate_changes


def _restore(scheduler: Any, key: str, value: Any) -> None:
    if key == "lr_lambdas":  # lambda objects: their fields as built
        for rule, fields in zip(scheduler.lr_lambdas, value):
            if fields is not None:
                rule.__dict__.update(fields)
    else:
        setattr(scheduler, key, value)
