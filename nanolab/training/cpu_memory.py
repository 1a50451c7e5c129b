"""CPU training: keep freed heap memory in the process instead of handing it back every step.

With glibc's default malloc, a tensor larger than the (adaptive) mmap threshold is mapped fresh
and unmapped when freed, and the top of the heap is trimmed back to the OS; the next step then
page-faults the same memory in again, and the kernel zeroes every page. A training step frees
and re-allocates its activations each step, so on CPU this is pure overhead: measured against
nanoGPT's ``train.py`` on the quickstart shape (benches/vs_nanogpt.py, docs/performance.md) it
was 10 ms of extra system time per 400 ms step, the whole steady-state gap. Raising the mmap
and trim thresholds keeps the memory (the process's resident size stays at the step's peak,
which every step reaches anyway), which is what PyTorch's CUDA caching allocator does on GPUs.

Only glibc has ``mallopt``; elsewhere (macOS, musl) this does nothing.
``NANOLAB_KEEP_FREED_MEMORY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
#: Allocations up to this size come from the heap and freed memory up to it stays there.
KEEP_BYTES = 1 << 30

_applied = False


def keep_freed_memory(limit: int = KEEP_BYTES) -> bool:
    """Set glibc's mmap and trim thresholds to ``limit`` once per process; True if they are set.

    Called when a fit starts on CPU. Idempotent; False where there is no glibc ``mallopt`` or
    ``NANOLAB_KEEP_FREED_MEMORY=0``.
    """
    global _applied
    if _applied:
        return True
    if os.environ.get("NANOLAB_KEEP_FREED_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, limit)) and bool(mallopt(M_TRIM_THRESHOLD, limit))
    return _applied
