"""Plain, obviously-correct reference implementations used by the tests (loops, numpy, no tricks)."""

from __future__ import annotations

import numpy as np
import torch


def reference_group_moments(low: torch.Tensor, high: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """R1, R2, P of docs/conventions.md §1 by explicit loops over groups and members (float64 numpy)."""
    z = low.detach().double().numpy()
    h = high.detach().double().numpy()
    groups, members, k1 = z.shape
    k2 = h.shape[1]
    r1 = np.zeros((k1, k1))
    r2 = np.zeros((k2, k2))
    cross = np.zeros((k1, k2))
    for m in range(groups):
        for l in range(members):
            r1 += np.outer(z[m, l], z[m, l])
        r2 += np.outer(h[m], h[m])
        cross += np.outer(z[m].mean(axis=0), h[m])
    return r1 / (groups * members), r2 / groups, cross / groups


def reference_unfold_windows(low_map: torch.Tensor, high_map: torch.Tensor, kernel: int, stride: int, padding: int):
    """Unfold a block's windows by explicit loops: low (B*H'*W', kernel**2, K1), high (B*H'*W', K2).

    Padding positions are zero members, as the paper's PaddingLayer makes them part of Z_s.
    """
    z = low_map.detach().double()
    batch, k1, height, width = z.shape
    padded = torch.zeros(batch, k1, height + 2 * padding, width + 2 * padding, dtype=torch.float64)
    padded[:, :, padding : padding + height, padding : padding + width] = z
    out_h, out_w = high_map.shape[-2:]
    members, highs = [], []
    for b in range(batch):
        for i in range(out_h):
            for j in range(out_w):
                window = []
                for di in range(kernel):
                    for dj in range(kernel):
                        window.append(padded[b, :, i * stride + di, j * stride + dj])
                members.append(torch.stack(window))
                highs.append(high_map[b, :, i, j].detach().double())
    return torch.stack(members), torch.stack(highs)


def reference_cost(r1: np.ndarray, r2: np.ndarray, cross: np.ndarray, reg: float) -> float:
    """logdet J - logdet A - logdet C with numpy's slogdet."""
    a = r1 + reg * np.eye(r1.shape[0])
    c = r2 + reg * np.eye(r2.shape[0])
    joint = np.block([[a, cross], [cross.T, c]])
    return np.linalg.slogdet(joint)[1] - np.linalg.slogdet(a)[1] - np.linalg.slogdet(c)[1]


def reference_cost_autograd(low: torch.Tensor, high: torch.Tensor, reg: float) -> torch.Tensor:
    """logdet J - logdet A - logdet C of groups ``low (M, L, K1)``, ``high (M, K2)`` from the assembled matrices
    (``torch.linalg.slogdet``): differentiable by autograd's own formulas, no factor blocks, no surrogate."""
    groups, members, k1 = low.shape
    flat = low.reshape(-1, k1)
    r1 = flat.T @ flat / (groups * members)
    r2 = high.T @ high / groups
    cross = low.mean(dim=1).T @ high / groups
    a = r1 + reg * torch.eye(k1, dtype=low.dtype)
    c = r2 + reg * torch.eye(high.shape[1], dtype=high.dtype)
    joint = torch.cat([torch.cat([a, cross], dim=1), torch.cat([cross.T, c], dim=1)], dim=0)
    return torch.linalg.slogdet(joint)[1] - torch.linalg.slogdet(a)[1] - torch.linalg.slogdet(c)[1]
