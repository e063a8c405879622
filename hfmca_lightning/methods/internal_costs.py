"""Internal HFMCA costs between the input and output maps of backbone blocks (paper §4, Alg. 2; SPEC §3)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.hfmca_cost import HFMCACost
from hfmca_lightning.losses.statistics import CorrelationStatistics, feature_map_statistics
from hfmca_lightning.losses.window_geometry import WindowGeometry, window_geometry

__all__ = ["InternalCosts"]


def _log_names(layers: list[str]) -> list[str]:
    """Module paths without a first component that they all share: ``blocks.L3`` -> ``L3``, ``net.layer2.0`` -> ``layer2.0``."""
    first = {layer.split(".", 1)[0] for layer in layers}
    if len(first) == 1 and all("." in layer for layer in layers):
        return [layer.split(".", 1)[1] for layer in layers]
    return list(layers)


class InternalCosts(nn.Module):
    """One HFMCA cost per hooked block, between the block's input map ``Z_s`` and output map ``Z_{s+1}``.

    Forward hooks on the named modules of a backbone collect, while :meth:`record` is active, the
    feature-map statistics of each block with the window geometry derived from its layers
    (:func:`~hfmca_lightning.losses.window_geometry`); the unfolded windows are never materialised.
    Each pair has its own :class:`~hfmca_lightning.losses.HFMCACost` (own adaptive-filter state).

    Args:
        layers: module names inside the backbone (``backbone.named_modules()``), e.g. ``net.layer1.0`` for
            a ResNet BasicBlock or ``blocks.L3`` for :class:`~hfmca_lightning.models.SpectrumCNN`.
        weight: lambda of the paper's objective ``external + weight * sum(internal)``.
        reg, beta, sync_dist: of every internal cost (see ``HFMCACost``).
    """

    def __init__(self, layers: list[str], weight: float = 1.0, reg: float = 0.1, beta: float = 0.0, sync_dist: bool = False) -> None:
        super().__init__()
        if not layers:
            raise ConfigurationError("internal costs need at least one layer name")
        if len(set(layers)) != len(layers):
            raise ConfigurationError(f"internal cost layers must be distinct; got {layers}")
        self.layers = list(layers)
        self.weight = weight
        self.names = dict(zip(self.layers, _log_names(self.layers)))
        self.costs = nn.ModuleDict(
            {self._key(layer): HFMCACost(reg, beta, sync_dist, name=f"internal/{self.names[layer]}") for layer in self.layers}
        )
        self.geometries: dict[str, WindowGeometry] = {}
        self._statistics: dict[str, CorrelationStatistics] = {}
        self._maps: dict[str, tuple[Tensor, Tensor]] = {}
        self._recording = False
        self._keep_maps = False
        self._handles: list[Any] = []

    @staticmethod
    def _key(layer: str) -> str:
        return layer.replace(".", "/")

    def attach(self, backbone: nn.Module) -> None:
        """Register the forward hooks on ``backbone``'s named modules (once)."""
        if self._handles:
            raise RuntimeError("InternalCosts is already attached to a backbone")
        modules = dict(backbone.named_modules())
        for layer in self.layers:
            if layer not in modules:
                blocks = [name for name, module in modules.items() if name and list(module.children())]
                raise ConfigurationError(
                    f"internal cost layer {layer!r} is not a module of the backbone {type(backbone).__name__}; "
                    f"module names with children are: {', '.join(blocks[:40])}{' ...' if len(blocks) > 40 else ''}"
                )
            try:
                self.geometries[layer] = window_geometry(modules[layer])
            except ValueError as error:
                raise ConfigurationError(f"internal cost layer {layer!r}: {error}") from error
            self._handles.append(modules[layer].register_forward_hook(partial(self._hook, layer)))

    def _hook(self, layer: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._recording:
            return
        low = args[0] if args else None
        if not isinstance(low, Tensor) or not isinstance(output, Tensor) or low.dim() != 4 or output.dim() != 4:
            raise ConfigurationError(
                f"internal cost layer {layer!r} must map one (B, C, H, W) tensor to one (B, C', H', W') tensor"
            )
        try:
            self._statistics[layer] = feature_map_statistics(low, output, self.geometries[layer])
        except ValueError as error:
            raise ConfigurationError(f"internal cost layer {layer!r}: {error}") from error
        if self._keep_maps:
            self._maps[layer] = (low.detach(), output.detach())

    @contextmanager
    def record(self, keep_maps: bool = False) -> Iterator[None]:
        """Collect statistics (and, with ``keep_maps``, the detached maps) of the forward passes inside this block."""
        self._statistics.clear()
        self._maps.clear()
        self._recording, self._keep_maps = True, keep_maps
        try:
            yield
        finally:
            self._recording, self._keep_maps = False, False

    def statistics(self) -> dict[str, CorrelationStatistics]:
        """The statistics recorded by the last :meth:`record` block, by layer name."""
        return dict(self._statistics)

    def maps(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{layer: (input map, output map)}`` of the last ``record(keep_maps=True)`` block."""
        return dict(self._maps)

    def compute(self) -> dict[str, Tensor]:
        """Cost of every hooked block from the recorded statistics, keyed by log name (``L3``, ``layer2.0``)."""
        missing = [layer for layer in self.layers if layer not in self._statistics]
        if missing:
            raise RuntimeError(f"internal cost layers {missing} did not run inside InternalCosts.record()")
        return {self.names[layer]: self.costs[self._key(layer)].forward_statistics(self._statistics[layer]) for layer in self.layers}

    def cost_modules(self) -> dict[str, HFMCACost]:
        """The per-pair cost modules by log name."""
        return {self.names[layer]: self.costs[self._key(layer)] for layer in self.layers}  # type: ignore[misc]
