"""Keep freed memory in the process (glibc), so that a training step does not fault its pages in again.

glibc returns large freed blocks to the system: blocks above its mmap threshold (128 KiB, raised up to 32 MiB
as blocks are freed) are unmapped on ``free``, and heap memory above the trim threshold is released. Every
step of CPU training allocates the same large tensors again (activations, gradients, the internal costs'
temporaries), and each fresh page costs a page fault: on a 2-core VM about 37,000 faults in a ResNet-18
step on 8 x 9 CIFAR views and 74,000-85,000 with internal costs on every block, about 1 microsecond each.
With the thresholds below they drop to almost none and the steps ran 3-10 % faster (internal costs'
ratio to the backbone step 1.37-1.39 -> 1.33-1.34 in alternating runs; ``benchmarks/throughput.py``).

The cost is memory that stays with the process after it is freed, for reuse: about a step's peak, plus what
fragmentation leaves (torch's aligned allocations make a freed block a few bytes too small for the same
request; a loop of 40 MB allocations settled 280 MB higher after seven rounds and then stayed). ``hfmca`` applies this at start-up on Linux
with glibc; ``HFMCA_KEEP_FREED_MEMORY=0`` turns it off. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["keep_freed_memory", "OPT_OUT_VARIABLE"]

OPT_OUT_VARIABLE = "HFMCA_KEEP_FREED_MEMORY"

# mallopt(3) parameters (C ints) and the values set: blocks up to 256 MiB come from the heap, freed heap memory
# at its top is kept up to 2 GiB, and the heap grows 256 MiB beyond each request.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 256 << 20), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 256 << 20))


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (see the module docstring). Returns whether it was applied:
    ``False`` off Linux, without glibc, or with ``HFMCA_KEEP_FREED_MEMORY=0``."""
    if os.environ.get(OPT_OUT_VARIABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc only (musl has no mallopt)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    del gnu_get_libc_version
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in _SETTINGS)
