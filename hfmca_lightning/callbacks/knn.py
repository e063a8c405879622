"""Online kNN evaluation during validation (SPEC §6)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from hfmca_lightning.evaluation.knn import knn_predict

__all__ = ["KNNEvaluation"]

BANK, QUERIES = 0, 1


class KNNEvaluation(Callback):
    """kNN top-1 of the backbone features, logged as ``knn/top1`` (this epoch) and ``knn/top1_max``.

    Consumes the validation (and test) loop: dataloader 0 is the bank (train split, no augmentation),
    dataloader 1 the queries (test split); the module's ``validation_step`` / ``test_step`` returns
    ``{"features", "targets"}``. Lightning runs these loops in eval mode, so BN uses running statistics
    during the bank pass. Skipped during the sanity check (it sees only a few batches of the bank).

    Args:
        k: neighbours (SPEC: 200). temperature: softmax temperature (SPEC: 0.1).
    """

    def __init__(self, k: int = 200, temperature: float = 0.1) -> None:
        super().__init__()
        if k < 1 or temperature <= 0:
            raise ValueError(f"KNNEvaluation needs k >= 1 and temperature > 0; got k={k}, temperature={temperature}")
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
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
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
        num_classes = getattr(trainer.datamodule, "num_classes", None)
        bank_targets = torch.cat(self._targets[BANK])
        if num_classes is None:
            num_classes = int(bank_targets.max()) + 1
        predicted = knn_predict(
            torch.cat(self._features[QUERIES]),
            torch.cat(self._features[BANK]),
            bank_targets,
            num_classes,
            k=self.k,
            temperature=self.temperature,
        )
        accuracy = (predicted == torch.cat(self._targets[QUERIES])).float().mean().item()
        if trainer.testing:
            pl_module.log("knn/test_top1", accuracy)
            return
        self.best = max(self.best, accuracy)
        pl_module.log("knn/top1", accuracy, prog_bar=True)
        pl_module.log("knn/top1_max", self.best)

    on_test_epoch_end = on_validation_epoch_end

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = float(state_dict["best"])
