"""Evaluation rows of all processes, in dataset order: what the evaluation callbacks score."""

from __future__ import annotations

from collections.abc import Sized
from typing import cast

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from hfmca_lightning.data.datamodule import QUERIES

__all__ = ["evaluation_split", "gather_in_dataset_order", "queries_only", "split_length"]


def gather_in_dataset_order(
    pl_module: LightningModule, pieces: list[torch.Tensor], dataset_length: int
) -> torch.Tensor:
    """This process's rows ``cat(pieces)``, or under DDP every process's rows in dataset order without the
    distributed sampler's padding (row ``j`` of rank ``r`` is sample ``j * world_size + r``)."""
    local = torch.cat(pieces)
    world = pl_module.trainer.world_size
    if world == 1:
        return local
    gathered = cast(torch.Tensor, pl_module.all_gather(local))  # (W, n_per_rank, ...): a tensor gathers to one
    ordered = gathered.transpose(0, 1).reshape(-1, *local.shape[1:])
    return ordered[:dataset_length]


def queries_only(trainer: Trainer) -> bool:
    """Whether the data gives the test split's loader alone (``evaluation_loaders="queries"``)."""
    return getattr(getattr(trainer, "datamodule", None), "evaluation_loaders", "bank_and_queries") == "queries"


def evaluation_split(trainer: Trainer, dataloader_idx: int) -> int:
    """``BANK`` or ``QUERIES``: the split that evaluation loader ``dataloader_idx`` reads."""
    return QUERIES if queries_only(trainer) else dataloader_idx


def split_length(trainer: Trainer, split: int) -> int:
    """Images in the running evaluation loop's loader of ``split`` (``BANK`` or ``QUERIES``; the one loader there
    is with ``evaluation_loaders="queries"``)."""
    loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
    assert loaders is not None  # called inside an evaluation loop
    loader = loaders if isinstance(loaders, DataLoader) else loaders[split]
    return len(cast(Sized, loader.dataset))  # the evaluation datasets have a length (torch's Dataset declares none)
