"""A CUDA GPU that exists only for Python: code runs on fake tensors and takes the branches it takes on that GPU.

Fake tensors (:class:`torch._subclasses.FakeTensorMode`) carry shapes, dtypes and strides, and run no arithmetic. Fake
*CUDA* tensors cannot run a backward pass without a driver (the autograd engine asks the driver about streams), so
here every fake tensor is a CPU tensor for torch's C++ side, and a tensor that lives on the modelled GPU says
``cuda:0`` to Python code outside torch's fake-tensor machinery (``tensor.device``, ``tensor.is_cuda``), and
``torch.cuda`` answers for the modelled GPU (its name, compute capability, ``is_available``). So the package's
``device.type == "cuda"`` branches, the TF32 choice by compute capability, ``avg_pool2d`` window pooling and the
whole-batch chunks are those of the GPU.

Which fake tensors live on the GPU is tracked by :class:`DevicePlacement` (an attribute on the tensor, set by the
dispatch mode that records operations): factory functions with ``device="cuda"``, copies to the GPU, and every result
of an operation with a GPU input. What C++ code decides by device inside composite operations (batch norm through
cuDNN or the native kernel) follows the CPU; the kernels those choose do the same work.

Autocast: ``torch.autocast("cuda")`` enables CUDA autocast, which acts on CUDA tensors in C++; here its casts are made
by :class:`AutocastEmulation`, a ``TorchFunctionMode`` with the CUDA autocast lists (casts recorded as the kernels
they are, parameter casts cached per autocast region as CUDA autocast caches them).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.optim import optimizer as optimizer_module
from torch.overrides import TorchFunctionMode
from torch.utils import _foreach_utils

from .gpus import GPUSpec

GPU = torch.device("cuda", 0)
_FLAG = "_on_modelled_gpu"
# Python files whose view of a tensor's device must stay the C++ one (CPU): torch's fake-tensor and meta machinery.
_TORCH_INTERNALS = tuple(
    f"{sep}torch{sep}{part}"
    for sep in ("/", "\\")
    for part in ("_subclasses", "_prims_common", "_meta_registrations.py", "_decomp", "_refs", "_ops.py", "_prims")
)


def on_gpu(tensor: object) -> bool:
    """Whether a fake tensor lives on the modelled GPU."""
    return isinstance(tensor, torch.Tensor) and bool(getattr(tensor, _FLAG, False))


def place(tensor: object, gpu: bool) -> None:
    """Put a fake tensor on the modelled GPU (``gpu``) or on the host."""
    if isinstance(tensor, torch.Tensor):
        setattr(tensor, _FLAG, gpu)


def _asked_from_torch_internals() -> bool:
    caller = sys._getframe(2).f_code.co_filename
    return any(part in caller for part in _TORCH_INTERNALS)


def _device(self: FakeTensor) -> torch.device:
    if self.fake_mode.in_kernel_invocation:
        return torch.device("meta")
    if on_gpu(self) and not _asked_from_torch_internals():
        return GPU
    return self.fake_device


def _is_cuda(self: FakeTensor) -> bool:
    return on_gpu(self) and not _asked_from_torch_internals()


def _get_device(self: FakeTensor) -> int:
    return 0 if on_gpu(self) else -1


def _deepcopy(self: FakeTensor, memo: dict[int, Any]) -> FakeTensor:
    """``copy.deepcopy`` of a fake tensor (torch's copies its storage, which fake tensors only pretend to have)."""
    with torch.no_grad():
        copied = self.clone()
    copied.requires_grad_(self.requires_grad)
    place(copied, on_gpu(self))
    memo[id(self)] = copied
    return copied


_CPU = torch.device("cpu")


def _to_host_target(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``Tensor.cpu`` / ``Tensor.to`` call asks for the host."""
    if func is torch.Tensor.cpu:
        return True
    if func is not torch.Tensor.to:
        return False
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            return torch.device(value).type == "cpu"
        if isinstance(value, torch.Tensor):
            return not on_gpu(value)
    return False


class HostCopies(TorchFunctionMode):
    """``tensor.cpu()``, ``tensor.to("cpu")``, ``tolist()`` and ``numpy()`` of tensors on the modelled GPU: copies to
    the host (to C++ they are CPU tensors already, so torch would skip the copy), made as the ``aten._to_copy`` a GPU
    runs, which the recorder sees. Calls from torch's own Python code are left alone: they name the devices C++
    gives them (the CPU), as the fused optimizers' ``found_inf.to(device)``, a no-op on the GPU too."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensor = args[0] if args else None
        if not on_gpu(tensor):
            return func(*args, **kwargs)
        caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
        if _to_host_target(func, args, kwargs) and "/torch/" not in caller:  # torch's own: C++ devices, all CPU
            dtype = next((value for value in args[1:] if isinstance(value, torch.dtype)), kwargs.get("dtype"))
            return torch.ops.aten._to_copy.default(
                tensor, dtype=dtype, device=_CPU, non_blocking=bool(kwargs.get("non_blocking", False))
            )
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            host = torch.ops.aten._to_copy.default(tensor, device=_CPU)
            with torch._C.DisableTorchFunction():
                return func(torch.zeros(host.shape, dtype=host.dtype), *args[1:], **kwargs)
        return func(*args, **kwargs)


class _HostFakeTensorMode(FakeTensorMode):
    """Fake tensors that never touch a CUDA driver, whatever ``torch.cuda.is_available()`` says."""

    @property
    def avoid_device_init(self) -> bool:  # type: ignore[override]
        return True


class _Stream:
    """``torch.cuda.Stream`` / ``Event`` of the modelled GPU: one queue, nothing to wait for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = GPU

    def wait_stream(self, *args: Any) -> None: ...

    def wait_event(self, *args: Any) -> None: ...

    def record_event(self, *args: Any) -> _Stream:
        return _Stream()

    def record(self, *args: Any) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


def _properties(spec: GPUSpec) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name=spec.name,
        major=spec.capability[0],
        minor=spec.capability[1],
        total_memory=int(spec.memory_gib * 2**30),
        multi_processor_count=spec.multiprocessors,
        is_integrated=False,
    )


@contextlib.contextmanager
def modelled_gpu(spec: GPUSpec, on_host_sync: Callable[[str], None]) -> Iterator[FakeTensorMode]:
    """Within: ``torch.cuda`` answers for ``spec``, fake tensors on it say ``cuda:0``, and the yielded fake mode makes
    the fake tensors (enter it, or create modules and tensors inside it). ``on_host_sync(what)`` is called for every
    call that makes the host wait for the GPU's queue to drain (``torch.cuda.synchronize``). Waiting for an event
    recorded earlier (an asynchronous copy of the previous step's checks) bounds how far the host runs ahead but
    drains nothing: not a sync (as in CUDA's sync debug mode, which the GPU targets count)."""
    properties = _properties(spec)

    def synchronize(*args: Any, **kwargs: Any) -> None:
        on_host_sync("torch.cuda.synchronize")

    cuda = torch.cuda
    patches = [
        mock.patch.object(cuda, "is_available", lambda: True),
        mock.patch.object(cuda, "device_count", lambda: 1),
        mock.patch.object(cuda, "current_device", lambda: 0),
        mock.patch.object(cuda, "set_device", lambda *a, **k: None),
        mock.patch.object(cuda, "get_device_capability", lambda *a, **k: spec.capability),
        mock.patch.object(cuda, "get_device_name", lambda *a, **k: spec.name),
        mock.patch.object(cuda, "get_device_properties", lambda *a, **k: properties),
        mock.patch.object(cuda, "is_bf16_supported", lambda *a, **k: True),
        mock.patch.object(cuda, "synchronize", synchronize),
        mock.patch.object(cuda, "Stream", _Stream),
        mock.patch.object(cuda, "Event", _Stream),
        mock.patch.object(cuda, "current_stream", lambda *a, **k: _Stream()),
        mock.patch.object(cuda, "default_stream", lambda *a, **k: _Stream()),
        mock.patch.object(cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        mock.patch.object(cuda, "empty_cache", lambda: None),
        mock.patch.object(cuda, "memory_allocated", lambda *a, **k: 0),
        mock.patch.object(cuda, "max_memory_allocated", lambda *a, **k: 0),
        mock.patch.object(cuda, "reset_peak_memory_stats", lambda *a, **k: None),
        mock.patch.object(cuda, "mem_get_info", lambda *a, **k: (properties.total_memory, properties.total_memory)),
        mock.patch.object(cuda, "manual_seed", lambda *a, **k: None),
        mock.patch.object(cuda, "manual_seed_all", lambda *a, **k: None),
        mock.patch.object(cuda, "_lazy_init", lambda: None),
        mock.patch.object(cuda, "is_initialized", lambda: True),
        mock.patch.object(FakeTensor, "device", property(_device)),
        mock.patch.object(FakeTensor, "is_cuda", property(_is_cuda), create=True),
        mock.patch.object(FakeTensor, "get_device", _get_device, create=True),
        mock.patch.object(FakeTensor, "__deepcopy__", _deepcopy, create=True),
        mock.patch.object(FakeTensor, "record_stream", lambda self, stream: None, create=True),
        # torch's utilities and optimisers take their multi-tensor kernels for plain tensors only (gradient norms: one
        # `_foreach_norm` per device and dtype, not one norm per gradient), which the GPU's tensors are
        mock.patch.object(_foreach_utils, "_foreach_supported_types", [torch.Tensor, FakeTensor]),
        mock.patch.object(optimizer_module, "_foreach_supported_types", [torch.Tensor, torch.nn.Parameter, FakeTensor]),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield _HostFakeTensorMode(allow_non_fake_inputs=True)
