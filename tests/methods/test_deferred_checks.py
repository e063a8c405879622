"""A failed step is skipped on the device and reported one step later, with no host read in any step."""

from __future__ import annotations

import copy
import re
from functools import partial

import pytest
import torch
from lightly.utils.lars import LARS
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from hfmca_lightning.cli import main
from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.diagnostics import HostReads
from hfmca_lightning.losses.cost_checks import CHECK_COLUMNS, CostChecks, CostFactorisationError
from hfmca_lightning.methods.deferred_checks import DeferredChecks, NonFiniteStepError, SkipUpdateIfFailed
from tests.helpers import (
    DEMO,
    DEMO_TINY_MODEL,
    PoisonBatchAt,
    PoisonGradientAt,
    bn_free_module,
    quiet_trainer,
    tiny_overrides,
)

OPTIMIZERS = {
    "fused SGD": partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-3, fused=True),
    "SGD": partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "fused Adam": partial(torch.optim.Adam, lr=0.01, fused=True),
    "Adam": partial(torch.optim.Adam, lr=0.01),
    "LARS": partial(LARS, lr=0.1, momentum=0.9),
}


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, guard: SkipUpdateIfFailed, failed: bool | None) -> None:
    optimizer.zero_grad()
    model(torch.ones(3, 4)).square().sum().backward()
    if failed is not None:
        guard.arm(optimizer, torch.tensor(failed))
    optimizer.step()
    guard.finish()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        value.clone()
        for parameter in model.parameters()
        for value in optimizer.state[parameter].values()
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0
    ]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_failed_step_leaves_weights_and_optimizer_state_as_they_were(name):
    """After a good step (so the optimizer has state), a guarded step with the flag set changes no parameter and no
    state tensor; one with the flag clear updates exactly as an unguarded step does."""
    results = {}
    for failed in (None, True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
        optimizer = OPTIMIZERS[name](model.parameters())
        guard = SkipUpdateIfFailed()
        _step(model, optimizer, guard, None)
        before = _state(model, optimizer)
        _step(model, optimizer, guard, failed)
        results[failed] = (before, _state(model, optimizer))
        assert not hasattr(optimizer, "found_inf")
    before, after_failed = results[True]
    assert all(torch.equal(a, b) for a, b in zip(before, after_failed))
    assert all(torch.equal(a, b) for a, b in zip(results[None][1], results[False][1]))
    assert not all(torch.equal(a, b) for a, b in zip(before, results[None][1]))
    assert SkipUpdateIfFailed.skips_in_kernel(OPTIMIZERS[name]([nn.Parameter(torch.ones(1))])) == name.startswith(
        "fused"
    )


def test_a_guarded_step_with_nan_gradients_keeps_finite_weights():
    """NaN gradients (what NaN statistics give) and a failed flag: the weights stay those of the last good step."""
    for name in ("fused SGD", "SGD"):
        model = nn.Linear(4, 2)
        optimizer = OPTIMIZERS[name](model.parameters())
        guard = SkipUpdateIfFailed()
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.full((3, 4), float("nan"))).sum().backward()
        guard.arm(optimizer, torch.tensor(True))
        optimizer.step()
        guard.finish()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _checks(failed_column: int | None) -> CostChecks:
    state = torch.zeros(1, len(CHECK_COLUMNS), dtype=torch.int64)
    if failed_column is not None:
        state[0, failed_column] = 3
    return CostChecks(state, ("external",), ((4, 4),), (0.1,), torch.zeros((), dtype=torch.int64))


def test_deferred_checks_report_the_first_failed_step_at_every_read_and_forget_what_they_read():
    deferred = DeferredChecks()
    for step, column in enumerate((None, 0, 1, None)):
        checks = _checks(column)
        deferred.push(checks, checks.packed(), step, epoch=0)
    with HostReads() as recorder:
        failure = deferred.first_failure()
    assert recorder.reads == []  # the values are host buffers: nothing waits for a device
    assert failure is not None and failure.step == 1 and "low-level matrix A" in str(failure.error)
    assert len(deferred) == 0 and deferred.first_failure() is failure  # a failed run stays failed
    checks = _checks(None)
    deferred.push(checks, checks.packed(), 4, epoch=0)
    assert deferred.first_failure() is failure and len(deferred) == 0
    good = DeferredChecks()
    good.push(checks, checks.packed(), 0, epoch=0)
    assert good.first_failure() is None and good.first_failure() is None


@pytest.mark.parametrize("fused", [True, False], ids=["fused SGD", "SGD"])
def test_a_failed_step_is_skipped_and_stops_the_run_one_step_later(fused):
    """Step 3's images are NaN: its update is skipped on the device (the weights after it are those after step 2),
    step 4 is queued, and its optimizer step raises the one-line error naming step 3."""
    module = bn_free_module(internal=True)
    module.optimizer_factory = partial(torch.optim.SGD, lr=0.5, fused=fused)
    source = SyntheticShapes(num_classes=3, train_per_class=16, test_per_class=2, image_size=16)
    data = MultiViewDataModule(source, views=SimCLRViews(count=4), batch_size=4, num_workers=0)
    poison = PoisonBatchAt(step=3)
    trainer = quiet_trainer(max_steps=8, limit_val_batches=0, callbacks=[poison], accelerator="cpu")
    with pytest.raises(
        CostFactorisationError,
        match=r"^training stopped at step 3, in epoch 1 \(epoch=0 in checkpoint names\): HFMCA cost",
    ) as error:
        trainer.fit(module, data)
    assert "NaN or Inf" in str(error.value)
    assert poison.steps_started == [0, 1, 2, 3, 4]
    after_step_2, after_step_3 = poison.weights[2], poison.weights[3]
    assert all(torch.equal(a, b) for a, b in zip(after_step_2, after_step_3))
    assert all(bool(torch.isfinite(weight).all()) for weight in after_step_3)
    assert not all(torch.equal(a, b) for a, b in zip(poison.weights[1], after_step_2))  # good steps do update


def test_a_nan_gradient_of_a_finite_cost_is_skipped_and_every_checkpoint_on_disk_stays_finite(tmp_path):
    """Step 3's costs are finite but one gradient is NaN: its update is skipped, the run stops in one line naming
    step 3, and the checkpoints written every step (``save_top_k=1`` rotates them) hold only finite weights, the last
    one of step 3, before the failed update."""
    module = bn_free_module(internal=True)
    source = SyntheticShapes(num_classes=3, train_per_class=16, test_per_class=2, image_size=16)
    data = MultiViewDataModule(source, views=SimCLRViews(count=4), batch_size=4, num_workers=0)
    every_step = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1, save_top_k=1)
    trainer = quiet_trainer(
        max_steps=8,
        limit_val_batches=0,
        callbacks=[PoisonGradientAt(step=3), every_step],
        accelerator="cpu",
        enable_checkpointing=True,
    )
    with pytest.raises(
        NonFiniteStepError,
        match=r"^training stopped at step 3, in epoch 1 \(epoch=0 in checkpoint names\): the gradients are not",
    ):
        trainer.fit(module, data)
    files = sorted(tmp_path.glob("*.ckpt"))
    for path in files:
        weights = torch.load(path, map_location="cpu", weights_only=True)["state_dict"].values()
        assert all(bool(torch.isfinite(weight).all()) for weight in weights if weight.is_floating_point()), path.name
    last = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 3 and max(torch.load(p, weights_only=True)["global_step"] for p in files) == 3


def test_a_save_on_exception_after_a_failed_step_writes_nothing(tmp_path, capsys):
    """Lightning's ``ModelCheckpoint(save_on_exception=True)`` saves when the run raises: after a failed step (a
    diverging learning rate; its forward pass leaves non-finite BatchNorm statistics) that save is refused too, and
    every checkpoint on disk is the finite state of a step before the failure."""
    checkpoints = tmp_path / "checkpoints"
    every_step = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "dirpath": str(checkpoints), "save_last": True, "save_on_exception": True, "every_n_train_steps": 1
        },
    }  # fmt: skip
    model = copy.deepcopy(DEMO_TINY_MODEL)
    model["init_args"]["optimizer"] = {"class_path": "torch.optim.SGD", "init_args": {"lr": 1e38}}
    overrides = tiny_overrides(tmp_path, model=model, **{"trainer.callbacks": [every_step]})
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(DEMO), "--config", str(overrides)])
    assert stopped.value.code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hfmca: error: ")]
    failed = re.search(r"training stopped at step (\d+)", errors[0]) if len(errors) == 1 else None
    assert failed is not None, errors
    files = sorted(checkpoints.glob("*.ckpt"))
    assert files
    for path in files:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        assert saved["global_step"] <= int(failed.group(1)), path.name
        assert all(torch.isfinite(value).all() for value in saved["state_dict"].values() if value.is_floating_point())


def test_loading_a_checkpoint_clears_a_failure_of_the_module_object():
    """A failure stays until the module's state is replaced: after ``on_load_checkpoint`` (a notebook fitting the same
    object again from a good checkpoint) the old failure no longer stops it."""
    module = bn_free_module()
    checks = _checks(0)
    module._deferred_checks.push(checks, checks.packed(), 3, epoch=0)
    for _ in range(2):
        with pytest.raises(CostFactorisationError, match="training stopped at step 3"):
            module.raise_if_a_step_failed()
    module.on_load_checkpoint({"state_dict": module.state_dict()})
    module.raise_if_a_step_failed()
