"""ConfiguredOptimizerSettings against a plain reference: an optimiser and scheduler built with the config's settings,
given the state of a run with other settings (as Lightning restores it), then the callback, give the rates of a run
started with the config's settings at the same point; with the same settings nothing is touched."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightly.utils.scheduler import CosineWarmupScheduler
from torch.optim import SGD, Adam
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    CosineAnnealingWarmRestarts,
    LinearLR,
    MultiStepLR,
    OneCycleLR,
    ReduceLROnPlateau,
    SequentialLR,
    StepLR,
)

from hfmca_lightning.callbacks import ConfiguredOptimizerSettings
from hfmca_lightning.errors import ConfigurationError

Build = Callable[[dict[str, Any]], tuple[torch.optim.Optimizer, Any]]


def sequential(optimizer: torch.optim.Optimizer, T_max: int) -> SequentialLR:  # noqa: N803 - torch's name
    """A linear warm-up over 3 steps, then a cosine over ``T_max``."""
    return SequentialLR(optimizer, [LinearLR(optimizer, 0.1, 1.0, 3), CosineAnnealingLR(optimizer, T_max)], [3])


def build(optimizer: type, scheduler: type | None, optimizer_settings: dict, scheduler_settings: dict) -> Any:
    """``settings -> (optimiser, scheduler)`` over two parameter groups (one without weight decay, as the project's)."""
    torch.manual_seed(0)
    weights, bias = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    groups = [{"params": [weights]}, {"params": [bias], "weight_decay": 0.0}]
    made = optimizer(groups, **optimizer_settings)
    return made, None if scheduler is None else scheduler(made, **scheduler_settings)


def train(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> None:
    for _ in range(steps):
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                parameter.grad = torch.ones_like(parameter)
        optimizer.step()
        if isinstance(scheduler, ReduceLROnPlateau):
            scheduler.step(1.0)
        elif scheduler is not None:
            scheduler.step()


def as_trainer(made: tuple, interval: str = "epoch") -> SimpleNamespace:
    """What the callback reads of a Lightning trainer: optimisers, scheduler configs, the checkpoint resumed."""
    optimizer, scheduler = made
    configs = [] if scheduler is None else [SimpleNamespace(scheduler=scheduler, interval=interval, frequency=1)]
    return SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=configs, ckpt_path=None)


def resumed(made: tuple, saved: tuple, interval: str = "epoch", saved_interval: str = "epoch") -> None:
    """Lightning's resume: ``made`` is built from the config (noted by the callback), ``saved``'s state and the
    callback state of its run are loaded over it, then training starts (the callback puts the config's settings
    back)."""
    saving = ConfiguredOptimizerSettings()
    saving.on_fit_start(as_trainer(saved, saved_interval), None)
    callback, trainer = ConfiguredOptimizerSettings(), as_trainer(made, interval)
    callback.load_state_dict(copy.deepcopy(saving.state_dict()))
    callback.on_fit_start(trainer, None)
    optimizer, scheduler = made
    optimizer.load_state_dict(copy.deepcopy(saved[0].state_dict()))
    if scheduler is not None:
        scheduler.load_state_dict(copy.deepcopy(saved[1].state_dict()))
    trainer.ckpt_path = "last.ckpt"
    callback.on_train_start(trainer, None)


def rates(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
    """The rates of every group for ``steps`` more steps, one after the other."""
    seen = []
    for _ in range(steps):
        seen += [group["lr"] for group in optimizer.param_groups]
        train(optimizer, scheduler, 1)
    return seen


# (optimiser, scheduler, the checkpoint's settings, the config's settings)
CHANGED = {
    "cosine, lower lr and longer run": (
        SGD,
        CosineAnnealingLR,
        ({"lr": 0.1}, {"T_max": 6}),
        ({"lr": 0.01}, {"T_max": 10}),
    ),
    "cosine with a floor, lower lr": (
        SGD,
        CosineAnnealingLR,
        ({"lr": 0.1}, {"T_max": 10, "eta_min": 0.001}),
        ({"lr": 0.01}, {"T_max": 10, "eta_min": 0.001}),
    ),
    "step": (SGD, StepLR, ({"lr": 0.1}, {"step_size": 4, "gamma": 0.1}), ({"lr": 0.1}, {"step_size": 3, "gamma": 0.1})),
    "milestones": (
        SGD,
        MultiStepLR,
        ({"lr": 0.1}, {"milestones": [2, 8]}),
        ({"lr": 0.1}, {"milestones": [2, 5]}),
    ),
    "warm-up cosine (lightly), longer run": (
        SGD,
        CosineWarmupScheduler,
        ({"lr": 0.1}, {"warmup_epochs": 2, "max_epochs": 8}),
        ({"lr": 0.1}, {"warmup_epochs": 2, "max_epochs": 12}),
    ),
    "weight decay and betas, no schedule": (
        Adam,
        None,
        ({"lr": 0.1, "weight_decay": 0.1, "betas": (0.9, 0.99)}, {}),
        ({"lr": 0.01, "weight_decay": 0.01, "betas": (0.8, 0.9)}, {}),
    ),
}


@pytest.mark.parametrize(("optimizer", "scheduler", "old", "new"), CHANGED.values(), ids=CHANGED.keys())
def test_a_resumed_run_has_the_rates_of_a_run_started_with_its_settings(optimizer, scheduler, old, new):
    saved = build(optimizer, scheduler, *old)
    train(*saved, 5)
    made = build(optimizer, scheduler, *new)
    resumed(made, saved)
    reference = build(optimizer, scheduler, *new)
    train(*reference, 5)
    # closed forms against torch's recursive updates of the same schedule: float64 rounding of a few operations
    assert rates(*made, 6) == pytest.approx(rates(*reference, 6), rel=1e-12)
    for group, expected in zip(made[0].param_groups, reference[0].param_groups):
        settings = {key: value for key, value in expected.items() if key not in ("params", "lr", "initial_lr")}
        assert {key: group[key] for key in settings} == settings


# schedulers whose state holds more than where they are, or that set group settings themselves
UNCHANGED = {
    "warm restarts": (SGD, CosineAnnealingWarmRestarts, ({"lr": 0.1}, {"T_0": 4, "T_mult": 2})),
    "one cycle (cycles momentum)": (
        SGD,
        OneCycleLR,
        ({"lr": 0.1, "momentum": 0.9}, {"max_lr": 0.1, "total_steps": 20}),
    ),
    "plateau (no base_lrs)": (SGD, ReduceLROnPlateau, ({"lr": 0.1}, {"patience": 0, "factor": 0.5})),
    "cosine": (Adam, CosineAnnealingLR, ({"lr": 0.1, "weight_decay": 0.1}, {"T_max": 10})),
    "sequential (states of its schedules)": (SGD, sequential, ({"lr": 0.1}, {"T_max": 10})),
}


@pytest.mark.parametrize(("optimizer", "scheduler", "settings"), UNCHANGED.values(), ids=UNCHANGED.keys())
def test_with_the_checkpoints_settings_nothing_is_touched(optimizer, scheduler, settings, caplog):
    saved = build(optimizer, scheduler, *settings)
    train(*saved, 6)
    made = build(optimizer, scheduler, *settings)
    resumed(made, saved)
    assert made[0].state_dict()["param_groups"] == saved[0].state_dict()["param_groups"]
    assert made[1].state_dict() == saved[1].state_dict()
    assert "resumed with the config's" not in caplog.text


REFUSED = {
    # where the run is in its cycle cannot be carried over to another cycle length
    "warm restarts": (CosineAnnealingWarmRestarts, {"T_0": 4}, {"T_0": 5}, "CosineAnnealingWarmRestarts T_0 4 -> 5"),
    "one cycle, another floor": (
        OneCycleLR,
        {"max_lr": 0.1, "total_steps": 20},
        {"max_lr": 0.1, "total_steps": 20, "final_div_factor": 10},
        "min_lr 4e-07 -> 0.0004",
    ),
    "sequential, another cosine": (sequential, {"T_max": 10}, {"T_max": 20}, "SequentialLR _schedulers"),
}


@pytest.mark.parametrize(("scheduler", "old", "new", "named"), REFUSED.values(), ids=REFUSED.keys())
def test_a_change_to_a_schedule_without_a_closed_form_is_one_line(scheduler, old, new, named):
    saved = build(SGD, scheduler, {"lr": 0.1}, old)
    train(*saved, 6)
    with pytest.raises(ConfigurationError, match=f"resuming cannot carry {named}"):
        resumed(build(SGD, scheduler, {"lr": 0.1}, new), saved)


def test_a_schedule_of_another_class_or_interval_is_one_line():
    """``last_epoch`` counts the checkpoint's scheduler's steps: another class (a warm-up added or left out) or
    another interval (epochs against steps: ``max_epochs -1`` and ``max_steps``) cannot take it over."""
    saved = build(SGD, CosineWarmupScheduler, {"lr": 0.1}, {"warmup_epochs": 2, "max_epochs": 8})
    train(*saved, 4)
    with pytest.raises(ConfigurationError, match=r"stepped its schedule as \[\['CosineWarmupScheduler'"):
        resumed(build(SGD, CosineAnnealingLR, {"lr": 0.1}, {"T_max": 8}), saved)
    saved = build(SGD, CosineAnnealingLR, {"lr": 0.1}, {"T_max": 8})
    train(*saved, 4)
    with pytest.raises(ConfigurationError, match="'epoch', '1'.* this config as .*'step', '1'"):
        resumed(build(SGD, CosineAnnealingLR, {"lr": 0.1}, {"T_max": 8}), saved, interval="step")
