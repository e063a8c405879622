"""The dispatch mode that records every kernel-launching ATen operation of a traced step (:class:`Recorder`).

Each operation gets a *phase* (backbone, external, ``internal/<block>``, cost path, optimizer, callbacks, data) and
the Python source line that issued it. In the forward pass both come from the Python stack (:class:`Phases`); every
result carries them (``_traced``), and the autograd node that will compute its gradient takes them when a later
operation consumes it, so that each operation of the backward pass is attributed to the forward operation whose
gradient it computes (``torch._C._current_autograd_node()``), with the forward's source line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode

from . import counts
from .checks import healthy_value
from .modelled_gpu import on_gpu, place

aten = torch.ops.aten
_CPU = torch.device("cpu")
_TAG = "_traced"
_COPIES = ("_to_copy", "copy_", "copy")
_COPIES_INTO_FIRST = ("copy_", "copy")
_FUSED_OPTIMIZERS = {"_fused_sgd_", "_fused_adam_", "_fused_adamw_", "_fused_adagrad_"}
_SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}

# Python files that never name an operation's source: torch, Lightning's loop, the standard library, the tracer.
_NOT_SOURCES = (
    "/torch/", "/lightning/", "/lightning_fabric/", "/torchmetrics/", "/jsonargparse/", "/kernel_trace/",
    "/contextlib.py", "/functools.py", "/typing.py", "<",
)  # fmt: skip


@dataclass
class Operation:
    """One recorded ATen operation."""

    name: str
    phase: str
    source: str
    backward: bool
    kernels: int
    flops: float
    read: int
    written: int
    dtype: str
    rate: str
    on_gpu: bool
    transfer: str | None = None  # "host->device" or "device->host"
    in_graph: bool = False  # replayed in a CUDA graph (a region compiled with mode="reduce-overhead")

    @property
    def bytes(self) -> int:
        return self.read + self.written


class Phases:
    """The phase of the code running now, read from the Python stack.

    ``modules`` maps module objects to phase names (a module's ``forward`` frames, and everything they call, are in
    its phase); frames of ``InternalCosts._hook`` are ``internal/<log name>``; frames in ``torch/optim`` the
    optimizer; ``HFMCAModule.objective`` the cost path (every pair's factorisations); ``group_statistics`` the
    external cost; frames in ``hfmca_lightning/data`` the data; the rest of a training step (``training_step``,
    Lightning's closure that runs it and seeds the backward pass, the update's checks in
    ``on_before_optimizer_step``: work that runs inside ``optimizer.step`` but is not the update) ``logging and
    checks``; the innermost of these wins, except that everything a callback runs (the linear probe's pass through
    the backbone too) is the callbacks'.
    """

    def __init__(self, modules: dict[int, str] | None = None) -> None:
        self.modules = modules or {}

    def current(self) -> tuple[str, str, bool]:
        """``(phase, source, in_backward_code)`` of the running code: the phase of the innermost frame that has one,
        the innermost line of the package's code (or of the caller's, outside torch and Lightning), and whether
        that line is in a ``backward`` method (a custom autograd function's)."""
        frame = sys._getframe(2)
        source = fallback_source = phase = ""
        backward_code = in_callback = False
        while frame is not None:
            code = frame.f_code
            filename = code.co_filename.replace("\\", "/")
            if ("/hfmca_lightning/" in filename or "/benchmarks/" in filename) and "/kernel_trace/" not in filename:
                if not source:
                    source = f"{_short(filename)}:{frame.f_lineno}"
                backward_code = backward_code or code.co_name == "backward"
            if not fallback_source and not any(part in filename for part in _NOT_SOURCES):
                fallback_source = f"{_short(filename)}:{frame.f_lineno}"
            in_callback = in_callback or "/hfmca_lightning/callbacks/" in filename
            if not phase:
                phase = self._special(code.co_name, filename, frame)
            if not phase and code.co_name == "forward":
                phase = self.modules.get(id(frame.f_locals.get("self")), "")
            frame = frame.f_back
        phase = "callbacks" if in_callback else phase  # a callback's own pass through the backbone is the callback's
        return phase or "other", source or fallback_source or "?", backward_code

    @staticmethod
    def _special(name: str, filename: str, frame: Any) -> str:
        if name == "_hook" and filename.endswith("internal_costs.py"):
            pair = frame.f_locals.get("pair")
            return f"internal/{pair.log_name}" if pair is not None else "internal"
        if name in ("training_step", "on_before_optimizer_step") or filename.endswith(_CLOSURE):
            return "logging and checks"
        if "/torch/optim/" in filename:
            return "optimizer"
        if name == "objective" and filename.endswith("methods/hfmca.py"):
            return "cost path"
        if name == "group_statistics":
            return "external"
        if "/hfmca_lightning/data/" in filename:
            return "data"
        return ""


_CLOSURE = "/lightning/pytorch/loops/optimization/automatic.py"  # runs training_step inside optimizer.step


def _short(filename: str) -> str:
    for root in ("/hfmca_lightning/", "/benchmarks/", "/site-packages/"):
        if root in filename:
            start = filename.index(root) + 1
            return filename[start:].removeprefix("site-packages/")
    return filename.rsplit("/", 1)[-1]


class Recorder(TorchDispatchMode):
    """Records operations while :attr:`recording`; always keeps fake tensors on the modelled GPU or the host
    (:mod:`.modelled_gpu`): ``device="cuda"`` becomes a CPU fake tensor placed on the GPU, results of operations on
    GPU tensors are on the GPU, copies move them."""

    def __init__(self, phases: Phases) -> None:
        super().__init__()
        self.phases = phases
        self.recording = False
        self.in_graph = False  # inside a region compiled into CUDA graphs
        self.operations: list[Operation] = []
        self.host_syncs: list[tuple[str, str]] = []  # (what, source)

    def host_sync(self, what: str) -> None:
        if self.recording:
            self.host_syncs.append((what, self.phases.current()[1]))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = func._schema.name.split("::")[-1]
        if func is torch.ops.prim.device.default:
            return func(*args, **kwargs)
        target: bool | None = None
        if kwargs.get("device") is not None:
            device = torch.device(kwargs["device"])
            target = device.type == "cuda"
            if not target and torch._C._current_autograd_node() is not None:
                # The engine making or casting a gradient with its input's (to C++: CPU) options: on the GPU, where
                # the gradients are; no transfer.
                target = None if any(isinstance(a, torch.Tensor) for a in args) else True
            kwargs["device"] = _CPU if device.type in ("cuda", "cpu") else device
        inputs = counts.tensors(args) + counts.tensors(kwargs.values())
        gpu_inputs = any(on_gpu(tensor) for tensor in inputs)
        into_first = name in _COPIES_INTO_FIRST  # copy_(self, src) / copy(self, src): the source second
        copied_from_gpu = on_gpu(args[1] if into_first else args[0]) if name in _COPIES else False
        copied_to_gpu = on_gpu(args[0]) if into_first else None
        self._tag_inputs(inputs)
        if name == "_pin_memory":
            return args[0]
        if name == "is_pinned":
            return True
        if func in _SCALAR_READS:
            if gpu_inputs:
                self.host_sync(f"aten.{name} (a device value read on the host)")
            healthy = healthy_value(args[0])
            if healthy is not None:
                return healthy
            try:
                return func(*args, **kwargs)
            except DataDependentOutputException:
                return {"equal": True, "is_nonzero": False}.get(name, 0)
        if name in _FUSED_OPTIMIZERS:  # no fake kernel: recorded, updates nothing
            if self.recording:
                self._record(func, args, kwargs, None, gpu=True)
            return None
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:  # nonzero, masked_select, ...: the host waits for the size
            if gpu_inputs:
                self.host_sync(f"aten.{name} (an output size read on the host)")
            out = _empty_result(name, args)
        gpu = target if target is not None else gpu_inputs
        if out is args[0] and name == "_to_copy" and gpu != on_gpu(args[0]):
            out = aten.clone.default(args[0])  # a copy between host and GPU (to C++, CPU to CPU: no copy made)
        mutated = func._schema.is_mutable or "out" in kwargs
        results = counts.tensors([out])
        if not mutated:
            for result in results:
                place(result, gpu)

        transfer = None
        if name in _COPIES:
            destination_gpu = copied_to_gpu if into_first else gpu
            if copied_from_gpu != destination_gpu:
                transfer = "host->device" if destination_gpu else "device->host"
                if transfer == "device->host" and not _non_blocking(name, args, kwargs):
                    self.host_sync(f"aten.{name} to the host")
                if transfer == "host->device" and not _non_blocking(name, args, kwargs):
                    # CUDA copies without non_blocking wait for the whole stream (memcpy_and_sync):
                    # torch.tensor(value, device=...), tensor.to(device), self.log of a Python number
                    self.host_sync(f"aten.{name} to the device without non_blocking (the host waits for the GPU)")
            elif name == "_to_copy" and _is_no_op_copy(args[0], kwargs):
                return out  # tensor.to(its own device and dtype): no copy on the GPU
        if self.recording:
            phase_source = self._record(func, args, kwargs, out, gpu=gpu or gpu_inputs, transfer=transfer)
            for result in results:
                if not hasattr(result, _TAG):
                    setattr(result, _TAG, phase_source)
        return out

    def _record(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, gpu: bool, transfer: str | None = None
    ) -> tuple[str, str, bool]:
        node = torch._C._current_autograd_node()
        backward = node is not None
        phase, source, backward_code = self.phases.current()
        in_graph = self.in_graph
        if backward:
            traced = node.metadata.get("trace") if node is not None else None
            if traced is not None:
                phase, in_graph = traced[0], traced[2]
                if not backward_code:  # a gradient formula of torch's, not a backward method of the package's
                    source = f"{traced[1]} (backward)"
            elif phase == "other":
                phase = "backward (untraced)"
        kernels = counts.kernels(func, args, kwargs)
        if kernels:
            read, written = counts.moved_bytes(func, args, kwargs, out)
            hidden = counts.hidden_work(func, args, kwargs, out) if gpu else (0, 0, 0)
            kernels, read, written = kernels + hidden[0], read + hidden[1], written + hidden[2]
            transposed = counts.transposed_layouts(func, args, out) if gpu else []
            kernels += len(transposed)
            read += sum(counts.span_bytes(tensor) for tensor in transposed)
            written += sum(counts.span_bytes(tensor) for tensor in transposed)
            dtype = counts.compute_dtype(func, args, out)
            self.operations.append(
                Operation(
                    name=func._schema.name.split("::")[-1],
                    phase=phase,
                    source=source,
                    backward=backward,
                    kernels=kernels,
                    flops=counts.flops(func, args, kwargs, out),
                    read=read,
                    written=written,
                    dtype=str(dtype).removeprefix("torch.") if dtype is not None else "-",
                    rate=counts.rate_class(func, args, dtype),
                    on_gpu=gpu,
                    transfer=transfer,
                    in_graph=in_graph,
                )
            )
        return phase, source, in_graph

    def graph_launch(self) -> None:
        """One replay of a CUDA graph in the forward pass and one in the backward pass: two launches."""
        if self.recording:
            phase, source, _ = self.phases.current()
            self.operations.append(
                Operation("cuda_graph_launch", phase, source, False, 2, 0.0, 0, 0, "-", "fp32", True)
            )

    @staticmethod
    def _tag_inputs(inputs: list[torch.Tensor]) -> None:
        """Give the autograd node of each input that has one the phase and source of the operation that made it."""
        for tensor in inputs:
            node = tensor.grad_fn
            traced = getattr(tensor, _TAG, None)
            if node is not None and traced is not None and "trace" not in node.metadata:
                node.metadata["trace"] = traced


def tag_graph(root: torch.Tensor) -> None:
    """Before a backward pass from ``root``: its node takes ``root``'s phase, and nodes without one (made inside
    torch, their results never seen by Python) take the phase of the node that consumes them."""
    node = root.grad_fn
    traced = getattr(root, _TAG, None)
    if node is None:
        return
    if traced is not None and "trace" not in node.metadata:
        node.metadata["trace"] = traced
    stack, seen = [node], {id(node)}
    while stack:
        current = stack.pop()
        parent = current.metadata.get("trace")
        for child, _ in current.next_functions:
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            if parent is not None and "trace" not in child.metadata:
                child.metadata["trace"] = parent
            stack.append(child)


def _is_no_op_copy(tensor: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    dtype = kwargs.get("dtype")
    layout = kwargs.get("memory_format")
    same_dtype = dtype is None or dtype == tensor.dtype
    same_layout = layout in (None, torch.preserve_format) or tensor.is_contiguous(memory_format=layout)
    return same_dtype and same_layout and on_gpu(tensor) and kwargs.get("device") is not None


def _empty_result(name: str, args: tuple[Any, ...]) -> torch.Tensor:
    first = args[0]
    if name in ("nonzero", "argwhere"):
        return first.new_empty((0, first.dim()), dtype=torch.int64)
    return first.new_empty((0,))


def _non_blocking(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a copy was asked for with ``non_blocking`` (``copy_`` / ``copy(self, src, non_blocking)``,
    ``_to_copy(..., non_blocking=)``)."""
    if name in _COPIES_INTO_FIRST:
        return bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
    return bool(kwargs.get("non_blocking", False))
