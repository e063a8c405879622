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
    """stable-pretraining's shape of evaluation: ``validation_step(batch, batch_idx)`` / ``test_step`` on ``{"image",
    "label", "sample_idx"}`` dicts, returning ``{"embedding", "label"}`` and logging as its forward functions do (per
    step, and a count of the images it saw); BatchNorm, so eval mode shows in the features."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())  # fmt: skip
        self.backbone[1].running_mean.uniform_(-1, 1)  # running statistics unlike a batch's

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        assert type(batch) is dict
        embedding = self.backbone(batch["image"])
        self.log("eval/images", float(len(embedding)), reduce_fx="sum", batch_size=1)
        self.log("eval/step", 1.0, on_step=True, on_epoch=False, batch_size=1)
        return {"embedding": embedding, "label": batch["label"]}

    test_step = validation_step


def _dict_data(**options) -> "MultiViewDataModule":  # noqa: F821
    from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes

    source = SyntheticShapes(num_classes=3, train_per_class=10, test_per_class=5, image_size=16)
    options = {"batch_size": 8, "eval_batch_size": 7, "num_workers": 0, **options}
    return MultiViewDataModule(source, batch_format="dict", **options)


def _expected_accuracy(module: NoLoaderIndex, data) -> float:
    """kNN top-1 of the module's eval-mode features of the bank and the queries, computed here."""
    from hfmca_lightning.data.datamodule import BANK, QUERIES

    module.eval()
    with torch.no_grad():
        features = [
            (torch.cat([module.backbone(b["image"]) for b in loader]), torch.cat([b["label"] for b in loader]))
            for loader in (data.evaluation_loader(BANK), data.evaluation_loader(QUERIES))
        ]
    (bank, bank_labels), (queries, query_labels) = features
    return knn_accuracy(queries, query_labels, bank, bank_labels, 3, k=5, temperature=0.1)


def test_one_evaluation_loader_draws_the_bank_itself_and_scores_as_two():
    """``evaluation_loaders="queries"``: the loop sees the test split only (a ``validation_step`` without a loader
    index works), the callback runs that step over the bank in eval mode, what the step logs there is dropped; the
    accuracy is that of eval-mode features of both splits, in the validation and the test loop, in float64 too."""
    module = NoLoaderIndex()
    one = _dict_data(evaluation_loaders="queries")
    assert not isinstance(one.val_dataloader(), list)
    metrics = quiet_trainer(callbacks=[KNNEvaluation(k=5)]).validate(module, one, verbose=False)[0]
    expected = _expected_accuracy(module, one)
    assert 0 < expected < 1 and metrics["knn/top1"] == pytest.approx(expected, abs=FLOAT32_UNIT)
    assert metrics["eval/images"] == 15  # the queries only: the bank pass logs nothing
    tested = quiet_trainer(callbacks=[KNNEvaluation(k=5)]).test(module, one, verbose=False)[0]
    assert tested["knn/test_top1"] == pytest.approx(expected, abs=FLOAT32_UNIT)
    # the same number with the two loaders (and a module that takes the loader index)
    module.validation_step = lambda batch, batch_idx, dataloader_idx=0: NoLoaderIndex.validation_step(
        module, batch, batch_idx
    )
    two = quiet_trainer(callbacks=[KNNEvaluation(k=5)]).validate(module, _dict_data(), verbose=False)[0]
    assert two["knn/top1"] == pytest.approx(metrics["knn/top1"], abs=FLOAT32_UNIT)
    del module.validation_step
    double = quiet_trainer(callbacks=[KNNEvaluation(k=5)], precision="64-true")  # the bank's input made float64
    assert double.validate(module, one, verbose=False)[0]["knn/top1"] == pytest.approx(expected, abs=FLOAT32_UNIT)


def test_a_step_without_a_loader_index_and_two_loaders_is_one_line_before_evaluating():
    from hfmca_lightning.errors import ConfigurationError

    with pytest.raises(
        ConfigurationError, match="takes no loader index, .* set data evaluation_loaders: queries"
    ) as error:
        quiet_trainer(callbacks=[KNNEvaluation(k=5)]).validate(NoLoaderIndex(), _dict_data(), verbose=False)
    assert "\n" not in str(error.value) and error.value.parameter == "evaluation_loaders"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"k": 0}, "k must be >= 1; got 0"),
        # before: a whole epoch, then topk's TypeError
        ({"k": 2.5}, "k must be a whole number >= 1; got 2.5"),
        ({"k": "5"}, "k must be a whole number >= 1; got '5'"),
        ({"temperature": 0.0}, "a finite temperature > 0; got 0.0"),
        # before: accepted, and the weighted vote an unweighted one
        ({"temperature": float("inf")}, "a finite temperature > 0; got inf"),
    ],
)
def test_a_knn_setting_out_of_range_is_one_line(settings, message):
    from hfmca_lightning.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        KNNEvaluation(**settings)
