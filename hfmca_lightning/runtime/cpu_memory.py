"""Keep freed memory in the process (glibc), so that a CPU training step does not fault its pages in again.

glibc returns large freed blocks to the system: blocks above its mmap threshold (128 KiB, raised up to 32 MiB as
blocks are freed) are unmapped on ``free``, and heap memory above the trim threshold is released. Every CPU
training step allocates the same large tensors again (activations, gradients, the internal costs' temporaries),
and each fresh page costs a page fault. With the thresholds below freed blocks stay with the process for reuse:
the steps fault almost no pages in, at the price of memory kept after it is freed (about a step's peak, plus
fragmentation). Measurements: docs/benchmarks/cpu.md.

``hfmca`` applies it at start-up on Linux with glibc, on machines without a CUDA device (where it was measured to
help); ``HFMCA_KEEP_FREED_MEMORY=1`` applies it anywhere, ``=0`` never. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["OPT_OUT_VARIABLE", "keep_freed_memory", "keep_freed_memory_for_cpu_runs"]

OPT_OUT_VARIABLE = "HFMCA_KEEP_FREED_MEMORY"

# mallopt(3) parameters (C ints) and the values set: blocks up to 256 MiB come from the heap, freed heap memory
# at its top is kept up to 2 GiB, and the heap grows 256 MiB beyond each request.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 256 << 20), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 256 << 20))
_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (see the module docstring). Returns whether it was applied:
    ``False`` off Linux, without glibc, or with ``HFMCA_KEEP_FREED_MEMORY=0``."""
    if os.environ.get(OPT_OUT_VARIABLE, "").strip().lower() in _OFF:
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


def keep_freed_memory_for_cpu_runs() -> bool:
    """:func:`keep_freed_memory` on machines without a CUDA device, or anywhere with ``HFMCA_KEEP_FREED_MEMORY=1``."""
    if os.environ.get(OPT_OUT_VARIABLE, "").strip().lower() not in _ON:
        import torch

        if torch.cuda.is_available():
            return False
    return keep_freed_memory()
