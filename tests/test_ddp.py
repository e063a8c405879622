"""Two CPU processes (gloo, ddp_spawn): a DDP fit equals one process with the doubled batch (external and internal
costs, all pairs' statistics reduced in one collective per step), and kNN under DDP equals the single-process kNN
on the same bank (no sample counted twice)."""

from __future__ import annotations

import os
import socket
from functools import partial

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch import nn

from hfmca_lightning.callbacks import KNNEvaluation
from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import GridExternalHead

PER_RANK_BATCH = 4


def bn_free_module(internal: bool = False) -> HFMCAModule:
    """BN-free, so per-rank and whole-batch normalisation cannot differ; the costs sync their statistics. With
    ``internal``: internal costs on the backbone's two convolutions too."""
    torch.manual_seed(0)
    head = GridExternalHead(feature_dim=6, grid_height=2, grid_width=2, hidden_dim=8, noise_channels=0)
    head.layers = nn.Sequential(*[nn.Identity() if isinstance(layer, nn.BatchNorm2d) else layer for layer in head.layers])
    convolutions = [nn.Conv2d(3, 4, 3, padding=1), nn.Sigmoid(), nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.Sigmoid()]
    return HFMCAModule(
        backbone=nn.Sequential(*convolutions, nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        projector=nn.Sequential(nn.Linear(5, 6), nn.Sigmoid()),
        external_head=head,
        external_cost=HFMCACost(reg=0.1, sync_dist=True, name="external"),
        internal_costs=InternalCosts(["0", "2"], reg=0.1, sync_dist=True) if internal else None,
        optimizer=partial(torch.optim.SGD, lr=0.5),
        lr_scheduler=partial(torch.optim.lr_scheduler.ConstantLR, factor=1.0, total_iters=0),
    )


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


def data(batch_size: int, images_on_device: bool = False) -> MultiViewDataModule:
    source = SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=3, image_size=16)
    return MultiViewDataModule(source, num_views=4, batch_size=batch_size, eval_batch_size=4, num_workers=0, images_on_device=images_on_device)


class ReleaseProcessGroup(Callback):
    """Destroy the process group at the end of a spawned run. Spawned workers leave through ``os._exit``, so the
    ``atexit`` handler that Lightning registers for this never runs, and gloo's threads, still alive at exit,
    now and then abort the worker ("terminate called without an active exception": about 1 run in 10 of the
    kNN test on a 2-core machine). ``teardown`` is the trainer's last hook; nothing collective follows it."""

    def teardown(self, trainer: Trainer, pl_module, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def trainer(devices: int, **kwargs) -> Trainer:
    if devices > 1:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), ReleaseProcessGroup()]
        # A fresh rendezvous port for every spawned group (Lightning would reuse the first one it chose).
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    strategy = "ddp_spawn" if devices > 1 else "auto"
    settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, **{**settings, **kwargs})


@pytest.mark.parametrize(
    ("internal", "images_on_device"), [(False, False), (True, False), (False, True)], ids=["external", "external+internal", "images-on-device"]
)
def test_ddp_fit_equals_one_process_with_the_doubled_batch(internal, images_on_device, tmp_path):
    """With the training split kept on the device (the CPU here) the processes' shards and the views drawn from
    their seeds are those of one process with the doubled batch too."""
    single = bn_free_module(internal)
    trainer(1, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(single, data(2 * PER_RANK_BATCH, images_on_device))
    distributed = bn_free_module(internal)
    counting = CountCollectives(str(tmp_path))
    trainer(2, max_epochs=1, limit_train_batches=3, limit_val_batches=0, callbacks=[counting]).fit(distributed, data(PER_RANK_BATCH, images_on_device))
    for rank in range(2):  # one collective per step for the statistics of all (one or three) cost pairs, one for their gradients
        assert (tmp_path / f"collectives{rank}.txt").read_text() == "1/1 1/1 1/1"
    untrained = dict(bn_free_module(internal).named_parameters())
    for key, value in single.named_parameters():
        assert not torch.equal(value, untrained[key]), f"{key} did not train"
    for key, value in single.state_dict().items():
        torch.testing.assert_close(distributed.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_knn_under_ddp_equals_single_process_on_the_same_bank():
    module = bn_free_module()
    datamodule = data(PER_RANK_BATCH)
    datamodule.setup()
    # 24 bank and 9 query images over 2 ranks with batches of 4: the sampler pads the queries.
    single = trainer(1, callbacks=[KNNEvaluation(k=5)]).validate(module, datamodule, verbose=False)[0]["knn/top1"]
    distributed = trainer(2, callbacks=[KNNEvaluation(k=5)]).validate(module, data(PER_RANK_BATCH), verbose=False)[0]["knn/top1"]
    assert 0 < single < 1
    assert distributed == pytest.approx(single, abs=1e-7)


def test_a_ddp_checkpoint_resumes_on_another_device_count(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    two = trainer(2, max_epochs=1, limit_train_batches=2, limit_val_batches=0, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    two.fit(bn_free_module(), data(PER_RANK_BATCH))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2
    resumed = bn_free_module()
    one = trainer(1, max_epochs=2, limit_train_batches=2, limit_val_batches=0, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / "one", save_last=True)])
    one.fit(resumed, data(2 * PER_RANK_BATCH), ckpt_path=tmp_path / "last.ckpt")
    assert one.global_step == 4 and one.current_epoch == 2
