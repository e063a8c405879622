import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hfmca_lightning.callbacks import KNNEvaluation
from hfmca_lightning.evaluation import knn_accuracy
from tests.helpers import FLOAT32_UNIT, quiet_trainer


class BankAndQueries(LightningDataModule):
    num_classes = 3

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.bank = TensorDataset(torch.randn(30, 4, generator=generator), torch.arange(3).repeat(10))
        self.queries = TensorDataset(torch.randn(12, 4, generator=generator), torch.arange(3).repeat(4))

    def train_dataloader(self):
        return DataLoader(self.bank, batch_size=10)

    def val_dataloader(self):
        return [DataLoader(self.bank, batch_size=7), DataLoader(self.queries, batch_size=5)]

    test_dataloader = val_dataloader


class BatchNormEncoder(LightningModule):
    """Features through BatchNorm: different in train and eval mode, so the mode is visible in the result."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        return self.encoder(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.modes.append(self.training)
        return {"features": self.encoder(batch[0]), "targets": batch[1]}

    test_step = validation_step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(callback: KNNEvaluation, epochs: int = 1) -> Trainer:
    return quiet_trainer(
        max_epochs=epochs,
        callbacks=[callback],
    )


def test_callback_accuracy_equals_knn_of_eval_mode_features():
    module, data, callback = BatchNormEncoder(), BankAndQueries(), KNNEvaluation(k=5, temperature=0.1)
    trainer = _trainer(callback)
    trainer.fit(module, data)
    assert module.modes and not any(module.modes), "the bank pass must run in eval mode"
    module.eval()
    with torch.no_grad():
        bank = module.encoder(data.bank.tensors[0])
        queries = module.encoder(data.queries.tensors[0])
    expected = knn_accuracy(queries, data.queries.tensors[1], bank, data.bank.tensors[1], 3, k=5, temperature=0.1)
    assert float(trainer.callback_metrics["knn/top1"]) == expected
    assert float(trainer.callback_metrics["knn/top1_max"]) == callback.best == expected


def test_max_is_kept_across_epochs_and_restored_from_state():
    callback = KNNEvaluation(k=5)
    callback.load_state_dict({"best": 0.99})
    trainer = _trainer(callback)
    trainer.fit(BatchNormEncoder(), BankAndQueries())
    # 0.99 restored, logged as float32 (2^-24 relative)
    assert float(trainer.callback_metrics["knn/top1_max"]) == pytest.approx(
        0.99, rel=FLOAT32_UNIT
    ) and callback.state_dict() == {"best": 0.99}


def test_test_loop_reports_test_accuracy():
    trainer = _trainer(KNNEvaluation(k=5))
    result = trainer.test(BatchNormEncoder(), BankAndQueries(), verbose=False)
    assert 0.0 <= result[0]["knn/test_top1"] <= 1.0
