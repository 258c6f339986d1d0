"""Process-level tuning for running the model on CPU.

The forward pass allocates and frees the same few activation sizes (hundreds of KiB to tens of MiB) on
every step. With glibc's defaults those sizes are served by fresh `mmap`s or returned to the OS at each
free (heap trimming), so every step pays page faults for all of its activations; in VMs this is a large
part of a CPU decode step. Raising the mmap threshold and the trim threshold keeps the freed memory in
the heap for the next step instead (what a caching allocator does on GPU).

kernel_switches.apply_kernel_switches runs it on CPU unless ServerArgs.disable_cpu_malloc_tuning is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# blocks up to this size come from the heap (and are reused) instead of a private mmap each: a decode step's
# activations are far smaller; long-lived big buffers (KV pool layers, large weights) stay mmaps, returned on free
_MMAP_THRESHOLD = 16 << 20
# free memory at the top of a heap is returned to the OS only beyond this much
_TRIM_THRESHOLD = 1 << 30

_applied = False


def tune_malloc_for_cpu_inference() -> bool:
    """Once per process, on glibc: keep freed activation memory for reuse. Returns whether it applied."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt), or no libc found
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    _applied = ok
    if ok:
        logger.debug("CPU inference: malloc mmap threshold %d MiB, trim threshold %d MiB",
                     _MMAP_THRESHOLD >> 20, _TRIM_THRESHOLD >> 20)
    return ok
