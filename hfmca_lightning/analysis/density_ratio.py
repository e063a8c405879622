"""Global-to-local density-ratio response: the telescoping propagation of paper Alg. 5 (docs/conventions.md §4).

Starting from ``varrho = 1`` on the top map, each cost pair ``(Z_s, Z_{s+1})`` sends the response down:

    varrho_s(p) = sum over output positions q whose window contains p of
                  varrho_{s+1}(q) * rho_hat_{s,s+1}(Z_s(p), Z_{s+1}(q)),

with ``rho_hat`` the Alg. 4 local density ratio. The sum over windows is a transposed convolution with a
ones kernel, so nothing is unfolded. Padding positions are no window members (docs/conventions.md §3): the
response is computed on the input map's positions only, and whatever falls on the padding ring is cropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hfmca_lightning.analysis.spectral import SpectralDecomposition
from hfmca_lightning.losses.window_geometry import WindowGeometry

__all__ = ["LayerPair", "propagate_response", "telescoping_response", "bridge_response", "basis_function_maps"]


@dataclass(frozen=True)
class LayerPair:
    """One cost pair of a network for one batch: ``low_map (B, K1, H, W)``, ``high_map (B, K2, H', W')``."""

    name: str
    low_map: Tensor
    high_map: Tensor
    geometry: WindowGeometry
    decomposition: SpectralDecomposition


def _channels_last_basis(basis, feature_map: Tensor) -> Tensor:
    """Apply a ``(..., K) -> (..., r)`` basis to a ``(B, K, H, W)`` map -> ``(B, r, H, W)``."""
    return basis(feature_map.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def propagate_response(response_above: Tensor, pair: LayerPair) -> Tensor:
    """One step of Alg. 5: ``(B, H', W')`` response on the high map -> ``(B, H, W)`` on the low map."""
    geometry, decomposition = pair.geometry, pair.decomposition
    k, s, p = geometry.kernel, geometry.stride, geometry.padding
    if tuple(response_above.shape) != (pair.high_map.shape[0], *pair.high_map.shape[-2:]):
        raise ValueError(
            f"response {tuple(response_above.shape)} does not match the high map {tuple(pair.high_map.shape)} of "
            f"{pair.name}"
        )
    padded = F.pad(pair.low_map.to(torch.float64), (p, p, p, p))
    phi = _channels_last_basis(decomposition.low_basis, padded)  # (B, r, H + 2p, W + 2p)
    psi = _channels_last_basis(decomposition.high_basis, pair.high_map)  # (B, r, H', W')
    weighted = psi * decomposition.eigenvalues.sqrt()[None, :, None, None] * response_above[:, None].to(torch.float64)
    rank = weighted.shape[1]
    ones = torch.ones(rank, 1, k, k, dtype=torch.float64, device=weighted.device)
    spread = F.conv_transpose2d(weighted, ones, stride=s, groups=rank)  # sum over windows containing each position
    height, width = min(spread.shape[-2], phi.shape[-2]), min(spread.shape[-1], phi.shape[-1])
    response = torch.zeros(phi.shape[0], *phi.shape[-2:], dtype=torch.float64, device=phi.device)
    response[:, :height, :width] = (phi[..., :height, :width] * spread[..., :height, :width]).sum(dim=1)
    return response[:, p : p + pair.low_map.shape[-2], p : p + pair.low_map.shape[-1]]


def bridge_response(response: Tensor, size: tuple[int, int]) -> Tensor:
    """Carry a response from a pair's low map to the (larger) high map of the pair below.

    Between hooked blocks there may be parameter-free pooling (e.g. the 2x2 average pools of the
    spectrum CNN). Such a step has no cost pair, so its density ratio is taken as 1: every position of
    the larger map receives the response of the pooled position whose window contains it.
    """
    height, width = response.shape[-2:]
    if (height, width) == tuple(size):
        return response
    factor_h, factor_w = size[0] // height, size[1] // width
    remainder_h, remainder_w = size[0] - height * factor_h, size[1] - width * factor_w
    if factor_h < 1 or factor_h != factor_w or not (0 <= remainder_h < factor_h and 0 <= remainder_w < factor_w):
        raise ValueError(
            f"cannot bridge a {height}x{width} response to a {size[0]}x{size[1]} map (not an integer pooling)"
        )
    spread = response.repeat_interleave(factor_h, dim=-2).repeat_interleave(factor_w, dim=-1)
    return F.pad(spread, (0, size[1] - spread.shape[-1], 0, size[0] - spread.shape[-2]))


def telescoping_response(pairs: list[LayerPair]) -> dict[str, Tensor]:
    """Alg. 5 over a chain of pairs ordered bottom to top: ``varrho_S = 1`` on the top pair's high map.

    Returns:
        ``{pair name: (B, H_s, W_s)}`` — the response on each pair's low map ``Z_s``.
    """
    if not pairs:
        raise ValueError("telescoping_response needs at least one layer pair")
    top = pairs[-1].high_map
    response = torch.ones(top.shape[0], *top.shape[-2:], dtype=torch.float64, device=top.device)
    responses: dict[str, Tensor] = {}
    for index in range(len(pairs) - 1, -1, -1):
        pair = pairs[index]
        height, width = pair.high_map.shape[-2:]
        response = propagate_response(bridge_response(response, (height, width)), pair)
        responses[pair.name] = response
    return dict(reversed(list(responses.items())))


def basis_function_maps(decomposition: SpectralDecomposition, low_map: Tensor) -> Tensor:
    """Normalised eigenfunctions ``phi_hat_k`` of one layer over a ``(K1, H, W)`` map -> ``(r, H, W)``."""
    return _channels_last_basis(decomposition.low_basis, low_map[None])[0]
