"""The evaluation steps every method shares: backbone features for :class:`~hfmca_lightning.callbacks.KNNEvaluation`."""

from __future__ import annotations

from torch import Tensor

__all__ = ["KNNFeatureSteps"]


class KNNFeatureSteps:
    """Mixin for LightningModules whose ``forward`` returns backbone features ``(N, D)``.

    ``validation_step`` / ``test_step`` return ``{"features", "targets"}`` for every evaluation loader of
    :class:`~hfmca_lightning.data.MultiViewDataModule` (``BANK`` and ``QUERIES``).
    """

    def validation_step(
        self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        images, targets = batch
        return {"features": self(images), "targets": targets}  # type: ignore[operator]  # mixed into LightningModules

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        return self.validation_step(batch, batch_idx, dataloader_idx)
