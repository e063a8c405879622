"""A device drawer's batches as a training step gets them, without a Trainer: the data module's
``on_after_batch_transfer`` with a stand-in for the little of a trainer it reads (the device is the CPU)."""

from __future__ import annotations

from typing import Any

import torch

from hfmca_lightning.data import MultiViewDataModule

CPU = torch.device("cpu")


class TrainerStandIn:
    """What the data module's ``setup`` and ``on_after_batch_transfer`` read of a trainer (no module: its loader
    index is not checked)."""

    class strategy:  # noqa: N801 - an attribute of the trainer
        root_device = CPU

    class precision_plugin:  # noqa: N801 - an attribute of the trainer
        @staticmethod
        def convert_input(batch: Any) -> Any:
            return batch

    training, global_rank, world_size, num_devices = True, 0, 1, 1
    lightning_module, limit_val_batches = None, 1.0


def drawn(module: MultiViewDataModule, batch: Any) -> Any:
    """A device drawer's batch after the transfer, as the training step gets it."""
    module.trainer = TrainerStandIn()  # type: ignore[assignment]
    return module.on_after_batch_transfer(batch, 0)


def epoch_batches(module: MultiViewDataModule) -> list[Any]:
    """Every training batch of one epoch as the training steps get them, whatever the drawer."""
    batches = list(module.train_dataloader())
    if module.drawer.draws_on_device:
        batches = [drawn(module, batch) for batch in batches]
    return batches
