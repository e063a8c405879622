"""Online kNN evaluation during validation (docs/conventions.md §6)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DistributedSampler

from hfmca_lightning.callbacks.gather import evaluation_split, gather_in_dataset_order, queries_only, split_length
from hfmca_lightning.callbacks.step_outputs import evaluation_rows
from hfmca_lightning.data.datamodule import BANK, QUERIES
from hfmca_lightning.errors import ConfigurationError, check_at_least
from hfmca_lightning.evaluation.knn import knn_predict

__all__ = ["KNNEvaluation"]


def _dropped(*args: Any, **kwargs: Any) -> None:
    """Logs nothing."""


@contextmanager
def _without_logging(module: LightningModule) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside."""
    module.log = module.log_dict = _dropped  # type: ignore[method-assign]  # restored below
    try:
        yield
    finally:
        del module.log, module.log_dict


class KNNEvaluation(Callback):
    """kNN top-1 of the backbone features, logged as ``knn/top1`` (this epoch) and ``knn/top1_max``.

    Consumes the validation (and test) loop: dataloader ``BANK`` (train split, no augmentation) and ``QUERIES`` (test
    split) of :class:`~hfmca_lightning.data.MultiViewDataModule`; the module's ``validation_step`` / ``test_step``
    returns the embeddings and labels, ``{"features", "targets"}`` or stable-pretraining's ``{"embedding",
    "label"}`` (:mod:`~hfmca_lightning.callbacks.step_outputs`). With the data's ``evaluation_loaders="queries"`` (a
    ``validation_step`` without a loader index) the loop sees the queries only, and at the end of it this callback
    runs the module's ``validation_step`` (``test_step``) on the bank's batches itself, as the loop would: sharded as
    Lightning shards the loop's, in its precision, up to its batch limit; the step's own ``self.log`` calls are
    dropped there. Lightning runs these loops in eval mode, so BN uses running statistics during the bank
    pass. Skipped during the sanity check (it sees only a few batches of the bank).

    Args:
        k: neighbours (paper / lightly protocol: 200).
        temperature: softmax temperature (0.1).
        embedding_key: the output key of the embeddings (default: ``features``, else ``embedding``).
        label_key: the output key of the labels (default: ``targets``, else ``label``).

    Raises:
        ConfigurationError: when ``k`` is below 1 or ``temperature`` is not positive.

    Example::

        model = HFMCAModule(SmallConvNet(), external_head=GridExternalHead(128, grid_height=2, grid_width=2))
        data = MultiViewDataModule(SyntheticShapes(), views=SimCLRViews(count=4))
        trainer = Trainer(max_epochs=10, callbacks=[KNNEvaluation(k=200, temperature=0.1)])
        trainer.fit(model, datamodule=data)  # logs knn/top1 and knn/top1_max after every epoch
    """

    def __init__(
        self, k: int = 200, temperature: float = 0.1, embedding_key: str | None = None, label_key: str | None = None
    ) -> None:
        super().__init__()
        check_at_least(k, 1, "k", "KNNEvaluation")
        if not 0 < temperature < math.inf:  # NaN too; inf would make the weighted vote an unweighted one
            raise ConfigurationError(
                f"KNNEvaluation needs a finite temperature > 0; got {temperature}", parameter="temperature"
            )
        self.k = k
        self.temperature = temperature
        self.embedding_key, self.label_key = embedding_key, label_key
        self.best = 0.0
        self._features: dict[int, list[torch.Tensor]] = {BANK: [], QUERIES: []}
        self._targets: dict[int, list[torch.Tensor]] = {BANK: [], QUERIES: []}

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for store in (self._features, self._targets):
            store[BANK].clear()
            store[QUERIES].clear()

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
        split = evaluation_split(trainer, dataloader_idx)
        if split not in (BANK, QUERIES):
            return
        self._add(split, outputs, pl_module)

    on_test_batch_end = on_validation_batch_end

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._features[QUERIES]:
            return
        if queries_only(trainer):
            bank_length = self._draw_bank(trainer, pl_module)
        elif self._features[BANK]:
            bank_length = split_length(trainer, BANK)
        else:
            return
        bank, bank_targets = (
            gather_in_dataset_order(pl_module, store[BANK], bank_length) for store in (self._features, self._targets)
        )
        queries, query_targets = (
            gather_in_dataset_order(pl_module, store[QUERIES], split_length(trainer, QUERIES))
            for store in (self._features, self._targets)
        )
        num_classes = getattr(getattr(trainer, "datamodule", None), "num_classes", None)
        if num_classes is None:
            num_classes = int(bank_targets.max()) + 1
        predicted = knn_predict(queries, bank, bank_targets, num_classes, k=self.k, temperature=self.temperature)
        accuracy = (predicted == query_targets).float().mean().item()
        # Every rank computed the same value from the gathered features; sync_dist (a mean of equal values)
        # keeps Lightning's epoch-level logging consistent across ranks.
        if trainer.testing:
            pl_module.log("knn/test_top1", accuracy, sync_dist=True)
            return
        self.best = max(self.best, accuracy)
        pl_module.log("knn/top1", accuracy, prog_bar=True, sync_dist=True)
        pl_module.log("knn/top1_max", self.best, sync_dist=True)

    on_test_epoch_end = on_validation_epoch_end

    def _draw_bank(self, trainer: Trainer, pl_module: LightningModule) -> int:
        """The bank's rows: the module's evaluation step (``test_step`` in the test loop) on the training split's
        un-augmented batches, run as Lightning's loop runs it (the input converted for the precision, the batch
        transfer hooks, the strategy's step with its precision context and DDP's forward), this process's share, up
        to the loop's batch limit; what the step logs is dropped (it would land in the loop's epoch metrics).
        Returns the bank's length."""
        data = getattr(trainer, "datamodule", None)  # set by Lightning at run time (not in Trainer's type)
        assert data is not None  # queries_only(trainer) read its evaluation_loaders
        length = len(data.evaluation_splits[BANK])
        world = trainer.world_size
        sampler: DistributedSampler[int] | None = (
            DistributedSampler(
                range(length),  # type: ignore[arg-type]  # it reads only the length of its dataset
                num_replicas=world,
                rank=trainer.global_rank,
                shuffle=False,
            )
            if world > 1
            else None
        )
        loader = data.evaluation_loader(BANK, sampler=sampler, persistent_workers=False)
        limit = trainer.limit_test_batches if trainer.testing else trainer.limit_val_batches
        batches = len(loader)  # Lightning's limits: a number of batches, or a fraction of them
        if isinstance(limit, int):
            batches = min(limit, batches)
        elif limit is not None:
            batches = int(batches * limit)
        step = trainer.strategy.test_step if trainer.testing else trainer.strategy.validation_step
        before = data if is_overridden("on_before_batch_transfer", data, LightningDataModule) else pl_module
        with _without_logging(pl_module):
            for batch_idx, batch in zip(range(batches), loader):
                batch = before.on_before_batch_transfer(trainer.precision_plugin.convert_input(batch), 0)
                self._add(BANK, step(trainer.strategy.batch_to_device(batch), batch_idx), pl_module)
        return length

    def _add(self, split: int, outputs: Any, pl_module: LightningModule) -> None:
        embeddings, labels = evaluation_rows(outputs, self.embedding_key, self.label_key, "KNNEvaluation", pl_module)
        self._features[split].append(embeddings)
        self._targets[split].append(labels)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = float(state_dict["best"])
