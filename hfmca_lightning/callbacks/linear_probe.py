"""Online linear probe: a linear classifier trained beside the run on detached backbone features."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.nn import functional as F

from hfmca_lightning.callbacks.gather import evaluation_split, gather_in_dataset_order, split_length
from hfmca_lightning.callbacks.step_outputs import evaluation_rows, step_embeddings, unknown_embedding_key
from hfmca_lightning.data.batch_formats import BatchFormat, first_views
from hfmca_lightning.data.datamodule import QUERIES
from hfmca_lightning.data.sources import UNLABELLED
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning, check_at_least
from hfmca_lightning.evaluation.batch_norm import evaluation_mode
from hfmca_lightning.evaluation.linear import topk_accuracies

__all__ = ["LinearProbe"]


def _labelled_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over the rows whose target is a class (0 when there are none); unlabelled rows
    (``UNLABELLED``) are masked, not removed, so nothing here reads a device value on the host (selecting the
    labelled rows would wait for a GPU's queue every step)."""
    summed = F.cross_entropy(logits, targets, ignore_index=UNLABELLED, reduction="sum")
    return summed / (targets != UNLABELLED).sum().clamp(min=1)


class LinearProbe(Callback):
    """Online linear evaluation (lightly's ``OnlineLinearClassifier`` on BN-standardised features), logged as
    ``linear/train_loss``, ``linear/top1`` and ``linear/top5``.

    After every training step the module's features ``(B, D)`` of the first view of each group are taken from the
    step's own output where the module returns its backbone features (``HFMCAModule``: ``outputs["features"]``;
    stable-pretraining: ``outputs["embedding"]``; :mod:`~hfmca_lightning.callbacks.step_outputs`), detached, as
    the costs saw them (train-mode BatchNorm, the run's precision; no pass of their own), else computed
    **without gradients and in eval mode** in the run's precision. The two give different training features (and
    ``linear/train_loss``); validation scores eval-mode features either way. The backbone's gradients, BatchNorm
    statistics and random streams are exactly those of a run without the probe. The features are standardised by a
    ``BatchNorm1d`` without affine parameters and fed to the classifier, which takes one step of its own SGD
    optimiser on the cross-entropy of the labelled images. Unlabelled images (target ``UNLABELLED``, e.g. STL-10's
    unlabelled split) count in the BatchNorm statistics, not in the loss; a batch
    without labelled images takes a step with zero gradients (the momentum carries on), as every process does under
    DDP. No device value is read on the host. Under DDP its gradients and BN statistics are averaged over the
    processes, so every process holds the same probe. During validation it scores the features of the ``QUERIES``
    loader (test split) that the module's ``validation_step`` returns (the same outputs :class:`KNNEvaluation`
    uses), gathered over processes in dataset order. Probe weights and optimiser state live in the checkpoint (exact
    resume).

    Works with every module of the package (``forward`` returns backbone features). Costs no backbone pass with
    ``HFMCAModule`` and one of ``B`` images per step (``1 / L`` of the views) with the others.

    Args:
        feature_dim: ``D``, the module's feature dimension; default: the backbone's ``feature_dim``.
        num_classes: default: the DataModule's ``num_classes``.
        lr: learning rate of the probe's SGD.
        momentum: momentum of the probe's SGD.
        weight_decay: weight decay of the probe's SGD.
        topk: accuracies to log (each capped at ``num_classes``).
        embedding_key: the output key of the embeddings (default: ``features``, else ``embedding``;
            :mod:`~hfmca_lightning.callbacks.step_outputs`).
        label_key: the output key of the evaluation labels (default: ``targets``, else ``label``).
        views_first: whether a training step's 2-D embeddings are the views concatenated view after view (default:
            for ``embedding`` only).

    Raises:
        ConfigurationError: when ``feature_dim`` or ``num_classes`` is below 1, ``lr`` is not positive or ``momentum``
            not in [0, 1); at setup, when they do not fit the data or cannot be told from it and the backbone; at the
            first features (the sanity check's or training's), when they are not ``feature_dim`` long.

    Example::

        model = HFMCAModule(SmallConvNet(), external_head=GridExternalHead(128, grid_height=2, grid_width=2))
        data = MultiViewDataModule(SyntheticShapes(), views=SimCLRViews(count=4))
        trainer = Trainer(max_epochs=10, callbacks=[LinearProbe(lr=0.1, topk=(1, 5))])
        trainer.fit(model, datamodule=data)  # logs linear/train_loss, linear/top1 and linear/top5
    """

    def __init__(
        self,
        feature_dim: int | None = None,
        num_classes: int | None = None,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        topk: tuple[int, ...] = (1, 5),
        embedding_key: str | None = None,
        label_key: str | None = None,
        views_first: bool | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("feature_dim", feature_dim), ("num_classes", num_classes)):
            if value is not None:
                check_at_least(value, 1, name, "LinearProbe")
        if not 0 < lr < math.inf:  # NaN too
            raise ConfigurationError(f"LinearProbe needs a finite lr > 0; got {lr}", parameter="lr")
        if not 0 <= momentum < 1:  # from 1 on, SGD's steps grow without bound
            raise ConfigurationError(f"LinearProbe needs 0 <= momentum < 1; got {momentum}", parameter="momentum")
        if not 0 <= weight_decay < math.inf:
            raise ConfigurationError(
                f"LinearProbe needs a finite weight_decay >= 0; got {weight_decay}", parameter="weight_decay"
            )
        if not topk:
            raise ConfigurationError("LinearProbe needs at least one topk accuracy; got none", parameter="topk")
        for k in topk:
            check_at_least(k, 1, "topk", "LinearProbe")
        self.feature_dim, self.num_classes, self.topk = feature_dim, num_classes, tuple(topk)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.embedding_key, self.label_key, self.views_first = embedding_key, label_key, views_first
        self.standardise: nn.BatchNorm1d | None = None
        self.classifier: Any = None  # lightly's OnlineLinearClassifier, built in setup
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending_state: dict[str, Any] | None = None
        self._warned = False
        self._logits: list[Tensor] = []
        self._targets: list[Tensor] = []

    def _parameters(self) -> list[nn.Parameter]:
        return list(self.classifier.classification_head.parameters())

    def _built(self) -> tuple[nn.BatchNorm1d, torch.optim.Optimizer]:
        """``standardise`` and ``optimizer``, which setup builds with the classifier."""
        if self.standardise is None or self.optimizer is None:
            raise RuntimeError("LinearProbe is not set up: its setup builds the probe")
        return self.standardise, self.optimizer

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        data_classes = getattr(getattr(trainer, "datamodule", None), "num_classes", None)
        if self.num_classes is not None and data_classes is not None and data_classes != self.num_classes:
            raise ConfigurationError(
                f"LinearProbe has num_classes={self.num_classes} but the data has {data_classes} classes; "
                f"set its num_classes to {data_classes} or leave it out",
                parameter="num_classes",
            )
        if self.num_classes is None and data_classes == 0:  # a source without labels: nothing to probe
            if not self._warned:
                rank_zero_warn(
                    "LinearProbe: the data has no labels (a source without classes and no labelled evaluation data); "
                    "the probe is skipped",
                    category=HFMCAWarning,
                )
                self._warned = True
            return
        self.num_classes = self.num_classes or data_classes
        self.feature_dim = self.feature_dim or getattr(getattr(pl_module, "backbone", None), "feature_dim", None)
        if self.num_classes is None or self.feature_dim is None:
            raise ConfigurationError(
                "LinearProbe cannot tell the number of classes or the feature dimension from the data and backbone; "
                "set its num_classes and feature_dim"
            )
        if self.classifier is None:
            from lightly.utils.benchmarking import OnlineLinearClassifier

            # Built without drawing from the global random streams (a run with the probe trains like one without).
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self.standardise = nn.BatchNorm1d(self.feature_dim, affine=False)
                self.classifier = OnlineLinearClassifier(
                    self.feature_dim, self.num_classes, topk=tuple(min(k, self.num_classes) for k in self.topk)
                )
            self.optimizer = torch.optim.SGD(
                self._parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
            )
        standardise, _ = self._built()
        standardise.to(pl_module.device)
        self.classifier.to(pl_module.device)
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.classifier is None:  # no labels (setup)
            return
        standardise, optimizer = self._built()
        batch_format: BatchFormat = getattr(getattr(trainer, "datamodule", None), "batch_format", "stacked")
        images, targets = first_views(batch, batch_format)
        distributed = trainer.world_size > 1
        if images.shape[0] < 2 and not distributed:
            return  # BN needs two rows
        optimizer.zero_grad(set_to_none=False)
        loss = None
        if images.shape[0] >= 2:
            embeddings = step_embeddings(outputs, self.embedding_key, images.shape[0], self.views_first)
            if embeddings is None and self.embedding_key is not None:
                raise unknown_embedding_key("LinearProbe", self.embedding_key, outputs, "use the module's forward")
            features = None if embeddings is None else embeddings[:, 0]
            if features is None and not is_overridden("forward", pl_module, LightningModule):
                self._skip_without_features(pl_module)
                return
            if features is None:  # in the run's precision (bf16-mixed: under its autocast, as the training step)
                with torch.no_grad(), evaluation_mode(pl_module), trainer.precision_plugin.forward_context():
                    features = pl_module(images)
            self._check_feature_dim(features)
            standardise.train()
            self.classifier.train()
            with torch.enable_grad():
                loss = _labelled_cross_entropy(self.classifier(standardise(features.float())), targets)
                loss.backward()
        if distributed:  # every process takes part, also one without labelled rows (zero gradients)
            for parameter in self._parameters():
                grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
                parameter.grad = trainer.strategy.reduce(grad, reduce_op="mean")
            for buffer in (standardise.running_mean, standardise.running_var):
                assert buffer is not None  # BatchNorm1d tracks running statistics by default
                buffer.copy_(trainer.strategy.reduce(buffer.clone(), reduce_op="mean"))
        optimizer.step()
        if loss is not None:
            pl_module.log("linear/train_loss", loss.detach())

    def _check_feature_dim(self, features: Tensor) -> None:
        """One line, in training or at the sanity check, for features of another size than ``feature_dim``."""
        if features.shape[-1] != self.feature_dim:
            raise ConfigurationError(
                f"LinearProbe has feature_dim={self.feature_dim} but the module's features have {features.shape[-1]}; "
                "set feature_dim to that, or leave it out (default: the backbone's)",
                parameter="feature_dim",
            )

    def _skip_without_features(self, pl_module: LightningModule) -> None:
        """A module whose training step returns no features and that has no ``forward`` gives the probe nothing to
        read: said once, and the probe trains and evaluates nothing (every process alike)."""
        rank_zero_warn(
            f"LinearProbe: {type(pl_module).__name__}'s training_step returns no features and it has no forward "
            "(images -> features), so the online probe is skipped. Return {'loss': ..., 'features': ...} from "
            "training_step, or define forward, to get it.",
            category=HFMCAWarning,
        )
        self.classifier = None

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logits.clear()
        self._targets.clear()

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.classifier is None or evaluation_split(trainer, dataloader_idx) != QUERIES:
            return
        embeddings, labels = evaluation_rows(outputs, self.embedding_key, self.label_key, "LinearProbe", pl_module)
        self._check_feature_dim(embeddings)
        standardise, _ = self._built()
        standardise.eval()
        with torch.no_grad():
            self._logits.append(self.classifier(standardise(embeddings.float())))
        self._targets.append(labels)

    on_test_batch_end = on_validation_batch_end

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._logits:
            return
        assert self.num_classes is not None  # set in setup before the classifier that gave the logits
        length = split_length(trainer, QUERIES)
        logits = gather_in_dataset_order(pl_module, self._logits, length)
        targets = gather_in_dataset_order(pl_module, self._targets, length)
        prefix = "linear/test_top" if trainer.testing else "linear/top"
        for k, accuracy in topk_accuracies(logits, targets, self.num_classes, self.topk).items():
            pl_module.log(f"{prefix}{k}", accuracy, prog_bar=k == 1 and not trainer.testing, sync_dist=True)

    on_test_epoch_end = on_validation_epoch_end

    def state_dict(self) -> dict[str, Any]:
        if self.classifier is None:
            return dict(self._pending_state or {})
        standardise, optimizer = self._built()
        return {
            "standardise": standardise.state_dict(),
            "classifier": self.classifier.state_dict(),
            "optimizer": optimizer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.classifier is None:  # not set up yet: applied in setup
            self._pending_state = state_dict
            return
        self._pending_state = None
        standardise, optimizer = self._built()
        self._check_saved_shapes(state_dict)
        standardise.load_state_dict(state_dict["standardise"])
        self.classifier.load_state_dict(state_dict["classifier"])
        optimizer.load_state_dict(state_dict["optimizer"])

    def _check_saved_shapes(self, state_dict: dict[str, Any]) -> None:
        """One line when the checkpoint's probe has another shape than this run's (another number of classes, or
        another feature size): its weights cannot continue here."""
        weight = self.classifier.classification_head.weight  # (num_classes, feature_dim)
        saved = state_dict["classifier"].get("classification_head.weight")
        if saved is None or tuple(saved.shape) == tuple(weight.shape):
            return
        raise ConfigurationError(
            f"LinearProbe: the checkpoint's probe classifies {saved.shape[0]} classes from {saved.shape[1]}-d "
            f"features, this run's {weight.shape[0]} classes from {weight.shape[1]}-d features (the data or the "
            "backbone changed since the checkpoint): resume with the checkpoint's data and backbone, or start a new "
            "run without --ckpt_path"
        )
