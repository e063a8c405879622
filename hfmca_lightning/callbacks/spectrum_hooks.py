"""Spectrum statistics of a model trained without HFMCA costs (the lightly baselines), gathered by forward hooks
during its own training steps, so that its spectra can be logged beside an HFMCA run's under the same keys."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.distributed import all_reduce_statistics_together
from hfmca_lightning.losses.statistics import CorrelationStatistics, group_statistics
from hfmca_lightning.methods.inspection import analysis_layers
from hfmca_lightning.methods.internal_costs import InternalCosts

__all__ = ["HookedSpectrumPairs"]


class HookedSpectrumPairs:
    """The pairs of a module that has a ``backbone`` (and maybe a ``projection_head``) but no cost pairs of its own.

    * ``internal/<block>``: float64 statistics between the input and output maps of backbone blocks (``layers``, by
      module name; default :func:`~hfmca_lightning.methods.inspection.analysis_layers`: the backbone's named stages
      or its residual blocks), as HFMCA's internal costs would see them
      (:class:`~hfmca_lightning.methods.InternalCosts`, never part of the loss), from the training forward itself
      (training-mode BatchNorm, as the HFMCA spectra), of steps on which :meth:`start` asks for them.
    * ``external``: the pair of the projection head's first two calls in a step, the projections of view 0 and of
      view 1 (one member per group), each with a constant feature appended, so that the constant function is in
      both spans and its eigenvalue is the trivial one of the HFMCA pairs. Methods whose head sees one view per
      step (MoCo's query) have no such pair.
    * RankMe's features: the backbone outputs of the step's batch, when asked.

    Statistics are summed over the process's forward calls within a step and over ranks (one collective), as the
    HFMCA modules' global-batch statistics are.
    """

    def __init__(self, layers: list[str] | None, reg: float) -> None:
        self.layers = layers
        self.reg = reg
        self.internal: InternalCosts | None = None
        self._stack: ExitStack | None = None
        self._recording: Any = None
        self._projections: list[Tensor] = []
        self._features: list[Tensor] | None = None
        self._active = False

    def attach(self, module: nn.Module) -> None:
        backbone = getattr(module, "backbone", None)
        if not isinstance(backbone, nn.Module):
            raise ConfigurationError(
                f"EigenspectrumCallback needs a module with cost pairs (HFMCAModule) or with a `backbone` to hook; "
                f"{type(module).__name__} has neither"
            )
        layers = self.layers if self.layers is not None else analysis_layers(backbone)
        if layers:
            self.internal = InternalCosts(layers, reg=self.reg, precision="float64")
            try:
                self.internal.attach(backbone)
            except ConfigurationError as error:  # the layers are the callback's, not a module's internal costs
                message = str(error).replace("internal cost layer", "EigenspectrumCallback hooked_layers:", 1)
                raise ConfigurationError(message, parameter="hooked_layers") from None
        backbone.register_forward_hook(self._backbone_output)
        head = getattr(module, "projection_head", None)
        if isinstance(head, nn.Module):
            head.register_forward_hook(self._projection)

    def start(self, internal: bool, features: bool) -> None:
        """Begin a training step: record the internal pairs if ``internal``, keep the backbone outputs if
        ``features``."""
        self._active, self._projections = True, []
        self._features = [] if features else None
        self._stack = ExitStack()
        if internal and self.internal is not None:
            self._recording = self._stack.enter_context(self.internal.record(precision="float64", detached=True))

    def stop(self) -> None:
        """The step's forward passes are done (called before its backward pass): later forward calls, such as the
        online linear probe's, are not the step's."""
        self._active = False
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def collect(self) -> tuple[dict[str, CorrelationStatistics], Tensor | None]:
        """The step's global-batch statistics of every recorded pair and this process's backbone features."""
        self.stop()
        statistics: dict[str, CorrelationStatistics] = {}
        if len(self._projections) >= 2:
            low, high = (_with_constant(projection) for projection in self._projections[:2])
            statistics["external"] = group_statistics(low[:, None], high)
        if self._recording is not None:
            statistics.update(self._recording.statistics)
        features = torch.cat(self._features) if self._features else None
        self._recording, self._projections, self._features = None, [], None
        names = list(statistics)
        return dict(zip(names, all_reduce_statistics_together([statistics[name] for name in names]))), features

    def _projection(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._active and isinstance(output, Tensor) and output.dim() == 2:
            self._projections.append(output.detach())

    def _backbone_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._active and self._features is not None and isinstance(output, Tensor) and output.dim() == 2:
            self._features.append(output.detach())


def _with_constant(features: Tensor) -> Tensor:
    """``(N, K)`` -> ``(N, K + 1)`` float64, the last feature the constant 1."""
    features = features.to(torch.float64)
    return torch.cat([features, features.new_ones(features.shape[0], 1)], dim=1)
