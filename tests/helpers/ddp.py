"""Two-process (gloo, spawned) runs on the CPU: a BN-free model, its data, and the trainer settings."""

from __future__ import annotations

import os
import socket
from functools import partial

import torch
from lightning.pytorch import Callback, Trainer
from torch import nn

from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.data.drawers import ViewDrawer
from hfmca_lightning.data.view_specs import ViewSpec
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import GridExternalHead

PER_RANK_BATCH = 4


def bn_free_module(internal: bool = False) -> HFMCAModule:
    """BN-free, so per-rank and whole-batch normalisation cannot differ; the costs sync their statistics. With
    ``internal``: internal costs on the backbone's two convolutions too."""
    torch.manual_seed(0)
    head = GridExternalHead(feature_dim=6, grid_height=2, grid_width=2, hidden_dim=8, noise_channels=0)
    head.layers = nn.Sequential(
        *[nn.Identity() if isinstance(layer, nn.BatchNorm2d) else layer for layer in head.layers]
    )
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


def ddp_data(
    batch_size: int, views: ViewSpec | None = None, drawer: ViewDrawer | None = None, train_per_class: int = 8
) -> MultiViewDataModule:
    """The DDP tests' data: ``3 * train_per_class`` (24) training images and 9 test images of 16 px, ``views``
    (default: 4 SimCLR views) drawn by ``drawer`` (default: torchvision's), no workers."""
    source = SyntheticShapes(num_classes=3, train_per_class=train_per_class, test_per_class=3, image_size=16)
    return MultiViewDataModule(
        source,
        views=SimCLRViews(count=4) if views is None else views,
        drawer=drawer,
        batch_size=batch_size,
        eval_batch_size=4,
        num_workers=0,
    )


class ReleaseProcessGroup(Callback):
    """Destroy the process group at the end of a spawned run. Spawned workers leave through ``os._exit``, so the
    ``atexit`` handler that Lightning registers for this never runs, and gloo's threads, still alive at exit,
    now and then abort the worker ("terminate called without an active exception": about 1 run in 10 of the
    kNN test on a 2-core machine). ``teardown`` is the trainer's last hook; nothing collective follows it."""

    def teardown(self, trainer: Trainer, pl_module, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def ddp_trainer(devices: int, **kwargs) -> Trainer:
    if devices > 1:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), ReleaseProcessGroup()]
        # A fresh rendezvous port for every spawned group (Lightning would reuse the first one it chose).
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    strategy = "ddp_spawn" if devices > 1 else "auto"
    settings = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, **{**settings, **kwargs})
