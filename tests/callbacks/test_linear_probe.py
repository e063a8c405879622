"""LinearProbe (its learning on SyntheticShapes: tests/methods/test_hfmca_learning.py): leaves the trained module
exactly as a run without it, resumes."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from hfmca_lightning.callbacks import LinearProbe, RunState
from hfmca_lightning.callbacks.step_outputs import step_embeddings
from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.data.batch_formats import first_views
from hfmca_lightning.data.sources import UNLABELLED
from hfmca_lightning.diagnostics import HostReads
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.methods.baselines import SimCLR
from hfmca_lightning.models import GridExternalHead, SmallConvNet
from tests.helpers import fit, quiet_trainer

NUM_CLASSES = 4


def _data() -> MultiViewDataModule:
    source = SyntheticShapes(num_classes=NUM_CLASSES, train_per_class=24, test_per_class=10, image_size=16)
    return MultiViewDataModule(
        source,
        views=SimCLRViews(count=2, crop_strength=0.3, color_strength=0.2),
        batch_size=16,
        eval_batch_size=32,
        num_workers=0,
    )


def _fit(callbacks: list, epochs: int, ckpt_path: Path | None = None) -> tuple[SimCLR, Trainer]:
    seed_everything(0)
    module = SimCLR(SmallConvNet(width=8, num_stages=2), hidden_dim=32, output_dim=16)
    trainer = quiet_trainer(
        max_epochs=epochs,
        callbacks=[*callbacks, RunState()],
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        accelerator="cpu",
        deterministic=True,
    )
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return module, trainer


def test_module_trains_exactly_as_without_the_probe():
    """No gradient, BatchNorm statistic or random draw of the run changes: weights and buffers are identical."""
    with_probe, _ = _fit([LinearProbe()], epochs=1)
    without, _ = _fit([], epochs=1)
    for (name, value), (_, reference) in zip(with_probe.state_dict().items(), without.state_dict().items()):
        torch.testing.assert_close(value, reference, rtol=0, atol=0, msg=name)


def test_resumed_probe_equals_an_uninterrupted_one(tmp_path):
    straight = LinearProbe()
    every_epoch = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)
    straight_module, _ = _fit([straight, every_epoch], epochs=2)
    resumed = LinearProbe()
    resumed_module, _ = _fit([resumed], epochs=2, ckpt_path=next(tmp_path.glob("epoch=0-*.ckpt")))
    for key, value in straight_module.state_dict().items():
        torch.testing.assert_close(resumed_module.state_dict()[key], value, rtol=0, atol=0, msg=key)
    for part in ("standardise", "classifier"):
        for key, value in straight.state_dict()[part].items():
            torch.testing.assert_close(resumed.state_dict()[part][key], value, rtol=0, atol=0, msg=key)
    assert resumed.optimizer.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0


def test_resuming_a_probe_of_another_shape_is_one_line(tmp_path, capsys):
    """``hfmca fit --ckpt_path last`` with a data set of 5 classes where the checkpoint's probe classifies 4: one line
    naming both shapes and the fix, before training (not load_state_dict's size-mismatch traceback)."""
    probe = {"class_path": "hfmca_lightning.callbacks.LinearProbe"}
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}
    checkpoint["init_args"] = {"dirpath": str(tmp_path / "checkpoints"), "save_last": True}
    callbacks = {"trainer.callbacks": [probe, checkpoint]}
    fit(tmp_path, **callbacks)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "last", **callbacks,
            **{"data.init_args.source.init_args.num_classes": 5})  # fmt: skip
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("hfmca: error: LinearProbe: the checkpoint's probe classifies 4 classes from 16-d features, "
                           "this run's 5 classes from 16-d features"), line  # fmt: skip
    assert "resume with the checkpoint's data and backbone, or start a new run" in line
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4  # not trained on


def test_a_feature_dim_other_than_the_features_is_one_line_at_the_sanity_check():
    """A ``feature_dim`` other than the features' (the projector's output size instead of the backbone's): one line
    at the sanity check's first features, before any training step; before, BatchNorm's traceback from torch."""
    seed_everything(0)
    module = SimCLR(SmallConvNet(width=8, num_stages=2), hidden_dim=32, output_dim=16)
    probe = LinearProbe(feature_dim=64)
    trainer = quiet_trainer(max_epochs=1, callbacks=[probe], num_sanity_val_steps=1, accelerator="cpu")
    with pytest.raises(ConfigurationError, match="feature_dim=64 but the module's features have 16; set feature_dim"):
        trainer.fit(module, _data())
    assert trainer.global_step == 0


def test_wrong_number_of_classes_is_one_clear_error():
    with pytest.raises(ConfigurationError, match="num_classes=7 but the data has 4 classes"):
        _fit([LinearProbe(num_classes=7)], epochs=1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"momentum": -1.0}, "0 <= momentum < 1; got -1.0"),
        # before: accepted, and SGD's steps grew without bound (train loss 51 against 1.3)
        ({"momentum": 1.5}, "0 <= momentum < 1; got 1.5"),
        ({"weight_decay": -1.0}, "weight_decay >= 0; got -1.0"),
        # before: a run that logged linear/train_loss nan and chance accuracy without a word
        ({"lr": float("nan")}, "a finite lr > 0; got nan"),
        ({"momentum": float("inf")}, "0 <= momentum < 1; got inf"),
        ({"weight_decay": float("nan")}, "a finite weight_decay >= 0; got nan"),
        ({"topk": (0,)}, "topk must be >= 1; got 0"),
        ({"topk": ()}, "at least one topk accuracy"),
        # before: a torchmetrics TypeError at the first validation
        ({"topk": (1.5,)}, "topk must be a whole number >= 1; got 1.5"),
        ({"feature_dim": 2.5}, "feature_dim must be a whole number >= 1; got 2.5"),
    ],
)
def test_a_probe_setting_out_of_range_is_one_line_when_built(settings, message):
    """Before: torch's SGD traceback at setup, or a torchmetrics error after a whole epoch (``topk: [0]``)."""
    with pytest.raises(ConfigurationError, match=message):
        LinearProbe(**settings)


@pytest.mark.filterwarnings("ignore:UnlabelledFolderSource has no labelled evaluation split")
def test_a_probe_on_data_without_labels_is_skipped_with_a_warning(tmp_path):
    """A source without classes (an unlabelled image folder, no labelled evaluation data) has 0 classes: the probe
    says so once and trains nothing, instead of building a classifier of zero classes."""
    from hfmca_lightning.data import UnlabelledFolderSource
    from hfmca_lightning.errors import HFMCAWarning
    from tests.helpers import write_image_folder

    write_image_folder(tmp_path, per_class=8, num_classes=2, size=16)
    data = MultiViewDataModule(
        UnlabelledFolderSource(str(tmp_path / "train"), image_size=16), views=SimCLRViews(count=2), batch_size=8,
        num_workers=0,
    )  # fmt: skip
    probe = LinearProbe()
    module = SimCLR(SmallConvNet(width=8, num_stages=2), hidden_dim=32, output_dim=16)
    with pytest.warns(HFMCAWarning, match="LinearProbe: the data has no labels"):
        quiet_trainer(max_steps=2, limit_val_batches=0, callbacks=[probe], accelerator="cpu").fit(module, data)
    assert probe.classifier is None and probe.state_dict() == {}


def _probe_and_module() -> tuple[LinearProbe, SimCLR, SimpleNamespace]:
    seed_everything(0)
    module = SimCLR(SmallConvNet(width=8, num_stages=2), hidden_dim=32, output_dim=16)
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(num_classes=NUM_CLASSES),
        world_size=1,
        precision_plugin=SimpleNamespace(forward_context=nullcontext),  # 32-true: no autocast
    )
    probe = LinearProbe()
    probe.setup(trainer, module, "fit")  # type: ignore[arg-type]
    return probe, module, trainer


def test_training_step_reads_no_device_value_on_the_host():
    """On a GPU every read of a device value (``int(t)``, ``t.item()``, boolean-mask indexing) waits for the
    queue: the probe's step makes none, also with unlabelled images in the batch."""
    probe, module, trainer = _probe_and_module()
    views = torch.rand(6, 2, 3, 16, 16)
    targets = torch.tensor([0, 1, UNLABELLED, 2, UNLABELLED, 3])
    with HostReads() as recorder:
        probe.on_train_batch_end(trainer, module, None, (views, targets), 0)  # type: ignore[arg-type]
    assert recorder.reads == []
    assert probe.classifier.classification_head.weight.grad.abs().sum() > 0


def test_unlabelled_images_count_in_the_standardisation_not_in_the_loss():
    """Against a plain reference: BatchNorm over all rows, cross-entropy averaged over the labelled rows only."""
    probe, module, trainer = _probe_and_module()
    head = probe.classifier.classification_head
    weight, bias = head.weight.detach().clone().requires_grad_(), head.bias.detach().clone().requires_grad_()
    views = torch.rand(6, 2, 3, 16, 16)
    targets = torch.tensor([0, 1, UNLABELLED, 2, UNLABELLED, 3])
    probe.on_train_batch_end(trainer, module, None, (views, targets), 0)  # type: ignore[arg-type]

    module.eval()
    with torch.no_grad():
        features = module(views[:, 0])
    standardised = (features - features.mean(0)) / torch.sqrt(features.var(0, unbiased=False) + 1e-5)
    labelled = targets != UNLABELLED
    loss = torch.nn.functional.cross_entropy((standardised @ weight.T + bias)[labelled], targets[labelled])
    loss.backward()
    torch.testing.assert_close(head.weight.grad, weight.grad)
    torch.testing.assert_close(head.bias.grad, bias.grad)
    torch.testing.assert_close(probe.standardise.running_mean, 0.1 * features.mean(0))


def test_a_batch_without_labels_gives_zero_gradients():
    probe, module, trainer = _probe_and_module()
    views = torch.rand(4, 2, 3, 16, 16)
    probe.on_train_batch_end(trainer, module, None, (views, torch.full((4,), UNLABELLED)), 0)  # type: ignore[arg-type]
    head = probe.classifier.classification_head
    assert torch.isfinite(head.weight).all() and head.weight.grad.abs().sum() == 0 and head.bias.grad.abs().sum() == 0


@pytest.mark.parametrize("external", [True, False], ids=["external head", "internal costs only"])
@pytest.mark.parametrize("multi_crop", [False, True], ids=["one view size", "multi-crop"])
def test_first_views_of_the_features_hfmca_collects(external, multi_crop):
    """The rows the probe takes from ``HFMCAModule.collect``'s features (what its training step returns) are the
    features of each image's first view, with or without an external head, for one view size and for multi-crop
    groups of two sizes: the backbone in eval mode gives them as a pass over the first views alone does, up to the
    order in which passes of different sizes sum a convolution's float32 products."""
    torch.manual_seed(0)
    module = HFMCAModule(
        torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        ),
        projector=torch.nn.Linear(8, 8) if external else None,
        external_head=GridExternalHead(8, 1, 5, 8, noise_channels=0) if external else None,
        internal_costs=InternalCosts(["0"]),
    ).eval()
    images = torch.rand(4, 5 if not multi_crop else 2, 3, 16, 16)
    batch = [images, torch.rand(4, 3, 3, 8, 8)] if multi_crop else images
    with torch.no_grad():
        features = module.collect(batch).features
        expected = module(first_views((batch, torch.zeros(4)))[0])
    assert features.shape == (4 * 5, 8)
    first = step_embeddings({"features": features}, None, 4)[:, 0]  # what the probe takes
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-6)


def test_features_a_step_returns_are_used_without_a_pass_of_their_own():
    """HFMCAModule's training step returns the backbone features of every view (``(B * L, D)``, each image's views
    together): the probe takes each image's first view from them and runs no backbone pass; the classifier's step is
    that of the same features given by a pass."""
    probe, module, trainer = _probe_and_module()
    views, targets = torch.rand(4, 3, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        module.eval()
        features = module(views.flatten(0, 1))  # what the step returned, (B * L, D)
        module.train()
    reference, _, _ = _probe_and_module()
    module.forward = lambda *args: (_ for _ in ()).throw(AssertionError("the probe ran the backbone"))  # type: ignore
    probe.on_train_batch_end(trainer, module, {"features": features}, (views, targets), 0)  # type: ignore[arg-type]
    module.forward = type(module).forward.__get__(module)  # type: ignore[method-assign]
    reference.on_train_batch_end(trainer, module, None, (views, targets), 0)  # type: ignore[arg-type]
    # the same features in the same order (the eval-mode pass of the first views gives the rows 0, L, 2L, ...), up to
    # the order in which a pass over 12 images and one over 4 sum a convolution's float32 products (~1e-6 of each
    # feature), which the one SGD step of the classifier carries over
    torch.testing.assert_close(
        probe.classifier.classification_head.weight,
        reference.classifier.classification_head.weight,
        rtol=1e-4,
        atol=1e-6,
    )


class _ContrastiveWithoutForward(LightningModule):
    """A user's module as the baselines docs show one: a training step that returns its loss alone, no forward."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = SmallConvNet(width=8, num_stages=2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, _ = batch
        first, second = self.backbone(views[:, 0]), self.backbone(views[:, 1])
        return (first - second).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`")
def test_a_module_without_features_or_forward_trains_with_the_probe_skipped():
    """It trained only without the probe (every shipped config has one): the probe's own pass called the missing
    forward, a traceback after the first step. It now says so once and trains nothing, and the run goes on."""
    from hfmca_lightning.errors import HFMCAWarning

    probe = LinearProbe()
    with pytest.warns(HFMCAWarning, match="_ContrastiveWithoutForward's training_step returns no features and it has"):
        trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[probe], accelerator="cpu")
        trainer.fit(_ContrastiveWithoutForward(), _data())
    assert trainer.global_step == 3 and probe.classifier is None
