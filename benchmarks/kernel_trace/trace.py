"""Tracing a step: the modelled GPU, fake tensors, the recorder and the emulated autocast together (:func:`tracing`)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from .autocast import AutocastEmulation
from .checks import HealthyChecks
from .gpus import GPUSpec
from .modelled_gpu import HostCopies, modelled_gpu, on_gpu, place
from .recorder import Operation, Phases, Recorder, tag_graph


@dataclass
class Trace:
    """What the traced steps did on the modelled GPU: their operations and the host's waits for the GPU, and how many
    steps they are (predictions are per step)."""

    gpu: GPUSpec
    operations: list[Operation] = field(default_factory=list)
    host_syncs: list[tuple[str, str]] = field(default_factory=list)
    steps: int = 1


class Tracing:
    """The live tracing context: :meth:`record` around the step to keep, :attr:`phases` to name modules' phases."""

    def __init__(self, recorder: Recorder, gpu: GPUSpec) -> None:
        self.recorder = recorder
        self.gpu = gpu

    @property
    def phases(self) -> Phases:
        return self.recorder.phases

    @contextlib.contextmanager
    def record(self) -> Iterator[Trace]:
        """Record the operations run inside into the yielded :class:`Trace` (filled on exit)."""
        trace = Trace(self.gpu)
        start, syncs = len(self.recorder.operations), len(self.recorder.host_syncs)
        self.recorder.recording = True
        try:
            yield trace
        finally:
            self.recorder.recording = False
            trace.operations = self.recorder.operations[start:]
            trace.host_syncs = self.recorder.host_syncs[syncs:]

    def start(self) -> None:
        self.recorder.recording = True

    def stop(self, trace: Trace) -> None:
        """End a recording started with :meth:`start`, into ``trace``."""
        self.recorder.recording = False
        trace.operations = list(self.recorder.operations)
        trace.host_syncs = list(self.recorder.host_syncs)
        self.recorder.operations.clear()
        self.recorder.host_syncs.clear()


@contextlib.contextmanager
def tracing(gpu: GPUSpec) -> Iterator[Tracing]:
    """Inside, modules and tensors made are fake, ``cuda`` is ``gpu`` (:mod:`.modelled_gpu`), CUDA autocast casts as on
    the GPU, and :meth:`Tracing.record` records what runs. Build the model inside (its parameters are then fake)."""
    recorder = Recorder(Phases())
    autocast = AutocastEmulation()
    original_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        autocast.clear()
        original_clear()

    def compile(model: Any = None, **options: Any) -> Any:
        """``torch.compile`` on the modelled GPU: the code runs eagerly (no GPU to compile for); a function compiled
        with ``mode="reduce-overhead"`` runs as CUDA graphs, so its kernels are recorded as replayed in a graph."""

        def compiled(function: Any) -> Any:
            if isinstance(function, torch.nn.Module) or options.get("mode") != "reduce-overhead":
                return function

            @functools.wraps(function)
            def replayed(*args: Any, **kwargs: Any) -> Any:
                recorder.graph_launch()
                recorder.in_graph = True
                try:
                    return function(*args, **kwargs)
                finally:
                    recorder.in_graph = False

            return replayed

        return compiled if model is None else compiled(model)

    for cache in _tensor_caches():  # tensors made by earlier runs or traces (each trace its own fake tensors)
        cache.cache_clear()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    stack_patches = [
        mock.patch.object(torch.autograd, "backward", _tagging_roots(torch.autograd.backward)),
        mock.patch.object(torch.autograd, "grad", _tagging_roots(torch.autograd.grad)),
        mock.patch.object(torch, "clear_autocast_cache", clear_autocast_cache),
        mock.patch.object(torch.nn.Module, "_apply", _apply),
        mock.patch.object(torch, "compile", compile),
        mock.patch.object(torch.compiler, "cudagraph_mark_step_begin", lambda: None),
    ]
    torch.__future__.set_swap_module_params_on_conversion(False)
    try:
        with contextlib.ExitStack() as stack:
            fake_mode = stack.enter_context(modelled_gpu(gpu, recorder.host_sync))
            for patch in stack_patches:
                stack.enter_context(patch)
            stack.enter_context(fake_mode)
            stack.enter_context(recorder)
            stack.enter_context(autocast)
            stack.enter_context(HealthyChecks())
            stack.enter_context(HostCopies())
            yield Tracing(recorder, gpu)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        for cache in _tensor_caches():  # the fake tensors of this trace
            cache.cache_clear()


def _tagging_roots(differentiate: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.backward`` / ``grad`` that first give the graph of each root the phases (:func:`tag_graph`)."""

    @functools.wraps(differentiate)
    def tagged(roots: Any, *args: Any, **kwargs: Any) -> Any:
        for root in roots if isinstance(roots, (list, tuple)) else [roots]:
            tag_graph(root)
        return differentiate(roots, *args, **kwargs)

    return tagged


def _tensor_caches() -> list[Any]:
    """The caches of the package's cost library (tensors made once per shape and device: the windows' constants, the
    counts), found by what they are, so that the code of any commit is traced (calibration traces older ones)."""
    caches = {
        id(value): value
        for name, module in list(sys.modules.items())
        if name.startswith("hfmca_lightning.losses") and module is not None
        for value in vars(module).values()
        if isinstance(value, functools._lru_cache_wrapper)
    }
    return list(caches.values())


def _apply(self: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> torch.nn.Module:
    """``Module._apply`` for fake parameters: the converted tensor replaces each parameter's data in place (torch's own
    ``_apply`` swaps fake parameters, which fails while the fake mode holds weak references to them)."""
    if recurse:
        for child in self.children():
            _apply(child, fn)
    for param in self._parameters.values():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
            param.data = applied
        place(param, on_gpu(applied))
        if param.grad is not None:
            with torch.no_grad():
                grad = fn(param.grad)
                param.grad.data = grad
            place(param.grad, on_gpu(grad))
    for key, buffer in self._buffers.items():
        if buffer is not None:
            self._buffers[key] = fn(buffer)
    return self


def modules_by_phase(model: torch.nn.Module, phases: dict[str, str]) -> dict[int, str]:
    """``{id(module): phase}`` for the named children of ``model`` (``{"backbone": "backbone", "projector":
    "external"}``)."""
    found: dict[int, str] = {}
    for name, phase in phases.items():
        module = getattr(model, name, None)
        if isinstance(module, torch.nn.Module):
            found[id(module)] = phase
    return found
