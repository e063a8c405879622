"""Two CPU processes (gloo, ddp_spawn): a DDP fit equals one process with the doubled batch (external and internal
costs, all pairs' statistics reduced in one collective per step), stable-pretraining's dict batches are sharded as
one process's doubled batch, and kNN under DDP equals the single-process kNN on the same bank (no sample counted
twice), with two evaluation loaders or one."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.callbacks import EigenspectrumCallback, KNNEvaluation
from hfmca_lightning.data import BatchedDrawer, MultiCrop, ResidentDrawer, SimCLRViews, TransformViews
from tests.helpers import FLOAT32_UNIT, PER_RANK_BATCH, bn_free_module, ddp_data, ddp_trainer


class CountCollectives(Callback):
    """Counts the functional all-reduces (the cost statistics' collectives) of each training step, in its forward
    pass (to the backward) and in its backward pass (to the optimizer step: the reduction's gradient), and writes
    the counts of process ``rank`` to ``folder/collectives<rank>.txt`` as ``forward/backward`` per step."""

    def __init__(self, folder: str) -> None:
        self.folder, self.counts, self.mode = folder, [], None

    def _start(self) -> None:
        from hfmca_lightning.diagnostics import OperationCounts

        self.mode = OperationCounts(torch.ops._c10d_functional.all_reduce)
        self.mode.__enter__()

    def _stop(self) -> int:
        self.mode.__exit__(None, None, None)
        return self.mode.count

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.counts.append(str(self._stop()))
        self._start()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.counts[-1] += f"/{self._stop()}"

    def on_train_end(self, trainer, pl_module) -> None:
        with open(os.path.join(self.folder, f"collectives{trainer.global_rank}.txt"), "w") as file:
            file.write(" ".join(self.counts))


def _mmcr_views() -> TransformViews:
    from lightly.transforms import MMCRTransform

    return TransformViews(MMCRTransform(k=4, input_size=16, gaussian_blur=0.0))


@pytest.mark.parametrize(
    ("internal", "data"),
    [
        pytest.param(False, lambda: {}, marks=pytest.mark.extended),  # external+internal covers it
        (True, lambda: {}),
        (False, lambda: {"drawer": ResidentDrawer(batches_per_call=2)}),
        (True, lambda: {"views": MultiCrop(2, 2, local_size=8)}),
        pytest.param(False, lambda: {"views": _mmcr_views()}, marks=pytest.mark.extended),
        pytest.param(False, lambda: {"drawer": BatchedDrawer()}, marks=pytest.mark.slow),
        pytest.param(False, lambda: {"drawer": BatchedDrawer(on="device")}, marks=pytest.mark.slow),
    ],
    ids=[
        *("external", "external+internal", "images-on-device", "multi-crop", "user-transform"),
        *("batched", "batched-on-device"),
    ],
)
def test_ddp_fit_equals_one_process_with_the_doubled_batch(internal, data, tmp_path):
    """With every spec and drawer (torchvision's, the batched one in the workers and on the device, the training split
    kept on the device (the CPU here), multi-crop groups of two sizes, a user transform: lightly's MMCRTransform), the
    processes' shards and the views drawn from their per-sample seeds are those of one process with the doubled
    batch."""
    single = bn_free_module(internal)
    ddp_trainer(1, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(
        single, ddp_data(2 * PER_RANK_BATCH, **data())
    )
    distributed = bn_free_module(internal)
    counting = CountCollectives(str(tmp_path))
    ddp_trainer(2, max_epochs=1, limit_train_batches=3, limit_val_batches=0, callbacks=[counting]).fit(
        distributed, ddp_data(PER_RANK_BATCH, **data())
    )
    for rank in range(
        2
    ):  # one collective per step for the statistics of all (one or three) cost pairs, one for their gradients
        assert (tmp_path / f"collectives{rank}.txt").read_text() == "1/1 1/1 1/1"
    untrained = dict(bn_free_module(internal).named_parameters())
    for key, value in single.named_parameters():
        assert not torch.equal(value, untrained[key]), f"{key} did not train"
    # float32 weights after 3 SGD steps (lr 0.5): the gradients of 8 groups summed on one process, or of 4 on each and
    # averaged by DDP, differ by 2 gamma_n (n <= 8 groups x 4 views x 256 positions) of the terms' magnitudes in the
    # worst case and by ~sqrt(n) u ~ 3e-6 relative in practice, and each step carries the previous one's difference.
    # The terms' magnitudes are those of the whole tensor's gradient, not of each element (an element near 0 sums
    # terms of the usual size): 1e-5 of the tensor's largest weight (measured up to 3.3e-6 of it, internal costs).
    for key, value in single.state_dict().items():
        scale = float(value.abs().max()) if value.is_floating_point() and value.numel() else 0.0
        torch.testing.assert_close(distributed.state_dict()[key], value, rtol=1e-5, atol=1e-5 * scale, msg=key)


@pytest.mark.parametrize("loaders", [pytest.param("bank_and_queries", marks=pytest.mark.extended), "queries"])
def test_knn_under_ddp_equals_single_process_on_the_same_bank(loaders):
    """Two evaluation loaders, or the queries' alone with the bank drawn by the callback itself (sharded as Lightning
    shards the loop's): the accuracy of one process with both loaders."""
    module = bn_free_module()
    datamodule = ddp_data(PER_RANK_BATCH, train_per_class=7)
    datamodule.setup()
    # 21 bank and 9 query images over 2 ranks with batches of 4: the samplers pad both.
    single = ddp_trainer(1, callbacks=[KNNEvaluation(k=5)]).validate(module, datamodule, verbose=False)[0]["knn/top1"]
    data = ddp_data(PER_RANK_BATCH, train_per_class=7)
    data.evaluation_loaders = loaders
    distributed = ddp_trainer(2, callbacks=[KNNEvaluation(k=5)]).validate(module, data, verbose=False)[0]["knn/top1"]
    assert 0 < single < 1
    assert distributed == pytest.approx(
        single, abs=FLOAT32_UNIT
    )  # the same count of correct queries, logged as float32


class RecordDictBatches(Callback):
    """Writes what each training step of process ``rank`` got to ``folder/batches<rank>.pt``: checks that the batch
    is a plain dict, keeps its ``sample_idx`` and its views."""

    def __init__(self, folder: str) -> None:
        self.folder, self.steps = folder, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        assert type(batch) is dict, type(batch)
        self.steps.append({"sample_idx": batch["sample_idx"].clone(), "views": [v["image"] for v in batch["views"]]})

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.steps, os.path.join(self.folder, f"batches{trainer.global_rank}.pt"))


@pytest.mark.extended
def test_ddp_shards_dict_batches_as_one_process_with_the_doubled_batch(tmp_path):
    """``batch_format: dict`` under 2-process DDP, for a module that takes plain dicts only: each step's two shards
    hold the samples of the one-process step with the doubled batch, each sample with the same views."""
    from tests.helpers.stable_pretraining import SPTSimCLR

    def run(devices: int, batch_size: int) -> Path:
        folder = tmp_path / f"devices{devices}"
        folder.mkdir()
        data = ddp_data(batch_size, views=SimCLRViews(count=2))
        data.batch_format, data.evaluation_loaders = "dict", "queries"
        record = RecordDictBatches(str(folder))
        trainer = ddp_trainer(devices, max_epochs=1, limit_train_batches=3, limit_val_batches=0, callbacks=[record])
        trainer.fit(SPTSimCLR(), data)
        return folder

    single = torch.load(run(1, 2 * PER_RANK_BATCH) / "batches0.pt")
    folder = run(2, PER_RANK_BATCH)
    shards = [torch.load(folder / f"batches{rank}.pt") for rank in range(2)]
    assert len(single) == len(shards[0]) == len(shards[1]) == 3
    for step, whole in enumerate(single):
        views_of = {int(index): [view[row] for view in whole["views"]] for row, index in enumerate(whole["sample_idx"])}
        parts = [shard[step] for shard in shards]
        indices = [int(index) for part in parts for index in part["sample_idx"]]
        assert sorted(indices) == sorted(views_of) and len(set(indices)) == 2 * PER_RANK_BATCH
        for part in parts:
            for row, index in enumerate(part["sample_idx"]):
                assert all(torch.equal(view[row], want) for view, want in zip(part["views"], views_of[int(index)]))


def test_a_ddp_checkpoint_resumes_on_another_device_count(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    two = ddp_trainer(
        2,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
    )
    two.fit(bn_free_module(), ddp_data(PER_RANK_BATCH))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2
    resumed = bn_free_module()
    one = ddp_trainer(
        1,
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "one", save_last=True)],
    )
    one.fit(resumed, ddp_data(2 * PER_RANK_BATCH), ckpt_path=tmp_path / "last.ckpt")
    assert one.global_step == 4 and one.current_epoch == 2


@pytest.mark.extended
def test_rankme_under_ddp_is_that_of_every_process_batch(tmp_path):
    """``rankme/backbone`` under DDP is RankMe of the features of every process's batch together, as one process's
    with the doubled batch (and as the spectra's windows), not of rank 0's share."""
    logged = {}
    for devices, batch_size in ((1, 2 * PER_RANK_BATCH), (2, PER_RANK_BATCH)):
        folder = tmp_path / f"devices{devices}"
        spectra = EigenspectrumCallback(every_n_steps=1, min_groups=1, output_dir=str(folder / "figures"))
        trainer = ddp_trainer(
            devices, max_steps=2, limit_val_batches=0, callbacks=[spectra], logger=CSVLogger(folder, name="")
        )
        trainer.fit(bn_free_module(), ddp_data(batch_size))
        (metrics,) = folder.rglob("metrics.csv")
        logged[devices] = [
            float(row["rankme/backbone"]) for row in csv.DictReader(open(metrics)) if row.get("rankme/backbone")
        ]
    assert len(logged[1]) == 2
    # RankMe of 32 x 5 float32 features, the same rows in another order: float32 rounding of the SVD, 1e-5 relative
    assert logged[2] == pytest.approx(logged[1], rel=1e-5)
