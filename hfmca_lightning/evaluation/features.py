"""Features of a whole data split, for offline evaluation (kNN grid, linear classifier, export)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = [
    "batch_norm_age",
    "batch_statistics_mode",
    "evaluation_mode",
    "extract_features",
    "frozen_batch_norm_statistics",
]


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


@contextmanager
def frozen_batch_norm_statistics(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers that track running statistics leave them as they are while inside (momentum 0), whatever
    their mode; on exit each gets back its momentum and batch count."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, tracked) in zip(norms, saved):
            norm.momentum = momentum
            if tracked is not None and norm.num_batches_tracked is not None:
                norm.num_batches_tracked.copy_(tracked)


@contextmanager
def batch_statistics_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode, except that BatchNorm normalises with each batch's own statistics, as in training, and leaves its
    running statistics as they are (:func:`frozen_batch_norm_statistics`); on exit every submodule gets back its
    mode."""
    with evaluation_mode(module), frozen_batch_norm_statistics(module):
        for norm in module.modules():
            if isinstance(norm, nn.modules.batchnorm._BatchNorm):
                norm.train()
        yield


def batch_norm_age(module: nn.Module) -> int | None:
    """The fewest batches any BatchNorm layer of ``module`` has tracked (its running statistics' age), or ``None``
    without BatchNorm."""
    counts = [
        int(m.num_batches_tracked)
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.num_batches_tracked is not None
    ]
    return min(counts) if counts else None


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
