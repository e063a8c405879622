"""Features of a whole data split, for offline evaluation (kNN grid, linear classifier, export)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from hfmca_lightning.evaluation.batch_norm import evaluation_mode

__all__ = ["extract_features"]


@torch.no_grad()
def extract_features(
    model: nn.Module, loader: Iterable[tuple[Tensor, Tensor]], device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """``model(images)`` over every ``(images, targets)`` batch of ``loader``, in eval mode on ``device``:
    ``(N, D)`` float32 features and ``(N,)`` targets, on the CPU, in loader order. The model's modes are restored."""
    features, targets = [], []
    with evaluation_mode(model):
        for images, labels in loader:
            features.append(model(images.to(device)).float().cpu())
            targets.append(torch.as_tensor(labels))
    if not features:
        raise ValueError("the loader yielded no batches")
    return torch.cat(features), torch.cat(targets)
