"""Looking inside a trained HFMCAModule: statistics over data, spectra, density-ratio heatmaps, basis maps.

Glue between a module (its backbone hooks and heads) and the pure maths of :mod:`hfmca_lightning.analysis`;
used by the callbacks and by ``hfmca analyze``.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import Tensor

from hfmca_lightning.analysis.density_ratio import LayerPair, basis_function_maps, telescoping_response
from hfmca_lightning.analysis.spectral import decompose
from hfmca_lightning.losses.statistics import CorrelationStatistics, group_statistics
from hfmca_lightning.methods.hfmca import HFMCAModule

__all__ = ["collect_statistics", "spectra", "layer_pairs", "density_ratio_heatmaps", "layer_basis_maps"]


def _add(store: dict[str, CorrelationStatistics], name: str, stats: CorrelationStatistics) -> None:
    store[name] = store[name] + stats if name in store else stats


@torch.no_grad()
def collect_statistics(module: HFMCAModule, batches: Iterable[Tensor]) -> dict[str, CorrelationStatistics]:
    """Statistics of every cost pair (``external``, ``internal/<layer>``) summed over ``batches``, in eval mode.

    Each batch is ``(B, L, C, H, W)`` groups (needed for the external cost) or ``(B, C, H, W)`` images.
    """
    was_training = module.training
    module.eval()
    store: dict[str, CorrelationStatistics] = {}
    try:
        for batch in batches:
            batch = batch.to(module.device)
            with module.internal_costs.record() if module.internal_costs is not None else nullcontext():
                if module.external_head is not None and batch.dim() == 5:
                    view_features, group_features = module.encode_views(batch)
                    _add(store, "external", group_statistics(view_features, group_features))
                else:
                    module.backbone(batch.flatten(0, 1) if batch.dim() == 5 else batch)
            if module.internal_costs is not None:
                names = module.internal_costs.names
                for layer, stats in module.internal_costs.statistics().items():
                    _add(store, f"internal/{names[layer]}", stats)
    finally:
        module.train(was_training)
    return store


def spectra(module: HFMCAModule, statistics: dict[str, CorrelationStatistics]) -> dict[str, Tensor]:
    """Eigenvalues of every pair, each with the ``reg`` of its own cost."""
    costs = module.cost_modules()
    return {name: decompose(stats, reg=costs[name].reg).eigenvalues for name, stats in statistics.items()}


@torch.no_grad()
def layer_pairs(module: HFMCAModule, images: Tensor, statistics: dict[str, CorrelationStatistics] | None = None) -> list[LayerPair]:
    """The internal pairs of ``images (N, C, H, W)`` in backbone order, each with its Alg. 4 decomposition
    (from ``statistics`` when given, else from the statistics of these images)."""
    if module.internal_costs is None:
        raise ValueError("density-ratio heatmaps need internal costs (InternalCosts) on the backbone")
    internal = module.internal_costs
    was_training = module.training
    module.eval()
    try:
        with internal.record(keep_maps=True):
            module.backbone(images.to(module.device))
    finally:
        module.train(was_training)
    own = internal.statistics()
    maps = internal.maps()
    costs = internal.cost_modules()
    pairs = []
    for layer in internal.layers:
        name = internal.names[layer]
        stats = statistics.get(f"internal/{name}", own[layer]) if statistics else own[layer]
        low, high = maps[layer]
        pairs.append(LayerPair(name, low, high, internal.geometries[layer], decompose(stats, reg=costs[name].reg)))
    return pairs


def density_ratio_heatmaps(module: HFMCAModule, images: Tensor, statistics: dict[str, CorrelationStatistics] | None = None) -> dict[str, Tensor]:
    """Alg. 5 response ``{layer: (N, H_s, W_s)}`` on the input map of every hooked layer."""
    return telescoping_response(layer_pairs(module, images, statistics))


def layer_basis_maps(module: HFMCAModule, image: Tensor, layer: str, statistics: dict[str, CorrelationStatistics] | None = None) -> tuple[Tensor, Tensor]:
    """Normalised eigenfunctions of ``layer`` (log name) over one image ``(C, H, W)``: ``(r, H_s, W_s)`` maps
    and their eigenvalues."""
    pairs = {pair.name: pair for pair in layer_pairs(module, image[None], statistics)}
    if layer not in pairs:
        raise ValueError(f"no internal cost layer named {layer!r}; have {list(pairs)}")
    return basis_function_maps(pairs[layer].decomposition, pairs[layer].low_map[0]), pairs[layer].decomposition.eigenvalues
