"""Online kNN evaluation during validation (docs/conventions.md §6)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from hfmca_lightning.callbacks.gather import gather_in_dataset_order
from hfmca_lightning.data.datamodule import BANK, QUERIES
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation.knn import knn_predict

__all__ = ["KNNEvaluation"]


class KNNEvaluation(Callback):
    """kNN top-1 of the backbone features, logged as ``knn/top1`` (this epoch) and ``knn/top1_max``.

    Consumes the validation (and test) loop: dataloader ``BANK`` (train split, no augmentation) and ``QUERIES`` (test
    split) of :class:`~hfmca_lightning.data.MultiViewDataModule`; the module's ``validation_step`` / ``test_step``
    returns ``{"features", "targets"}``. Lightning runs these loops in eval mode, so BN uses running statistics during
    the bank pass. Skipped during the sanity check (it sees only a few batches of the bank).

    Args:
        k: neighbours (paper / lightly protocol: 200).
        temperature: softmax temperature (0.1).

    Raises:
        ConfigurationError: when ``k`` is below 1 or ``temperature`` is not positive.

    Example::

        model = HFMCAModule(SmallConvNet(), external_head=GridExternalHead(128, grid_height=2, grid_width=2))
        data = MultiViewDataModule(SyntheticShapes(), views=SimCLRViews(count=4))
        trainer = Trainer(max_epochs=10, callbacks=[KNNEvaluation(k=200, temperature=0.1)])
        trainer.fit(model, datamodule=data)  # logs knn/top1 and knn/top1_max after every epoch
    """

    def __init__(self, k: int = 200, temperature: float = 0.1) -> None:
        super().__init__()
        for name, value, valid in (("k", k, k >= 1), ("temperature", temperature, temperature > 0)):
            if not valid:
                raise ConfigurationError(
                    f"KNNEvaluation needs k >= 1 and temperature > 0; got {name}={value}", parameter=name
                )
        self.k = k
        self.temperature = temperature
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
        if dataloader_idx not in (BANK, QUERIES):
            return
        if not isinstance(outputs, dict) or "features" not in outputs or "targets" not in outputs:
            raise TypeError(
                f"KNNEvaluation needs {type(pl_module).__name__}.validation_step to return "
                "{'features': (N, D) tensor, 'targets': (N,) tensor}"
            )
        self._features[dataloader_idx].append(outputs["features"].detach())
        self._targets[dataloader_idx].append(outputs["targets"].detach())

    on_test_batch_end = on_validation_batch_end

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._features[BANK] or not self._features[QUERIES]:
            return
        loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
        bank, bank_targets = (
            gather_in_dataset_order(pl_module, store[BANK], len(loaders[BANK].dataset))
            for store in (self._features, self._targets)
        )
        queries, query_targets = (
            gather_in_dataset_order(pl_module, store[QUERIES], len(loaders[QUERIES].dataset))
            for store in (self._features, self._targets)
        )
        num_classes = getattr(trainer.datamodule, "num_classes", None)
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

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = float(state_dict["best"])
