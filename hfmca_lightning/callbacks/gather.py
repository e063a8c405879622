"""Evaluation rows of all processes, in dataset order: what the evaluation callbacks score."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule

__all__ = ["gather_in_dataset_order"]


def gather_in_dataset_order(
    pl_module: LightningModule, pieces: list[torch.Tensor], dataset_length: int
) -> torch.Tensor:
    """This process's rows ``cat(pieces)``, or under DDP every process's rows in dataset order without the
    distributed sampler's padding (row ``j`` of rank ``r`` is sample ``j * world_size + r``)."""
    local = torch.cat(pieces)
    world = pl_module.trainer.world_size
    if world == 1:
        return local
    gathered = pl_module.all_gather(local)  # (W, n_per_rank, ...)
    ordered = gathered.transpose(0, 1).reshape(-1, *local.shape[1:])
    return ordered[:dataset_length]
