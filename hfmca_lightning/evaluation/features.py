"""Features of a whole data split, for offline evaluation (kNN grid, linear classifier, export)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["evaluation_mode", "extract_features"]


@contextmanager
def evaluation_mode(module: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode (BatchNorm uses and keeps its running statistics, no dropout); on exit
    each submodule gets back its own mode (a frozen target network stays in eval mode)."""
    modes = {submodule: submodule.training for submodule in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for submodule, training in modes.items():
            submodule.training = training


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
