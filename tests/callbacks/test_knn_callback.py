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


class NoLoaderIndex(LightningModule):
    """stable-pretraining's shape of evaluation: ``validation_step(batch, batch_idx)`` on ``{"image", "label",
    "sample_idx"}`` dicts, returning ``{"embedding", "label"}``; BatchNorm, so eval mode shows in the features."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())  # fmt: skip
        self.backbone[1].running_mean.uniform_(-1, 1)  # running statistics unlike a batch's

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        assert type(batch) is dict
        return {"embedding": self.backbone(batch["image"]), "label": batch["label"]}


def test_one_evaluation_loader_draws_the_bank_itself_and_scores_as_two():
    """``evaluation_loaders="queries"``: the loop sees the test split only (a ``validation_step`` without a loader
    index works), the callback runs that step over the bank in eval mode; the accuracy is that of eval-mode
    features of both splits."""
    from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes
    from hfmca_lightning.data.datamodule import BANK, QUERIES

    def data(**options) -> MultiViewDataModule:
        source = SyntheticShapes(num_classes=3, train_per_class=10, test_per_class=5, image_size=16)
        options = {"batch_size": 8, "eval_batch_size": 7, "num_workers": 0, **options}
        return MultiViewDataModule(source, batch_format="dict", **options)

    module = NoLoaderIndex()
    one = data(evaluation_loaders="queries")
    assert not isinstance(one.val_dataloader(), list)
    metrics = quiet_trainer(callbacks=[KNNEvaluation(k=5)]).validate(module, one, verbose=False)[0]
    module.eval()
    with torch.no_grad():
        features = [
            (torch.cat([module.backbone(b["image"]) for b in loader]), torch.cat([b["label"] for b in loader]))
            for loader in (one.evaluation_loader(BANK), one.evaluation_loader(QUERIES))
        ]
    (bank, bank_labels), (queries, query_labels) = features
    expected = knn_accuracy(queries, query_labels, bank, bank_labels, 3, k=5, temperature=0.1)
    assert 0 < expected < 1 and metrics["knn/top1"] == pytest.approx(expected, abs=FLOAT32_UNIT)
    # the same number with the two loaders (and a module that takes the loader index)
    module.validation_step = lambda batch, batch_idx, dataloader_idx=0: NoLoaderIndex.validation_step(
        module, batch, batch_idx
    )
    two = quiet_trainer(callbacks=[KNNEvaluation(k=5)]).validate(module, data(), verbose=False)[0]
    assert two["knn/top1"] == pytest.approx(metrics["knn/top1"], abs=FLOAT32_UNIT)
