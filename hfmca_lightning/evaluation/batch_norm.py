"""BatchNorm layers' statistics and modes: eval mode, each batch's own statistics (running ones frozen), those
recorded of another batch (analysis), and the running statistics' age."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor, nn

__all__ = [
    "BatchNormReference",
    "batch_norm_age",
    "batch_statistics_mode",
    "evaluation_mode",
    "frozen_batch_norm_statistics",
    "recorded_batch_norm",
    "reference_batch_norm_mode",
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


BatchNormReference = dict[str, tuple[Tensor, Tensor]]
"""Per BatchNorm layer (module name): the ``(C,)`` mean and biased variance of what it normalised in one batch
(:func:`recorded_batch_norm`)."""


def _batch_norms(module: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


@contextmanager
def recorded_batch_norm(module: nn.Module) -> Iterator[BatchNormReference]:
    """While inside, every BatchNorm layer's inputs are recorded; on exit the yielded dict holds, per layer, the mean
    and biased variance per channel of all it saw (float64): with ``batch_norm="batch"``, the statistics it
    normalised the batch with (pooled over its calls where one batch takes several: views passed one by one,
    backbone chunks)."""
    sums: dict[str, list[Tensor]] = {}  # name -> [count, mean, sum of squared deviations] (Chan et al.'s merge)

    def record(name: str, inputs: tuple[Tensor, ...]) -> None:
        x = inputs[0].detach()
        dims = [0, *range(2, x.dim())]
        variance, mean = torch.var_mean(x.to(torch.float64), dim=dims, unbiased=False)
        count = torch.tensor(float(x.numel() // x.shape[1]), dtype=torch.float64, device=x.device)
        if name not in sums:
            sums[name] = [count, mean, variance * count]
            return
        total, old_mean, squares = sums[name]
        delta = mean - old_mean
        merged = total + count
        sums[name] = [
            merged,
            old_mean + delta * count / merged,
            squares + variance * count + delta**2 * total * count / merged,
        ]

    reference: BatchNormReference = {}
    with ExitStack() as stack:
        for name, norm in _batch_norms(module).items():
            handle = norm.register_forward_pre_hook(lambda _m, inputs, name=name: record(name, inputs))
            stack.callback(handle.remove)
        yield reference
    reference.update({name: (mean, squares / count) for name, (count, mean, squares) in sums.items()})


@contextmanager
def reference_batch_norm_mode(module: nn.Module, reference: BatchNormReference) -> Iterator[None]:
    """Eval mode in which every BatchNorm layer of ``reference`` normalises with its recorded statistics (in place of
    its running ones, which are back on exit), the others with their running statistics: what a batch is normalised
    with then depends on none of its images, as ``batch_norm="batch"`` with the reference's batch."""
    norms = _batch_norms(module)
    saved = {name: (norm.running_mean, norm.running_var) for name, norm in norms.items() if name in reference}
    with evaluation_mode(module):
        try:
            for name in saved:
                mean, variance = reference[name]
                own: Tensor | None = norms[name].running_mean
                own = own if own is not None else norms[name].weight
                dtype = own.dtype if own is not None else torch.float32
                norms[name].running_mean, norms[name].running_var = mean.to(dtype), variance.to(dtype)
            yield
        finally:
            for name, (running_mean, running_var) in saved.items():
                norms[name].running_mean, norms[name].running_var = running_mean, running_var
