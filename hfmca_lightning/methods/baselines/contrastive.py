"""Contrastive baselines on lightly's losses and heads: SimCLR and MoCo v2."""

from __future__ import annotations

from typing import Any

import torch
from lightly.loss import NTXentLoss
from lightly.models.modules import MoCoProjectionHead, SimCLRProjectionHead
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from hfmca_lightning.errors import HFMCAWarning
from hfmca_lightning.methods.baselines.base import MomentumBaseline, ProjectedPairBaseline
from hfmca_lightning.methods.compatibility import ArchitectureMismatch
from hfmca_lightning.methods.optim import LRSchedulerCallable, OptimizerCallable

__all__ = ["SimCLR", "MoCo"]


class SimCLR(ProjectedPairBaseline):
    """SimCLR (Chen et al. 2020): NT-Xent between the projections of the first two views.

    Args:
        backbone: as :class:`SSLBaseline`; its ``feature_dim`` is the projection head's input.
        hidden_dim: hidden width of lightly's ``SimCLRProjectionHead`` (2 layers, BatchNorm).
        output_dim: size of the projections the loss compares.
        temperature: temperature of lightly's ``NTXentLoss``, finite and > 0 (its negatives: every process's
            projections under DDP).
        optimizer: as :class:`SSLBaseline`; ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4.
        lr_scheduler: as :class:`SSLBaseline`; ``None``: cosine annealing to 0 over the run.

    Raises:
        ConfigurationError: when a setting is out of range (as :class:`SSLBaseline`) or the backbone has no
            ``feature_dim``.
    """

    def __init__(
        self,
        backbone: nn.Module,
        hidden_dim: int = 512,
        output_dim: int = 128,
        temperature: float = 0.5,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, lr_scheduler)
        self.projection_head = SimCLRProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.criterion = NTXentLoss(temperature=temperature, gather_distributed=True)


MEMORY_BANK_KEY = "moco_memory_bank"  # the checkpoint's entry holding MoCo's memory bank


class MoCo(MomentumBaseline):
    """MoCo v2 (He et al. 2020; Chen et al. 2020): momentum key encoder and a memory bank of negatives.

    The memory bank (lightly's ``criterion.memory_bank``: ``bank`` ``(memory_bank_size, output_dim)`` and the write
    position ``bank_ptr``) is no part of the ``state_dict`` (lightly's buffers are not persistent); every checkpoint
    holds it under ``"moco_memory_bank"``, so a resumed run goes on with the keys it had (exact resume).

    Args:
        backbone: as :class:`SSLBaseline`; its momentum copy is the key encoder.
        hidden_dim: hidden width of lightly's ``MoCoProjectionHead`` (2 layers, no BatchNorm).
        output_dim: size of the projections (queries, keys and the memory bank's entries).
        temperature: temperature of lightly's ``NTXentLoss`` (> 0).
        memory_bank_size: number of past keys kept as negatives (lightly's ``memory_bank_size``; 0: the batch's
            other keys only); a resumed checkpoint's bank must have the same size.
        momentum: start of the key encoder's EMA momentum, raised to 1 on a cosine over the run's steps (lightly's
            ``cosine_schedule``); in [0, 1].
        optimizer: as :class:`SSLBaseline`; ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4.
        lr_scheduler: as :class:`SSLBaseline`; ``None``: cosine annealing to 0 over the run.

    Raises:
        ConfigurationError: when a setting is out of range (as :class:`SSLBaseline`) or the backbone has no
            ``feature_dim``.
    """

    max_views = 2
    backbone_names = ("backbone", "key_backbone")

    def __init__(
        self,
        backbone: nn.Module,
        hidden_dim: int = 512,
        output_dim: int = 128,
        temperature: float = 0.1,
        memory_bank_size: int = 4096,
        momentum: float = 0.99,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, lr_scheduler)
        self.projection_head = MoCoProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.key_backbone = self.momentum_copy(self.backbone)
        self.key_projection_head = self.momentum_copy(self.projection_head)
        self.momentum = momentum
        self.criterion = NTXentLoss(
            temperature=temperature, memory_bank_size=(memory_bank_size, output_dim), gather_distributed=True
        )

    def views_loss(self, views: list[Tensor]) -> Tensor:
        self.update_momentum_copies(
            [(self.backbone, self.key_backbone), (self.projection_head, self.key_projection_head)]
        )
        query = self.projection_head(self.backbone(views[0]))
        key = self.key_projection_head(self.key_backbone(views[1])).detach()
        return self.criterion(query, key)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        bank = self.criterion.memory_bank
        checkpoint[MEMORY_BANK_KEY] = {"bank": bank.bank.detach().clone(), "bank_ptr": bank.bank_ptr.detach().clone()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the memory bank; a checkpoint without one (written before banks were saved) keeps this module's,
        with a warning that the run is then not exact."""
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get(MEMORY_BANK_KEY)
        bank = self.criterion.memory_bank
        if saved is None:
            rank_zero_warn(
                "MoCo: the checkpoint holds no memory bank (written before banks were saved): training goes on with a "
                "fresh bank of random keys, so a resumed run is not exactly the run the checkpoint came from",
                category=HFMCAWarning,
            )
            return
        if tuple(saved["bank"].shape) != tuple(bank.bank.shape):
            details = f"memory bank: checkpoint {tuple(saved['bank'].shape)} vs model {tuple(bank.bank.shape)}"
            raise ArchitectureMismatch(
                f"the checkpoint's MoCo memory bank does not fit the model as configured ({details}: keys x "
                "features). Resume with the memory_bank_size and output_dim the checkpoint was trained with "
                "(saved as config.yaml in the run folder).",
                details,
            )
        with torch.no_grad():
            bank.bank.copy_(saved["bank"])
            bank.bank_ptr.copy_(saved["bank_ptr"])
