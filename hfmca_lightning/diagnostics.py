"""Recorders of what a piece of code asks of torch, for finding host waits and small launches.

    from hfmca_lightning.diagnostics import HostReads
    with HostReads() as recorder:
        loss = module.training_step(batch, 0)["loss"]
    print(recorder.reads)   # every read of a device value on the host: on a GPU, a wait for its queue

Both are ``TorchDispatchMode`` s: they see every operation dispatched in the thread that entered them (the backward
pass of CPU tensors runs there too; a GPU's backward runs in autograd's device threads, which they do not see).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READS", "HostReads", "OperationCounts"]

# Operations that bring a device value to the host: ``.item()``, ``int()`` / ``bool()`` / ``float()`` of a tensor,
# ``tolist`` of a 0-dim tensor (``_local_scalar_dense``), and those whose output size depends on the data
# (``nonzero``: boolean-mask indexing, ``torch.where(condition)``).
HOST_READS = (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.item)


class HostReads(TorchDispatchMode):
    """While active, the name of every operation in :data:`HOST_READS` goes into ``reads``."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in HOST_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


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
