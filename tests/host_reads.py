"""A recorder of host reads of tensor values: on a GPU each waits for the queue (``.item()``, ``int()`` /
``bool()`` of a tensor, boolean-mask indexing)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.item)


class HostReads(TorchDispatchMode):
    """While active, the name of every operation in ``HOST_READS`` goes into ``reads``."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in HOST_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


class OperationCounts(TorchDispatchMode):
    """While active, counts the calls of the given operations (overload packets, e.g. ``torch.ops.aten.mm``) in
    ``count``. The backward pass of CPU tensors runs in the calling thread, so it is counted too."""

    def __init__(self, *operations) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.operations, self.count = operations, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in self.operations:
            self.count += 1
        return func(*args, **(kwargs or {}))
