"""RankMe: the effective rank of a batch of embeddings (Garrido et al., *RankMe: Assessing the downstream performance
of pretrained self-supervised representations by their rank*, ICML 2023), a label-free measure of collapse."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rankme"]

EPSILON = 1e-7  # the paper's epsilon, added to every normalised singular value


def rankme(features: Tensor) -> Tensor:
    """RankMe, the effective rank of a batch of embeddings: ``exp(-sum_k p_k log p_k)`` with
    ``p_k = s_k / ||s||_1 + eps``, ``s`` the singular values of ``features`` (float64).

    Args:
        features: ``(N, D)`` embeddings (detached).

    Returns:
        0-dim float64 tensor between 1 (every embedding on one line) and ``min(N, D)`` (all directions used alike).

    Raises:
        ValueError: when ``features`` is not a non-empty ``(N, D)`` matrix.
    """
    if features.dim() != 2 or min(features.shape) == 0:
        raise ValueError(f"rankme needs a non-empty (N, D) matrix of embeddings; got shape {tuple(features.shape)}")
    singular = torch.linalg.svdvals(features.detach().to(torch.float64))
    p = singular / singular.sum().clamp_min(torch.finfo(torch.float64).tiny) + EPSILON
    return torch.exp(-(p * torch.log(p)).sum())
