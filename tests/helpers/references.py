"""Plain reference implementations (loops over groups and windows, numpy) that the package's fast paths are checked
against."""

from __future__ import annotations

import numpy as np
import torch


def reference_group_moments(
    low: torch.Tensor, high: torch.Tensor, real: torch.Tensor | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """R1, R2, P of docs/conventions.md §1 by explicit loops over groups and members (float64 numpy). ``real (M, L)``
    marks the members of groups with fewer than ``L`` (windows at a padded border): each group's member means are
    then taken over its own members."""
    z = low.detach().double().numpy()
    h = high.detach().double().numpy()
    groups, members, k1 = z.shape
    mask = np.ones((groups, members), dtype=bool) if real is None else real.numpy()
    k2 = h.shape[1]
    r1 = np.zeros((k1, k1))
    r2 = np.zeros((k2, k2))
    cross = np.zeros((k1, k2))
    for m in range(groups):
        own = z[m][mask[m]]
        for member in own:
            r1 += np.outer(member, member) / len(own)
        r2 += np.outer(h[m], h[m])
        cross += np.outer(own.mean(axis=0), h[m])
    return r1 / groups, r2 / groups, cross / groups


def reference_unfold_windows(low_map: torch.Tensor, high_map: torch.Tensor, kernel: int, stride: int, padding: int):
    """Unfold a block's windows by explicit loops: low ``(B*H'*W', kernel**2, K1)`` (zeros where a window reaches
    into the padding), high ``(B*H'*W', K2)``, and ``real (B*H'*W', kernel**2)``: which members lie on the map (the
    others are no members, docs/conventions.md §3)."""
    z = low_map.detach().double()
    batch, k1, height, width = z.shape
    out_h, out_w = high_map.shape[-2:]
    members, highs, real = [], [], []
    for b in range(batch):
        for i in range(out_h):
            for j in range(out_w):
                window, inside = [], []
                for di in range(kernel):
                    for dj in range(kernel):
                        y, x = i * stride + di - padding, j * stride + dj - padding
                        on_map = 0 <= y < height and 0 <= x < width
                        window.append(z[b, :, y, x] if on_map else torch.zeros(k1, dtype=torch.float64))
                        inside.append(on_map)
                members.append(torch.stack(window))
                real.append(torch.tensor(inside))
                highs.append(high_map[b, :, i, j].detach().double())
    return torch.stack(members), torch.stack(highs), torch.stack(real)


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
