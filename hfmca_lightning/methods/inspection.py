"""Looking inside a trained HFMCAModule: statistics over data, spectra, density-ratio heatmaps, basis maps.

Glue between a module (its :meth:`~hfmca_lightning.methods.HFMCAModule.collect` forward pass) and the pure
maths of :mod:`hfmca_lightning.analysis`; used by the callbacks and by ``hfmca analyze``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Literal

import torch
from torch import Tensor, nn

from hfmca_lightning.analysis.density_ratio import LayerPair, basis_function_maps, telescoping_response
from hfmca_lightning.analysis.spectral import decompose
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation.batch_norm import (
    BatchNormReference,
    batch_statistics_mode,
    evaluation_mode,
    reference_batch_norm_mode,
)
from hfmca_lightning.losses.statistics import CorrelationStatistics
from hfmca_lightning.losses.window_geometry import WindowGeometry, input_geometry
from hfmca_lightning.methods.hfmca import Collected, HFMCAModule

__all__ = [
    "BatchNormStatistics",
    "analysis_mode",
    "collect_for_analysis",
    "collect_statistics",
    "default_figure_layers",
    "density_ratio_heatmaps",
    "layer_basis_maps",
    "nontrivial_basis_maps",
    "layer_pairs",
    "residual_blocks",
    "analysis_layers",
    "paper_order",
    "spectra",
]


RESIDUAL_BLOCK_TYPES = ("BasicBlock", "Bottleneck")


def residual_blocks(backbone: nn.Module) -> list[str]:
    """Module names of the backbone's residual blocks (torchvision and timm ResNets' ``BasicBlock`` /
    ``Bottleneck``), in forward order: the layers analysed by default for models trained without internal costs."""
    return [name for name, module in backbone.named_modules() if type(module).__name__ in RESIDUAL_BLOCK_TYPES]


def analysis_layers(backbone: nn.Module) -> list[str]:
    """The backbone modules analysed by default: the stages a backbone names itself (``internal_layers``: the spectrum
    CNN's ``blocks.L1`` .. ``blocks.L9``, ``SmallConvNet``'s ``features.0`` ..), else its residual blocks."""
    named = getattr(backbone, "internal_layers", None)
    return list(named) if named else residual_blocks(backbone)


def paper_order(names: Iterable[str]) -> list[str]:
    """Pair names in the paper's order (Fig. 4: L1 .. L9, then LF): internal pairs as given, ``external`` last."""
    names = list(names)
    return [name for name in names if name != "external"] + [name for name in names if name == "external"]


def default_figure_layers(log_names: list[str]) -> list[str]:
    """The layers drawn when none are chosen: the three lowest (the paper's figures show L2, L4, L6)."""
    return log_names[:3]


BatchNormStatistics = Literal["running", "batch"]


def analysis_mode(
    module: nn.Module, batch_norm: BatchNormStatistics, reference: BatchNormReference | None = None
) -> AbstractContextManager[None]:
    """Eval mode, BatchNorm with its ``running`` statistics or each ``batch``'s own (the running ones untouched);
    with a ``reference`` (``batch`` only), those recorded of another batch (:func:`reference_batch_norm_mode`)."""
    if batch_norm == "running":
        return evaluation_mode(module)
    return batch_statistics_mode(module) if reference is None else reference_batch_norm_mode(module, reference)


@torch.no_grad()
def collect_for_analysis(
    module: HFMCAModule,
    batch: Tensor | Sequence[Tensor],
    keep_maps: bool = False,
    batch_norm: BatchNormStatistics = "running",
    reference: BatchNormReference | None = None,
) -> Collected:
    """:meth:`HFMCAModule.collect` of ``batch`` (or groups of views of different sizes) in eval mode, without
    gradients, on the module's device and in its floating dtype (a run in "64-true" has float64 weights), with
    float64 statistics; BatchNorm with its ``running`` statistics or each ``batch``'s own (as in training, the
    running ones untouched), or with ``batch`` and a ``reference``, those of the reference's batch."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    groups = [batch] if isinstance(batch, Tensor) else list(batch)
    moved = [group.to(module.device, dtype) for group in groups]
    on_device: Tensor | list[Tensor] = moved[0] if isinstance(batch, Tensor) else moved
    with analysis_mode(module, batch_norm, reference):
        return module.collect(on_device, keep_maps=keep_maps, precision="float64")


def collect_statistics(
    module: HFMCAModule, batches: Iterable[Tensor | Sequence[Tensor]], batch_norm: BatchNormStatistics = "running"
) -> dict[str, CorrelationStatistics]:
    """Statistics of every cost pair (``external``, ``internal/<layer>``) summed over ``batches``, in eval mode
    (BatchNorm as ``batch_norm`` says).

    Each batch is ``(B, L, C, H, W)`` groups (needed for the external cost; a list of them for views of different
    sizes) or ``(B, C, H, W)`` images.
    """
    store: dict[str, CorrelationStatistics] = {}
    for batch in batches:
        for name, stats in collect_for_analysis(module, batch, batch_norm=batch_norm).statistics.items():
            store[name] = store[name] + stats if name in store else stats
    return store


def spectra(module: HFMCAModule, statistics: dict[str, CorrelationStatistics]) -> dict[str, Tensor]:
    """Eigenvalues of every pair, each with the ``reg`` of its own cost."""
    costs = module.cost_modules()
    return {name: decompose(stats, reg=costs[name].reg).eigenvalues for name, stats in statistics.items()}


def layer_pairs(
    module: HFMCAModule,
    images: Tensor,
    statistics: dict[str, CorrelationStatistics] | None = None,
    batch_norm: BatchNormStatistics = "running",
    reference: BatchNormReference | None = None,
) -> list[LayerPair]:
    """The internal pairs of ``images (N, C, H, W)`` in backbone order, each with its Alg. 4 decomposition
    (from ``statistics`` when given, else from the statistics of these images), named by log name (``L3``).
    BatchNorm as :func:`collect_for_analysis`: with ``batch`` and no ``reference``, an image's maps depend on the
    other images drawn; a ``reference`` (:func:`recorded_batch_norm` of a training batch) keeps them its own."""
    if module.internal_costs is None:
        raise ConfigurationError(
            "density-ratio heatmaps and basis functions need internal costs (InternalCosts) on the backbone"
        )
    collected = collect_for_analysis(module, images, keep_maps=True, batch_norm=batch_norm, reference=reference)
    pairs = []
    for pair in module.internal_costs.pairs:
        stats = (statistics or {}).get(pair.cost_name, collected.statistics[pair.cost_name])
        low, high = collected.maps[pair.cost_name]
        assert pair.geometry is not None
        pairs.append(LayerPair(pair.log_name, low, high, pair.geometry, decompose(stats, reg=pair.cost.reg)))
    return pairs


def heatmap_placements(module: HFMCAModule) -> dict[str, WindowGeometry]:
    """``{log name: geometry from the image to the layer's input map}`` for every hooked layer whose position in
    the image can be derived (:func:`~hfmca_lightning.losses.input_geometry`); figures place heatmaps with it."""
    placements: dict[str, WindowGeometry] = {}
    for pair in module.internal_costs.pairs if module.internal_costs is not None else []:
        try:
            placements[pair.log_name] = input_geometry(module.backbone, pair.module_path)
        except ValueError:
            continue  # a module without a fixed window before it: the figure stretches this map over the image
    return placements


def density_ratio_heatmaps(
    module: HFMCAModule, images: Tensor, statistics: dict[str, CorrelationStatistics] | None = None
) -> dict[str, Tensor]:
    """Alg. 5 response ``{layer: (N, H_s, W_s)}`` on the input map of every hooked layer."""
    return telescoping_response(layer_pairs(module, images, statistics))


def layer_basis_maps(
    module: HFMCAModule, image: Tensor, layer: str, statistics: dict[str, CorrelationStatistics] | None = None
) -> tuple[Tensor, Tensor]:
    """Normalised eigenfunctions of ``layer`` (log name) over one image ``(C, H, W)`` after the constant function:
    ``(r - 1, H_s, W_s)`` maps and their eigenvalues (docs/conventions.md §4)."""
    pairs = {pair.name: pair for pair in layer_pairs(module, image[None], statistics)}
    if layer not in pairs:
        raise ConfigurationError(f"no internal cost layer named {layer!r}; have {list(pairs)}")
    return nontrivial_basis_maps(pairs[layer])


def nontrivial_basis_maps(pair: LayerPair) -> tuple[Tensor, Tensor]:
    """The normalised eigenfunctions of ``pair`` over its first image after the constant function, left out of
    every count and figure (docs/conventions.md §4): ``(r - 1, H_s, W_s)`` maps and their eigenvalues."""
    maps = basis_function_maps(pair.decomposition, pair.low_map[0])
    return maps[1:], pair.decomposition.eigenvalues[1:]
