"""The data module (hfmca_lightning/data/datamodule.py): training batches of each spec and the evaluation loaders,
workers capped to the cores, the position a checkpoint resumes at, and the mistakes reported before training."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from hfmca_lightning.data import (
    BatchedDrawer,
    MultiViewDataModule,
    SameClassViews,
    SimCLRViews,
    SingleView,
    SyntheticShapes,
    UnlabelledFolderSource,
)
from hfmca_lightning.data.datamodule import BANK, QUERIES, TrainingPosition
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning
from tests.helpers import write_image_folder


def _shapes() -> SyntheticShapes:
    return SyntheticShapes(num_classes=2, train_per_class=8)


@pytest.mark.parametrize(
    ("views", "shape"),
    [
        (SimCLRViews(count=4), (5, 4, 3, 32, 32)),
        (SameClassViews(count=4), (5, 4, 3, 32, 32)),
        (SingleView(), (5, 3, 32, 32)),
    ],
    ids=["views", "same_class", "single"],
)
def test_datamodule_batches(views, shape):
    datamodule = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=6, test_per_class=2),
        views=views,
        batch_size=5,
        eval_batch_size=7,
        num_workers=0,
    )
    datamodule.setup("fit")
    views, targets = next(iter(datamodule.train_dataloader()))
    assert views.shape == shape and views.dtype == torch.float32 and targets.shape == (5,)
    bank, queries = datamodule.val_dataloader()
    images, bank_targets = next(iter(bank))
    assert images.shape == (7, 3, 32, 32)
    assert len(bank.dataset) == 18 and len(queries.dataset) == 6
    assert datamodule.num_classes == 3


def test_the_evaluation_loaders_are_the_unaugmented_train_and_test_splits():
    datamodule = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=4, test_per_class=2),
        batch_size=4,
        eval_batch_size=5,
        num_workers=0,
    )
    loaders = datamodule.val_dataloader()
    assert [len(loader.dataset) for loader in loaders] == [12, 6] and (BANK, QUERIES) == (0, 1)
    train, test = datamodule.evaluation_splits
    for loader, split in ((loaders[BANK], train), (loaders[QUERIES], test)):
        images, targets = next(iter(loader))
        expected = torch.stack([datamodule.eval_transform(split[index][0]) for index in range(5)])
        torch.testing.assert_close(images, expected, rtol=0, atol=0)  # in order, un-augmented
        assert targets.tolist() == split.targets[:5]
    assert [len(loader.dataset) for loader in datamodule.test_dataloader()] == [12, 6]


def test_the_dict_formats_evaluation_loaders_give_dicts_and_one_loader_is_the_test_split():
    def data(**options: object) -> MultiViewDataModule:
        source = SyntheticShapes(num_classes=3, train_per_class=4, test_per_class=2)
        return MultiViewDataModule(source, batch_size=4, eval_batch_size=5, num_workers=0, **options)  # type: ignore[arg-type]

    stacked = data()
    for batch_format in ("dict", "dict_named"):
        loaders = data(batch_format=batch_format).val_dataloader()
        for loader, reference in zip(loaders, stacked.val_dataloader()):
            for batch, (images, targets) in zip(loader, reference):
                assert type(batch) is dict and set(batch) == {"image", "label", "sample_idx"}
                assert torch.equal(batch["image"], images) and torch.equal(batch["label"], targets)
            assert next(iter(loader))["sample_idx"].tolist() == [0, 1, 2, 3, 4]  # index in the split
    one = data(evaluation_loaders="queries")
    loader = one.val_dataloader()
    assert not isinstance(loader, list) and len(loader.dataset) == 6  # the test split alone
    images, _ = next(iter(loader))
    assert torch.equal(images, next(iter(stacked.val_dataloader()[QUERIES]))[0])
    assert len(one.evaluation_loader(BANK).dataset) == 12 and not isinstance(one.test_dataloader(), list)


def test_a_source_without_labels_trains_without_evaluation_loaders(tmp_path):
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    datamodule = MultiViewDataModule(
        UnlabelledFolderSource(root=str(tmp_path / "train"), image_size=32), batch_size=2, num_workers=0
    )
    with pytest.warns(HFMCAWarning, match="UnlabelledFolderSource has no labelled evaluation split"):
        assert datamodule.val_dataloader() == []
    assert datamodule.evaluation_splits is None
    views, _ = next(iter(datamodule.train_dataloader()))
    assert views.shape == (2, 2, 3, 32, 32)


@pytest.mark.parametrize(
    ("options", "message", "parameter"),
    [
        ({"batch_format": "torch"}, "batch_format must be one of stacked, lightly, solo, dict", "batch_format"),
        (
            {"evaluation_loaders": "bank"},
            "evaluation_loaders must be one of bank_and_queries, queries; got 'bank'",
            "evaluation_loaders",
        ),
        ({"batch_size": 0}, "batch_size must be >= 1; got 0", "batch_size"),
        ({"eval_batch_size": 0}, "eval_batch_size must be >= 1; got 0", "eval_batch_size"),
        ({"num_workers": -1}, "num_workers must be >= 0; got -1", "num_workers"),
        ({"batch_size": "64"}, "batch_size must be a whole number >= 1; got '64'", "batch_size"),
        ({"num_workers": True}, "num_workers must be a whole number >= 0; got True", "num_workers"),
        (
            {"drawer": BatchedDrawer},
            r"drawer is the class BatchedDrawer; give an instance: BatchedDrawer\(...\)",
            "drawer",
        ),
    ],
    ids=[
        *("batch format", "evaluation loaders", "batch size", "eval batch size", "workers"),
        *("batch size as text", "workers as bool", "drawer class"),
    ],
)
def test_datamodule_rejects_bad_arguments(options, message, parameter):
    with pytest.raises(ConfigurationError, match=message) as error:
        MultiViewDataModule(SyntheticShapes(), **options)
    assert "\n" not in str(error.value) and error.value.parameter == parameter


def test_a_batch_larger_than_the_training_split_is_one_line_before_training():
    datamodule = MultiViewDataModule(_shapes(), batch_size=17, num_workers=0)
    with pytest.raises(
        ConfigurationError, match=r"batch_size=17 is larger than the training split \(16 images\)"
    ) as error:
        datamodule.setup("fit")
    assert "\n" not in str(error.value) and error.value.parameter == "batch_size"


def test_same_class_views_of_unlabelled_images_are_one_line_before_training(tmp_path):
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    datamodule = MultiViewDataModule(
        UnlabelledFolderSource(root=str(tmp_path / "train"), image_size=32),
        views=SameClassViews(),
        batch_size=2,
        num_workers=0,
    )
    for _ in range(2):  # a second setup checks again
        with pytest.raises(
            ConfigurationError, match="SameClassViews groups images by class, but the training images have no labels"
        ) as error:
            datamodule.setup("fit")
        assert error.value.parameter == "views"


def test_a_checkpoints_position_starts_the_next_training_loader_there():
    """``load_state_dict`` (a checkpoint's data position): the next training loader starts at the next unseen sample
    of that epoch, with the order and views of an uninterrupted run; the loader after it starts a whole epoch again.
    Without a trainer there is no position to record."""

    def batches(datamodule: MultiViewDataModule, epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        loader = datamodule.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return list(loader)

    def make() -> MultiViewDataModule:
        return MultiViewDataModule(_shapes(), batch_size=4, num_workers=0, seed=2)

    uninterrupted = batches(make(), epoch=1)
    resumed = make()
    assert resumed.state_dict() == {}
    resumed.load_state_dict({"position": asdict(TrainingPosition(epoch=1, samples_seen=8))})
    loader = resumed.train_dataloader()  # Lightning sets the epoch it resumes before iterating
    loader.sampler.set_epoch(1)
    rest = list(loader)
    assert len(rest) == len(uninterrupted) - 2
    for (views, targets), (expected_views, expected_targets) in zip(rest, uninterrupted[2:]):
        torch.testing.assert_close(views, expected_views, rtol=0, atol=0)
        assert torch.equal(targets, expected_targets)
    assert len(batches(resumed, epoch=1)) == len(uninterrupted)  # the position is used once


def test_a_position_of_another_epoch_than_the_loops_is_dropped_and_a_shrunk_split_refused():
    """Lightning sets the epoch it runs after restoring a checkpoint: when that is not the position's epoch (a
    checkpoint written by an older version after ``max_steps`` ended an epoch early), the loader gives the whole of
    Lightning's epoch, not the rest of another. A position past the end of a training split that shrank since the
    checkpoint is one line."""

    def make() -> MultiViewDataModule:
        return MultiViewDataModule(_shapes(), batch_size=4, num_workers=0, seed=2)

    fresh = make().train_dataloader()
    fresh.sampler.set_epoch(1)
    whole_epoch = [targets for _, targets in fresh]
    stale = make()
    stale.load_state_dict({"position": asdict(TrainingPosition(epoch=0, samples_seen=8))})
    loader = stale.train_dataloader()
    loader.sampler.set_epoch(1)
    assert [targets.tolist() for _, targets in loader] == [targets.tolist() for targets in whole_epoch]
    shrunk = make()
    shrunk.load_state_dict({"position": asdict(TrainingPosition(epoch=0, samples_seen=20))})
    with pytest.raises(ConfigurationError, match="after 20 training images, but the training split now has 16"):
        shrunk.train_dataloader()


class _RecordsSamples(LightningModule):
    """Records the sample indices of each training step (lightly batches carry them as names)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.steps: list[tuple[int, list[str]]] = []

    def training_step(self, batch, batch_index):
        views, _, names = batch
        self.steps.append((self.current_epoch, list(names)))
        return self.weight * views[0].mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.integration  # training runs
@pytest.mark.parametrize("stop", ["max_steps", "max_time"])
@pytest.mark.parametrize("resume_with", ["max_epochs", "max_steps"])
def test_a_run_that_max_steps_or_max_time_stopped_mid_epoch_resumes_as_lightnings_loop_does(
    tmp_path, stop, resume_with
):
    """An epoch that ``max_steps`` or ``max_time`` ended early has run its end hooks when the checkpoint is written.
    Resumed with ``max_epochs`` alone, Lightning counts it finished: the resumed steps train on exactly the samples of
    the uninterrupted run's next epochs, and a warning says how many images of the cut epoch are left untrained
    (before: the rest of the cut epoch, as if it were the next). Resumed with ``max_steps``, Lightning finishes the
    epoch: every step equals the uninterrupted run's, with no warning (its sampler epoch runs one ahead there)."""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    def data() -> MultiViewDataModule:
        source = SyntheticShapes(num_classes=4, train_per_class=6, test_per_class=2, image_size=8)
        return MultiViewDataModule(source, batch_format="lightly", batch_size=4, num_workers=2, seed=3)  # 6 steps

    def trainer(**options) -> Trainer:
        quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
        length = {"max_epochs": 3} | options.pop("length", {})
        return Trainer(accelerator="cpu", limit_val_batches=0, default_root_dir=tmp_path, **quiet, **length, **options)

    class StopsAtStepFour(Callback):  # max_time's stop: the Timer sets should_stop after a batch
        def on_train_batch_end(self, trainer, *args) -> None:
            trainer.should_stop = trainer.global_step >= 4

    length = {"max_epochs": 10, "max_steps": 16} if resume_with == "max_steps" else {}
    uninterrupted = _RecordsSamples()
    trainer(enable_checkpointing=False, length=length).fit(uninterrupted, data())
    stopped, checkpoint = _RecordsSamples(), ModelCheckpoint(dirpath=tmp_path, filename="stopped")
    limit = {"length": {"max_steps": 4}} if stop == "max_steps" else {"callbacks": [checkpoint, StopsAtStepFour()]}
    trainer(**({"callbacks": [checkpoint]} | limit)).fit(stopped, data())
    assert [epoch for epoch, _ in stopped.steps] == [0] * 4
    resumed, resume = _RecordsSamples(), trainer(enable_checkpointing=False, length=length)
    if resume_with == "max_steps":  # HFMCAWarning is an error here
        resume.fit(resumed, data(), ckpt_path=str(tmp_path / "stopped.ckpt"))
        assert [names for _, names in resumed.steps] == [names for _, names in uninterrupted.steps[4:]]
        assert len(resumed.steps) == 12
        return
    with pytest.warns(HFMCAWarning, match="epoch 0 was ended early .* goes on at epoch 1, and 8 training images"):
        resume.fit(resumed, data(), ckpt_path=str(tmp_path / "stopped.ckpt"))
    later_epochs = [step for step in uninterrupted.steps if step[0] >= 1]
    assert resumed.steps == later_epochs and len(later_epochs) == 12


# The test pretends the machine has 3 cores; torch compares the 3 workers with the real count.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_more_workers_than_cores_are_capped_to_the_cores(monkeypatch, caplog):
    from hfmca_lightning.runtime import workers

    monkeypatch.setattr(workers, "available_cores", lambda: 3)
    data = MultiViewDataModule(_shapes(), batch_size=2, num_workers=8)
    with caplog.at_level("INFO"):
        assert data.train_dataloader().num_workers == 3
        assert [loader.num_workers for loader in data.val_dataloader()] == [3, 3]
    assert (
        sum("num_workers=8, but this process may use 3 CPU cores" in record.message for record in caplog.records) == 1
    )
    few = MultiViewDataModule(_shapes(), batch_size=2, num_workers=2)
    assert few.train_dataloader().num_workers == 2


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # pretended core counts, as above
def test_processes_of_one_machine_share_its_cores_among_their_workers(monkeypatch, caplog):
    """DDP on one machine: 2 processes of 3 cores' machine each get 1 worker, not 3 (6 workers on 3 cores); processes
    bound to their own cores keep their share."""
    from hfmca_lightning.runtime import workers

    class TwoDevices:
        num_devices, world_size, global_rank = 2, 2, 0

        class strategy:  # noqa: N801 - an attribute of the trainer
            root_device = torch.device("cpu")

    monkeypatch.setattr(workers, "available_cores", lambda: 3)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 3)
    data = MultiViewDataModule(_shapes(), batch_size=2, num_workers=8)
    data.trainer = TwoDevices()  # type: ignore[assignment]
    with caplog.at_level("INFO"):
        assert [loader.num_workers for loader in data.val_dataloader()] == [1, 1]
    assert any("each of 2 processes on this machine may use 1 CPU cores" in record.message for record in caplog.records)
    # Each process bound to its own 3 of 12 cores (SLURM's --cpus-per-task 3): its affinity is its share already.
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 12)
    bound = MultiViewDataModule(_shapes(), batch_size=2, num_workers=8)
    bound.trainer = TwoDevices()  # type: ignore[assignment]
    assert [loader.num_workers for loader in bound.val_dataloader()] == [3, 3]


def test_resident_drawing_leaves_the_workers_to_the_evaluation_loaders():
    """A drawer that needs no workers trains from the main process; ``num_workers`` then serves evaluation only."""
    from hfmca_lightning.data import ResidentDrawer

    datamodule = MultiViewDataModule(_shapes(), drawer=ResidentDrawer(), batch_size=4, num_workers=1)
    assert datamodule.train_dataloader().num_workers == 0
    assert [loader.num_workers for loader in datamodule.val_dataloader()] == [1, 1]
