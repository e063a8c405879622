"""Recorders of what a piece of code asks of torch, for finding host waits and small launches.

    from hfmca_lightning.diagnostics import HostReads
    with HostReads() as recorder:
        loss = module.training_step(batch, 0)["loss"]
    print(recorder.reads)   # every read of a device value on the host: on a GPU, a wait for its queue

:class:`HostReads` counts what would make the host wait for a GPU, on any device (so that a CPU test fails for
the regression a GPU would show): scalar reads (``.item()``, ``bool()`` / ``int()`` / ``float()`` of a tensor,
``torch.equal``), operations whose output size depends on the data (``nonzero``, ``torch.where(condition)``,
boolean-mask indexing and assignment, ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats and
no ``output_size``), copies to the CPU (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU
tensor from a device), and conversions to Python or numpy (``.tolist()``, ``.numpy()``, ``numpy.asarray``). Values
deliberately brought to the host by an asynchronous copy are read from host buffers (:func:`host_buffer`), which
are not counted.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READS", "HostReads", "OperationCounts", "host_buffer", "is_host_buffer"]

aten = torch.ops.aten
# Operations that bring a device value to the host: scalar reads (``.item()``, ``int()`` / ``bool()`` / ``float()``
# of a tensor) and those whose output size depends on the data.
HOST_READS = (
    aten._local_scalar_dense,
    aten.item,
    aten.nonzero,
    aten.argwhere,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.bincount,
    aten.equal,  # torch.equal: one boolean for the host
)
_MASK_DTYPES = (torch.bool, torch.uint8)
_INDEXING = (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_)
_COPIES = (aten._to_copy, aten.copy_, aten.copy)
# Tensor methods that bring values to Python or numpy without a dispatched operation on CPU tensors.
_METHODS = ("cpu", "numpy", "tolist", "__array__", "to")

_host_buffers: dict[int, weakref.ref[Tensor]] = {}  # by id (tensors compare by value, not identity)


def host_buffer(tensor: Tensor) -> Tensor:
    """Mark ``tensor`` as a host buffer: a CPU tensor that an asynchronous copy fills (or, on CPU-only runs, the value
    itself), read on the host after its copy finished. :class:`HostReads` does not count reads of it."""
    key = id(tensor)
    _host_buffers[key] = weakref.ref(tensor, lambda _: _host_buffers.pop(key, None))
    return tensor


def is_host_buffer(tensor: object) -> bool:
    """Whether ``tensor`` is a :func:`host_buffer` or a view of one."""
    if not isinstance(tensor, Tensor):
        return False
    for candidate in (tensor, tensor._base):
        reference = _host_buffers.get(id(candidate))
        if reference is not None and reference() is candidate:
            return True
    return False


def _has_mask(indices: Any) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(index, Tensor) and index.dtype in _MASK_DTYPES for index in indices
    )


def _to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a copy operation takes a device tensor to the CPU and waits for it (``non_blocking`` copies into
    pinned memory do not)."""
    if func.overloadpacket is aten._to_copy:
        source, target = args[0], kwargs.get("device")
        blocking = not kwargs.get("non_blocking", False)
        return blocking and target is not None and torch.device(target).type == "cpu" and source.device.type != "cpu"
    target, source = args[0], args[1]
    blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    return blocking and target.device.type == "cpu" and source.device.type != "cpu"


class HostReads(TorchDispatchMode):
    """While active, every read of a tensor's value on the host goes into ``reads`` (the operation's or method's
    name), in the thread that entered it and in autograd's backward threads (dispatch modes travel with the backward
    pass); the Python methods ``cpu``, ``numpy``, ``tolist``, ``__array__`` and ``to(<cpu>)`` are counted in every
    thread. Reads of :func:`host_buffer` tensors are not counted."""

    _active: list[HostReads] = []
    _saved: dict[str, Callable[..., Any]] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not getattr(_inside_method, "depth", 0):
            read = _read_of(func, args, kwargs)
            if read is not None:
                self.reads.append(read)
        return func(*args, **kwargs)

    def __enter__(self) -> HostReads:
        with HostReads._lock:
            if not HostReads._active:
                _patch_methods()
            HostReads._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        with HostReads._lock:
            HostReads._active.remove(self)
            if not HostReads._active:
                _restore_methods()


# Inside a counted method (its own dispatched operations are not counted again).
_inside_method = threading.local()


def _read_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The name of the host read that the dispatched operation ``func`` makes, or None."""
    packet = func.overloadpacket
    if packet in HOST_READS:
        return None if args and is_host_buffer(args[0]) else str(func)
    if packet in _INDEXING and len(args) > 1 and _has_mask(args[1]):
        return f"{func} (boolean mask: nonzero)"
    if packet is aten.repeat_interleave and isinstance(args[0 if len(args) == 1 else 1], Tensor):
        if kwargs.get("output_size") is None:  # the output's size is the repeats' sum, read on the host
            return f"{func} (repeats from a tensor)"
    if packet in _COPIES and _to_host(func, args, kwargs):
        return f"{func} (to the CPU)"
    return None


def _method_reads(name: str, tensor: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call ``tensor.<name>(*args, **kwargs)`` brings values to the host: ``to`` only from a device to
    the CPU, the others always (on a GPU tensor they copy it to the host first)."""
    if is_host_buffer(tensor):
        return False
    if name == "to":
        return tensor.device.type != "cpu" and _targets_cpu(args, kwargs)
    return True


def _targets_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    for arg in args:
        if isinstance(arg, (str, torch.device)):
            device = arg
        elif isinstance(arg, Tensor):
            device = arg.device
    return device is not None and torch.device(device).type == "cpu"


def _counted_call(name: str, original: Callable[..., Any], tensor: Tensor, args: tuple, kwargs: dict) -> Any:
    """``original(tensor, *args, **kwargs)``, recorded as ``Tensor.<name>`` in every active recorder when it brings
    values to the host (its own dispatched operations are not counted again)."""
    depth = getattr(_inside_method, "depth", 0)
    if depth == 0 and _method_reads(name, tensor, args, kwargs):
        for recorder in list(HostReads._active):
            recorder.reads.append(f"Tensor.{name}")
    _inside_method.depth = depth + 1
    try:
        return original(tensor, *args, **kwargs)
    finally:
        _inside_method.depth = depth


def _patch_methods() -> None:
    for name in _METHODS:
        original = getattr(Tensor, name)
        HostReads._saved[name] = original
        counted: Callable[..., Any]
        if name == "__array__":
            # ``Tensor.__array__(self, dtype=None)``'s own signature and name: numpy 2 first passes ``copy=``, and
            # on the TypeError that names ``__array__()`` calls again without it (torch's method takes no ``copy``).
            # A wrapper taking ``**kwargs`` counted both calls; this one fails the first before counting.

            def counted(self: Tensor, dtype: Any = None, _original: Any = original) -> Any:
                return _counted_call("__array__", _original, self, (dtype,), {})

            counted.__name__, counted.__qualname__ = original.__name__, original.__qualname__

        else:

            def counted(self: Tensor, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                return _counted_call(_name, _original, self, args, kwargs)

        setattr(Tensor, name, counted)


def _restore_methods() -> None:
    for name, original in HostReads._saved.items():
        setattr(Tensor, name, original)
    HostReads._saved.clear()


class OperationCounts(TorchDispatchMode):
    """While active, counts the calls of the given operations (overload packets, e.g. ``torch.ops.aten.mm``) in
    ``count``."""

    def __init__(self, *operations: Any) -> None:
        super().__init__()
        self.operations, self.count = operations, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in self.operations:
            self.count += 1
        return func(*args, **(kwargs or {}))
