"""Large-batch optimisation from YAML: lightly's LARS with bias / norm parameters exempt, and the linear
warm-up + cosine schedule, each checked against an independent computation of lightly's formulas."""

from __future__ import annotations

import math

import pytest
import torch
from lightly.utils.lars import LARS
from lightly.utils.scheduler import cosine_warmup_schedule
from lightning.pytorch import Callback, Trainer

from hfmca_lightning.cli.trainer_cli import HFMCACLI
from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.methods import HFMCAModule
from hfmca_lightning.methods.optim import parameter_groups
from hfmca_lightning.models import GridExternalHead, SmallConvNet, ViewProjector
from tests.helpers import DEMO, quiet_trainer, tiny_overrides


def small_module(**kwargs) -> HFMCAModule:
    torch.manual_seed(0)
    return HFMCAModule(
        SmallConvNet(width=4, num_stages=2),
        ViewProjector(8, 6, 8),
        GridExternalHead(6, 2, 2, 8, noise_channels=0),
        **kwargs,
    )


def test_bias_and_norm_parameters_can_be_exempt_from_weight_decay():
    module = small_module()
    weights, exempt = parameter_groups(module, weight_decay_on_bias_and_norm=False)
    assert exempt["weight_decay"] == 0.0
    names = {id(p): n for n, p in module.named_parameters()}
    assert {names[id(p)] for p in exempt["params"]} == {n for n, p in module.named_parameters() if p.ndim <= 1}
    assert all(p.ndim > 1 for p in weights["params"]) and len(weights["params"]) + len(exempt["params"]) == len(
        list(module.parameters())
    )
    assert any(".bias" in names[id(p)] for p in exempt["params"]) and any(
        "1.weight" in names[id(p)] for p in exempt["params"]
    )  # BN weight


def reference_lars_step(
    parameter: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float, eta: float, eps: float = 1e-8
) -> torch.Tensor:
    """One momentum-free LARS step (You et al. 2017, eq. 6, as lightly documents it): parameters with weight
    decay get the trust ratio eta * |w| / (|g| + wd |w|); parameters without weight decay plain SGD."""
    if weight_decay == 0:
        return parameter - lr * grad
    trust = eta * parameter.norm() / (grad.norm() + weight_decay * parameter.norm() + eps)
    return parameter - lr * trust * (grad + weight_decay * parameter)


def test_lars_from_yaml_scales_weights_and_leaves_biases_and_norms_to_sgd(tmp_path):
    optimizer = {
        "class_path": "lightly.utils.lars.LARS",
        "init_args": {"lr": 0.3, "weight_decay": 1e-4, "trust_coefficient": 0.001},
    }
    overrides = tiny_overrides(
        tmp_path, **{"model.init_args.optimizer": optimizer, "model.init_args.weight_decay_on_bias_and_norm": False}
    )
    cli = HFMCACLI(args=["--config", str(DEMO), "--config", str(overrides)], run=False)
    module = cli.model
    module.trainer = Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False
    )  # configure_optimizers reads max_epochs
    built = module.configure_optimizers()["optimizer"]
    assert isinstance(built, LARS) and [group["weight_decay"] for group in built.param_groups] == [1e-4, 0.0]
    torch.manual_seed(1)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        p.grad = grads[n].clone()
    built.step()
    for n, p in module.named_parameters():
        expected = reference_lars_step(before[n], grads[n], 0.3, 1e-4 if before[n].ndim > 1 else 0.0, 0.001)
        # float32: LARS and the reference take the same norms (torch's kernel on the same tensors) and differ in the
        # order of a handful of multiplications: a few u (6e-8) relative; 1e-5 leaves two orders of magnitude
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7, msg=n)


def test_warmup_then_cosine_follows_lightlys_schedule_step_by_step():
    module = small_module(warmup_epochs=1.0, optimizer=lambda params: torch.optim.SGD(params, lr=0.2))
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2, image_size=16),
        views=SimCLRViews(count=4),
        batch_size=4,
        num_workers=0,
    )
    seen = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = quiet_trainer(
        max_epochs=3,
        limit_val_batches=0,
        callbacks=[Record()],
    )
    trainer.fit(module, data)
    steps_per_epoch = 6  # 24 images, batch 4
    total = 3 * steps_per_epoch
    expected = [0.2 * cosine_warmup_schedule(step, total, 1.0, 0.0, steps_per_epoch, 0.0) for step in range(total)]
    assert len(seen) == total
    assert seen == pytest.approx(expected, rel=1e-12, abs=0)  # the same float64 formula: a few roundings
    warmup, decay = seen[:steps_per_epoch], seen[steps_per_epoch - 1 :]
    assert warmup == pytest.approx(
        [0.2 * (step + 1) / steps_per_epoch for step in range(steps_per_epoch)]
    )  # linear, to the base lr
    assert decay == sorted(decay, reverse=True) and decay[-1] < 0.2 * 0.05  # then a cosine towards 0


def test_a_warmup_longer_than_the_run_is_a_configuration_error():
    from hfmca_lightning.errors import ConfigurationError

    module = small_module(warmup_epochs=5.0)
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2, image_size=16),
        views=SimCLRViews(count=4),
        batch_size=4,
        num_workers=0,
    )
    trainer = Trainer(
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0
    )
    with pytest.raises(ConfigurationError, match="warmup_epochs=5.0 is 30 steps, longer than the whole run"):
        trainer.fit(module, data)


@pytest.mark.parametrize(
    ("warmup_epochs", "length"),
    [(0.0, {"max_epochs": -1}), (1.0, {"max_epochs": -1}), (0.0, {"max_time": "00:00:01:00"})],
)
def test_the_default_schedule_refuses_a_run_without_a_known_length_before_training(warmup_epochs, length):
    """max_epochs -1 and no max_steps (or a max_time alone, which Lightning runs as max_epochs -1): one line, not
    torch's "cannot convert float infinity to integer"."""
    from hfmca_lightning.errors import ConfigurationError

    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2, image_size=16),
        views=SimCLRViews(count=4),
        batch_size=4,
        num_workers=0,
    )
    trainer = quiet_trainer(limit_val_batches=0, **length)
    with pytest.raises(
        ConfigurationError, match=r"this run has no known length \(trainer.max_epochs -1 and no trainer.max_steps"
    ):
        trainer.fit(small_module(warmup_epochs=warmup_epochs), data)
    assert trainer.global_step == 0


@pytest.mark.parametrize("warmup_epochs", [-1.0, float("nan"), float("inf")])
def test_a_warmup_out_of_range_is_refused_when_the_module_is_made(warmup_epochs):
    """Before (NaN): fit started, then torch's "cannot convert float NaN to integer" from the scheduler."""
    from hfmca_lightning.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=f"warmup_epochs must be finite and >= 0; got {warmup_epochs}"):
        small_module(warmup_epochs=warmup_epochs)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"warmup_epochs": 0.5, "lr_scheduler": lambda optimizer: torch.optim.lr_scheduler.ConstantLR(optimizer)},
            r"warmup_epochs \(0.5\) warms up the default cosine schedule, but an lr_scheduler is given",
        ),
        (
            {"lr_scheduler": lambda optimizer: torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)},
            "ReduceLROnPlateau steps on a monitored validation metric",
        ),
    ],
    ids=["warm-up beside a scheduler", "ReduceLROnPlateau"],
)
def test_a_schedule_setting_that_would_be_ignored_is_refused(settings, message):
    """``warmup_epochs`` shapes the default schedule only, and ReduceLROnPlateau has no metric to step on: each is
    one line before the first step, not a silent no-op or Lightning's traceback."""
    from hfmca_lightning.errors import ConfigurationError
    from hfmca_lightning.methods.optim import configure_optimizers

    module = small_module()
    with pytest.raises(ConfigurationError, match=message):
        configure_optimizers(module, None, settings.get("lr_scheduler"), settings.get("warmup_epochs", 0.0))


@pytest.mark.parametrize(
    ("warmup_epochs", "length", "interval"),
    [
        (0.0, {"max_epochs": 100, "max_steps": 8}, "step"),  # max_steps ends the run in epoch 2 of 100
        (0.25, {"max_epochs": 100, "max_steps": 8}, "step"),
        (0.0, {"max_epochs": 2, "max_steps": 100}, "epoch"),  # max_epochs ends it: the per-epoch cosine, as before
        (0.0, {"max_epochs": 2}, "epoch"),
    ],
    ids=["max_steps first", "max_steps first, warm-up", "max_epochs first", "max_epochs alone"],
)
def test_the_default_cosine_anneals_to_zero_over_the_run_whichever_limit_ends_it(warmup_epochs, length, interval):
    """Trainer(max_epochs=100, max_steps=8): the cosine ran per epoch over 100 epochs and ended the run at lr 0.0599
    (of 0.06) without the warm-up, and at 0 with it. Now both anneal to 0 over the 8 steps; a run of whole epochs
    keeps its per-epoch schedule (one rate through each epoch)."""
    module = small_module(warmup_epochs=warmup_epochs, optimizer=lambda params: torch.optim.SGD(params, lr=0.2))
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2, image_size=16),
        views=SimCLRViews(count=4),
        batch_size=4,
        num_workers=0,
    )  # 6 steps an epoch
    seen = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

        def on_train_end(self, trainer, pl_module):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])  # after the last step

    trainer = quiet_trainer(limit_val_batches=0, callbacks=[Record()], **length)
    trainer.fit(module, data)
    assert trainer.lr_scheduler_configs[0].interval == interval
    total = trainer.global_step
    assert seen[-1] == pytest.approx(0.0, abs=1e-12)  # annealed to 0 at the end of the run
    if interval == "step" and not warmup_epochs:
        expected = [0.2 * (1 + math.cos(math.pi * step / total)) / 2 for step in range(total + 1)]
        assert total == 8 and seen == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if interval == "epoch":
        assert total == 12 and seen == pytest.approx([0.2] * 6 + [0.1] * 6 + [0.0], abs=1e-12)
