"""Linear evaluation of frozen features (the protocol of SimCLR, solo-learn and lightly's offline tables).

Pure torch: features in, a trained classifier and top-k accuracies out. The features are standardised with
the training split's mean and standard deviation (the classifier sees the same scale whatever the method; a feature
constant on the training split is only centred, as scikit-learn's ``StandardScaler`` does), then a linear layer is
trained by SGD with momentum and a cosine learning-rate schedule on shuffled mini-batches drawn from a seeded
generator, so two calls with the same arguments give the same classifier. A loss that turns NaN or Inf (a learning
rate far too large) stops the training with :class:`NonFiniteLossError`, read once per epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.functional.classification import multiclass_accuracy

__all__ = [
    "LinearClassifier",
    "NonFiniteLossError",
    "class_balanced_subset",
    "classes_raised_to_one_image",
    "topk_accuracies",
    "train_linear_classifier",
]


class NonFiniteLossError(RuntimeError):
    """A classifier's training loss became NaN or Inf: its weights are no longer usable, and no accuracy is given."""


@dataclass
class LinearClassifier:
    """A standardisation ``(x - mean) / std`` (``std`` 1 for features constant in training) followed by ``linear``:
    ``(N, D)`` features -> ``(N, C)`` logits."""

    mean: Tensor
    std: Tensor
    linear: nn.Linear

    @torch.no_grad()
    def logits(self, features: Tensor) -> Tensor:
        return self.linear((features.float() - self.mean) / self.std)


def topk_accuracies(logits: Tensor, targets: Tensor, num_classes: int, ks: Sequence[int] = (1, 5)) -> dict[int, float]:
    """Top-k accuracy in [0, 1] for every ``k`` in ``ks`` (each capped at ``num_classes``), micro-averaged over
    samples."""
    return {
        k: float(
            multiclass_accuracy(logits, targets, num_classes=num_classes, top_k=min(k, num_classes), average="micro")
        )
        for k in ks
    }


def class_balanced_subset(targets: Tensor, fraction: float, seed: int = 0) -> Tensor:
    """Indices of ``fraction`` of the samples, the same share of every class (at least one per class): the
    semi-supervised protocol's 1 % / 10 % label subsets. ``fraction=1`` returns every index in order."""
    if not 0 < fraction <= 1:
        raise ValueError(f"label fraction must be in (0, 1]; got {fraction}")
    if fraction == 1:
        return torch.arange(len(targets))
    generator = torch.Generator().manual_seed(seed)
    chosen = []
    for label in torch.unique(targets):
        members = torch.nonzero(targets == label).flatten()
        count = max(1, round(fraction * len(members)))
        chosen.append(members[torch.randperm(len(members), generator=generator)[:count]])
    return torch.cat(chosen).sort().values


def classes_raised_to_one_image(targets: Tensor, fraction: float) -> int:
    """How many classes :func:`class_balanced_subset` gives one image though ``fraction`` of theirs rounds to none."""
    return sum(1 for count in torch.unique(targets, return_counts=True)[1].tolist() if round(fraction * count) < 1)


def standardisation(features: Tensor) -> tuple[Tensor, Tensor]:
    """The ``(D,)`` mean and scale that standardise ``(N, D)`` float32 features: the standard deviation (divided by
    ``N``), and 1 for a feature constant on these samples (its variance within the round-off of computing it,
    scikit-learn's ``StandardScaler`` rule), so that a feature silent in training and active at test (a sparse ReLU
    unit) is not multiplied by a huge factor there."""
    values = features.to(torch.float32 if features.device.type == "mps" else torch.float64)  # MPS has no float64
    mean = values.mean(dim=0)
    variance = values.var(dim=0, unbiased=False)
    samples, eps = values.shape[0], torch.finfo(values.dtype).eps
    round_off = samples * eps * variance + (samples * mean * eps) ** 2
    constant = variance <= round_off
    std = torch.where(constant, torch.ones_like(variance), variance.sqrt())
    return mean.to(features.dtype), std.to(features.dtype)


def train_linear_classifier(
    features: Tensor,
    targets: Tensor,
    num_classes: int,
    *,
    epochs: int = 100,
    batch_size: int = 256,
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> LinearClassifier:
    """Train a linear classifier on fixed ``(N, D)`` features with ``(N,)`` integer targets.

    SGD (``lr`` scaled by ``batch_size / 256``, Nesterov momentum) with a cosine schedule over
    ``epochs * ceil(N / batch_size)`` steps; cross-entropy loss. Runs on the features' device.

    Raises:
        NonFiniteLossError: when the loss of a step is NaN or Inf (checked at the end of each epoch: one host read).
    """
    if features.dim() != 2 or features.shape[0] != targets.shape[0]:
        raise ValueError(
            f"need (N, D) features and (N,) targets; got {tuple(features.shape)} and {tuple(targets.shape)}"
        )
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"need epochs >= 1 and batch_size >= 1; got {epochs} and {batch_size}")
    features = features.float()
    mean, std = standardisation(features)
    standardised = (features - mean) / std
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(features.shape[1], num_classes).to(features.device)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator).mul_(0.01))
        linear.bias.zero_()
    steps_per_epoch = -(-features.shape[0] // batch_size)
    optimizer = torch.optim.SGD(
        linear.parameters(), lr=lr * batch_size / 256, momentum=momentum, nesterov=True, weight_decay=weight_decay
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * steps_per_epoch)
    targets = targets.to(features.device)
    with torch.enable_grad():
        for epoch in range(epochs):
            order = torch.randperm(features.shape[0], generator=generator).to(features.device)
            finite = torch.ones((), dtype=torch.bool, device=features.device)
            for batch in order.split(batch_size):
                loss = F.cross_entropy(linear(standardised[batch]), targets[batch])
                finite &= torch.isfinite(loss.detach())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
            if not bool(finite):
                raise NonFiniteLossError(
                    f"the linear classifier's loss became NaN or Inf in epoch {epoch + 1} of {epochs}: lower the "
                    f"learning rate (lr {lr:g})"
                )
    linear.eval()
    return LinearClassifier(mean, std, linear)
