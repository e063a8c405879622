"""Two CPU processes (gloo, ddp_spawn): a DDP fit equals one process with the doubled batch (external and internal
costs, all pairs' statistics reduced in one collective per step), and kNN under DDP equals the single-process kNN
on the same bank (no sample counted twice)."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback

from hfmca_lightning.callbacks import KNNEvaluation
from hfmca_lightning.data import BatchedDrawer, MultiCrop, ResidentDrawer, TransformViews
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
        (False, lambda: {}),
        (True, lambda: {}),
        (False, lambda: {"drawer": ResidentDrawer(batches_per_call=2)}),
        (True, lambda: {"views": MultiCrop(2, 2, local_size=8)}),
        (False, lambda: {"views": _mmcr_views()}),
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


def test_knn_under_ddp_equals_single_process_on_the_same_bank():
    module = bn_free_module()
    datamodule = ddp_data(PER_RANK_BATCH)
    datamodule.setup()
    # 24 bank and 9 query images over 2 ranks with batches of 4: the sampler pads the queries.
    single = ddp_trainer(1, callbacks=[KNNEvaluation(k=5)]).validate(module, datamodule, verbose=False)[0]["knn/top1"]
    distributed = ddp_trainer(2, callbacks=[KNNEvaluation(k=5)]).validate(
        module, ddp_data(PER_RANK_BATCH), verbose=False
    )[0]["knn/top1"]
    assert 0 < single < 1
    assert distributed == pytest.approx(
        single, abs=FLOAT32_UNIT
    )  # the same count of correct queries, logged as float32


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
