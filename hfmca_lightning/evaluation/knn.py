"""Weighted k-nearest-neighbour classification of embeddings (paper Table 1 / lightly protocol, docs/conventions.md
§6)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["knn_predict", "knn_accuracy", "knn_grid"]


def knn_predict(
    queries: Tensor,
    bank: Tensor,
    bank_targets: Tensor,
    num_classes: int,
    *,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 1024,
) -> Tensor:
    """Top-1 class of each query by a similarity-weighted vote of its ``k`` nearest bank features.

    Features are L2-normalised; similarity is the cosine; neighbour ``j`` votes for its class with weight
    ``exp(cos_j / temperature)``, computed relative to the nearest neighbour's (no temperature overflows). Queries
    are processed in chunks of ``chunk_size`` so the ``(Q, N)`` similarity matrix never exists at once.

    Args:
        queries: ``(Q, D)``; bank: ``(N, D)``; bank_targets: ``(N,)`` int in ``[0, num_classes)``.
        k: neighbours (capped at ``N``). temperature: > 0.

    Returns:
        ``(Q,)`` predicted classes.
    """
    if queries.dim() != 2 or bank.dim() != 2 or queries.shape[1] != bank.shape[1]:
        raise ValueError(f"need (Q, D) queries and (N, D) bank; got {tuple(queries.shape)} and {tuple(bank.shape)}")
    if bank.shape[0] != bank_targets.shape[0]:
        raise ValueError(f"bank has {bank.shape[0]} features but {bank_targets.shape[0]} targets")
    if k < 1 or temperature <= 0:
        raise ValueError(f"need k >= 1 and temperature > 0; got k={k}, temperature={temperature}")
    k = min(k, bank.shape[0])
    bank = F.normalize(bank.float(), dim=1)
    predictions = []
    for chunk in F.normalize(queries.float(), dim=1).split(chunk_size):
        similarity, neighbours = (chunk @ bank.T).topk(k, dim=1)
        votes = torch.zeros(chunk.shape[0], num_classes, device=chunk.device)
        # exp((cos_j - cos_1) / t): the same ranking of the classes, without overflow at small temperatures
        weights = ((similarity - similarity[:, :1]) / temperature).exp()
        votes.scatter_add_(1, bank_targets[neighbours], weights)
        predictions.append(votes.argmax(dim=1))
    return torch.cat(predictions) if predictions else torch.empty(0, dtype=torch.long, device=queries.device)


def knn_accuracy(
    queries: Tensor,
    query_targets: Tensor,
    bank: Tensor,
    bank_targets: Tensor,
    num_classes: int,
    *,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 1024,
) -> float:
    """Top-1 accuracy in [0, 1] of :func:`knn_predict` on labelled queries."""
    predicted = knn_predict(
        queries, bank, bank_targets, num_classes, k=k, temperature=temperature, chunk_size=chunk_size
    )
    return (predicted == query_targets).float().mean().item()


def knn_grid(
    queries: Tensor,
    query_targets: Tensor,
    bank: Tensor,
    bank_targets: Tensor,
    num_classes: int,
    ks: Sequence[int],
    temperatures: Sequence[float],
) -> list[dict[str, float]]:
    """:func:`knn_accuracy` for every ``(k, temperature)``: rows ``{"k", "temperature", "top1"}``, k-major, each ``k``
    as used (at most the bank's size: a larger one votes with the whole bank, and is reported as that size, once)."""
    used = list(dict.fromkeys(min(k, bank.shape[0]) for k in ks))
    return [
        {
            "k": k,
            "temperature": t,
            "top1": knn_accuracy(queries, query_targets, bank, bank_targets, num_classes, k=k, temperature=t),
        }
        for k in used
        for t in temperatures
    ]
