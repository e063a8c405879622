"""Internal HFMCA costs between the input and output maps of backbone blocks (paper §4, Alg. 2;
docs/conventions.md §3)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.hfmca_cost import HFMCACost
from hfmca_lightning.losses.statistics import (
    STATISTICS_PRECISIONS,
    CorrelationStatistics,
    StatisticsPrecision,
    feature_map_statistics,
)
from hfmca_lightning.losses.window_geometry import WindowGeometry, window_geometry

__all__ = ["InternalCosts", "InternalPair", "Recording", "internal_cost_name", "log_names"]


def internal_cost_name(log_name: str) -> str:
    """The cost name of an internal pair, ``internal/<log name>``: its log key ``cost/internal/L3`` and its
    key in every ``{cost name: ...}`` mapping (statistics, cost modules, spectra)."""
    return f"internal/{log_name}"


def log_names(layers: list[str]) -> list[str]:
    """Module paths without a first component that they all share: ``blocks.L3`` -> ``L3``, ``net.layer2.0`` ->
    ``layer2.0``; kept whole where that would leave a bare index (``features.0``)."""
    first = {layer.split(".", 1)[0] for layer in layers}
    if len(first) == 1 and all("." in layer for layer in layers):
        rest = [layer.split(".", 1)[1] for layer in layers]
        if not any(name.isdigit() for name in rest):  # features.0 stays features.0, not 0
            return rest
    return list(layers)


@dataclass
class InternalPair:
    """One hooked block: where it is, what it is called, its cost and its window geometry.

    ``module_path`` is the block's name in ``backbone.named_modules()`` (``blocks.L3``), ``log_name`` the short
    name of figures and logs (``L3``), ``cost_name`` = ``internal/<log_name>``; ``geometry`` is derived when
    the costs are attached to a backbone.
    """

    module_path: str
    log_name: str
    cost: HFMCACost
    geometry: WindowGeometry | None = None

    @property
    def cost_name(self) -> str:
        return internal_cost_name(self.log_name)


@dataclass
class Recording:
    """What the hooks saw during one :meth:`InternalCosts.record` block, by cost name (``internal/L3``):
    the statistics of every pair and, when asked, its detached ``(input map, output map)``. ``detached``:
    statistics of the detached maps (analysis of a training step: no graph kept for them)."""

    keep_maps: bool = False
    precision: StatisticsPrecision = "fast"
    detached: bool = False
    statistics: dict[str, CorrelationStatistics] = field(default_factory=dict)
    maps: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)


class InternalCosts(nn.Module):
    """One HFMCA cost per hooked block, between the block's input map ``Z_s`` and output map ``Z_{s+1}``.

    Forward hooks on the named modules of a backbone compute, inside a :meth:`record` block, the
    feature-map statistics of each block with the window geometry derived from its layers
    (:func:`~hfmca_lightning.losses.window_geometry`); the unfolded windows are never materialised. The
    statistics go into the :class:`Recording` that the block yields, a value the caller owns: the module
    itself keeps no per-batch state. Each pair has its own :class:`~hfmca_lightning.losses.HFMCACost`
    (own adaptive-filter buffers).

    Args:
        layers: module names inside the backbone (``backbone.named_modules()``), e.g. ``net.layer1.0`` for
            a ResNet BasicBlock or ``blocks.L3`` for :class:`~hfmca_lightning.models.SpectrumCNN`.
        weight: lambda of the paper's objective ``external + weight * sum(internal)``.
        reg: of every internal cost (see ``HFMCACost``).
        beta: of every internal cost (see ``HFMCACost``).
        sync_dist: of every internal cost (see ``HFMCACost``).
        precision: of the statistics in training, ``fast`` (float32 products summed in float64, see
            ``feature_map_statistics``), ``tf32x3`` (the same products on CUDA's tensor cores, as three TF32 products
            of split factors, within the same stated tolerance; exact float32 elsewhere), ``bf16`` (bfloat16 maps on
            bf16 tensor cores, exact products, float32 accumulation, bfloat16 gradients), ``auto`` (``bf16`` for the
            bfloat16 maps of bf16-mixed training on GPUs with bf16 tensor cores, ``fast`` otherwise) or ``float64``.
            Analysis uses ``float64``.
    """

    def __init__(
        self,
        layers: list[str],
        weight: float = 1.0,
        reg: float = 0.1,
        beta: float = 0.0,
        sync_dist: bool = False,
        precision: StatisticsPrecision = "fast",
    ) -> None:
        super().__init__()
        if not layers:
            raise ConfigurationError("internal costs need at least one layer name", parameter="layers")
        if len(set(layers)) != len(layers):
            raise ConfigurationError(f"internal cost layers must be distinct; got {layers}", parameter="layers")
        if not all(isinstance(layer, str) and layer.strip() for layer in layers):
            raise ConfigurationError(
                f"internal cost layers are module names, none empty; got {layers}", parameter="layers"
            )
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigurationError(
                f"weight is lambda of external + weight * sum(internal): finite and >= 0; got {weight} (a negative "
                "weight would maximise the internal costs)",
                parameter="weight",
            )
        if precision not in STATISTICS_PRECISIONS:
            raise ConfigurationError(
                f"precision must be one of {', '.join(STATISTICS_PRECISIONS)}; got {precision!r}", parameter="precision"
            )
        self.weight = weight
        self.precision = precision
        names = log_names(list(layers))
        # ModuleDict keys cannot hold dots; they name the cost buffers in checkpoints.
        costs = [HFMCACost(reg, beta, sync_dist, name=internal_cost_name(log)) for log in names]
        self.costs = nn.ModuleDict({path.replace(".", "/"): cost for path, cost in zip(layers, costs)})
        self.pairs = [InternalPair(path, log, cost) for path, log, cost in zip(layers, names, costs)]
        self._recording: Recording | None = None
        self._handles: list[Any] = []

    @property
    def layers(self) -> list[str]:
        """The hooked module paths, in the configured order."""
        return [pair.module_path for pair in self.pairs]

    def attach(self, backbone: nn.Module) -> None:
        """Register the forward hooks on ``backbone``'s named modules (once) and derive their geometries."""
        if self._handles:
            raise RuntimeError("InternalCosts is already attached to a backbone")
        modules = dict(backbone.named_modules())
        for pair in self.pairs:
            if pair.module_path not in modules:
                blocks = [name for name, module in modules.items() if name and list(module.children())]
                raise ConfigurationError(
                    f"internal cost layer {pair.module_path!r} is not a module of the backbone "
                    f"{type(backbone).__name__}; "
                    f"module names with children are: {', '.join(blocks[:40])}{' ...' if len(blocks) > 40 else ''}",
                    parameter="layers",
                )
            try:
                pair.geometry = window_geometry(modules[pair.module_path])
            except ValueError as error:
                hint = ""
                if any(isinstance(m, (nn.Linear, nn.MultiheadAttention)) for m in modules[pair.module_path].modules()):
                    hint = (
                        " Internal costs need blocks that map feature maps (B, C, H, W) through convolutions and "
                        "pooling; "
                        "transformer blocks (ViT, Swin) have no window geometry: train such backbones with the "
                        "external cost only."
                    )
                raise ConfigurationError(
                    f"internal cost layer {pair.module_path!r}: {error}{hint}", parameter="layers"
                ) from error
            self._handles.append(modules[pair.module_path].register_forward_hook(partial(self._hook, pair)))

    @torch.compiler.disable
    def _hook(self, pair: InternalPair, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # Eager under torch.compile (compile_backbone): the hook reads the recording of the current pass and adds
        # to it, state that a traced graph would freeze at its first call. The backbone graph breaks here.
        recording = self._recording
        if recording is None:
            return
        low = args[0] if args else None
        if not isinstance(low, Tensor) or not isinstance(output, Tensor) or low.dim() != 4 or output.dim() != 4:
            raise ConfigurationError(
                f"internal cost layer {pair.module_path!r} must map one (B, C, H, W) tensor to one (B, C', H', W') "
                "tensor"
            )
        try:
            # Re-derived on every pass (microseconds): a block's window may change after attach, e.g. SpectrumCNN
            # taking the layout of loaded weights.
            pair.geometry = window_geometry(module)
            if recording.detached:
                low, output = low.detach(), output.detach()
            stats = feature_map_statistics(low, output, pair.geometry, recording.precision)
        except ValueError as error:
            raise ConfigurationError(f"internal cost layer {pair.module_path!r}: {error}") from error
        # A block may run several times in one record block (views one at a time, chunks): statistics are
        # sums with counts, so they add up to those of the whole batch.
        previous = recording.statistics.get(pair.cost_name)
        recording.statistics[pair.cost_name] = stats if previous is None else previous + stats
        if recording.keep_maps:
            maps = (low.detach(), output.detach())
            if pair.cost_name in recording.maps:
                old_low, old_high = recording.maps[pair.cost_name]
                maps = (torch.cat([old_low, maps[0]]), torch.cat([old_high, maps[1]]))
            recording.maps[pair.cost_name] = maps

    @contextmanager
    def record(
        self, keep_maps: bool = False, precision: StatisticsPrecision | None = None, detached: bool = False
    ) -> Iterator[Recording]:
        """Collect the statistics (and, with ``keep_maps``, the detached maps) of the forward passes inside
        this block into the yielded :class:`Recording`, in ``precision`` (default: the configured one); with
        ``detached``, statistics without gradients."""
        recording = Recording(keep_maps, precision or self.precision, detached)
        self._recording = recording
        try:
            yield recording
        finally:
            self._recording = None

    def cost_modules(self) -> dict[str, HFMCACost]:
        """The per-pair cost modules by cost name (``internal/L3``)."""
        return {pair.cost_name: pair.cost for pair in self.pairs}
