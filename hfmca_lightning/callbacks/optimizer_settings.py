"""``ConfiguredOptimizerSettings``: a resumed fit trains with its config's optimiser and schedule settings."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim.lr_scheduler import CosineAnnealingLR

__all__ = ["ConfiguredOptimizerSettings"]

# A scheduler's state that says where it is, not how it was configured: restored from the checkpoint as it is.
_PROGRESS = frozenset({"last_epoch", "base_lrs", "lr_lambdas"})
_PLAIN = (int, float, bool, str, tuple, type(None))


def _differs(restored: Any, configured: Any) -> bool:
    """Whether two plain setting values differ (tensors and other objects are left as restored)."""
    return isinstance(restored, _PLAIN) and isinstance(configured, _PLAIN) and restored != configured


def _initial_lr(group: dict[str, Any]) -> Any:
    """A parameter group's learning rate before any schedule (``initial_lr``, which a scheduler sets), else ``lr``."""
    return group.get("initial_lr", group.get("lr"))


class ConfiguredOptimizerSettings(Callback):
    """When a fit resumes, Lightning restores each optimiser's and scheduler's state over the ones the config built,
    settings included, so a learning rate, weight decay or run length changed for the resumed run would be ignored.
    This callback notes the settings as built (``on_fit_start``, before the restore) and, resumed, puts them back
    (``on_train_start``): a changed learning rate scales the restored schedule (each group's ``lr`` and
    ``initial_lr`` and its schedulers' ``base_lrs`` by new / old initial rate: the schedule goes on where it was, at
    the new scale); other group settings (``weight_decay``, ``momentum``, ``betas``, ...) and scheduler settings
    (``T_max``, ``eta_min``, ...) take the config's values, a cosine's learning rate then the new cosine's at the run's
    point. One line says what changed; with nothing changed a resumed
    run stays exact. The ``hfmca`` CLI adds it to every run."""

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
        built_groups, built_schedulers = built
        changes: list[str] = []
        for optimizer, groups in zip(trainer.optimizers, built_groups):
            schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if c.scheduler.optimizer is optimizer]
            for number, (group, configured) in enumerate(zip(optimizer.param_groups, groups)):
                old, new = _initial_lr(group), _initial_lr(configured)
                if _differs(old, new) and old:
                    factor = new / old
                    group["lr"] = group["lr"] * factor
                    if "initial_lr" in group:
                        group["initial_lr"] = new
                    for scheduler in schedulers:
                        scheduler.base_lrs[number] = scheduler.base_lrs[number] * factor
                        last = getattr(scheduler, "_last_lr", None)
                        if last is not None:
                            last[number] = group["lr"]
                    changes.append(f"lr {old:g} -> {new:g}")
                for key, value in configured.items():
                    if key not in ("lr", "initial_lr") and _differs(group.get(key), value):
                        changes.append(f"{key} {group.get(key)} -> {value}")
                        group[key] = value
        for config, state in zip(trainer.lr_scheduler_configs, built_schedulers):
            scheduler, changed = config.scheduler, False
            for key, value in state.items():
                if key not in _PROGRESS and not key.startswith("_") and _differs(getattr(scheduler, key), value):
                    changes.append(f"{type(scheduler).__name__} {key} {getattr(scheduler, key)} -> {value}")
                    setattr(scheduler, key, value)
                    changed = True
            if changed and isinstance(scheduler, CosineAnnealingLR):  # where the new cosine is at this point
                position = math.cos(math.pi * scheduler.last_epoch / scheduler.T_max)
                rates = [
                    scheduler.eta_min + (base - scheduler.eta_min) * (1 + position) / 2 for base in scheduler.base_lrs
                ]
                for group, rate in zip(scheduler.optimizer.param_groups, rates):
                    group["lr"] = rate
                scheduler._last_lr = rates
        if changes:
            rank_zero_info(
                "resumed with the config's optimiser settings, not the checkpoint's: "
                + ", ".join(dict.fromkeys(changes))
                + " (the schedule goes on from where it was)"
            )
