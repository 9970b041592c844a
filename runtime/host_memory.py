"""How the process's C heap hands memory to CPU tensors. glibc serves blocks over its mmap threshold
with fresh mmap()s and returns them to the OS on free, so every step's multi-megabyte activations
page-fault in again: on a 2-core VM a 2048-token bf16 prefill step of SmolLM2 spent 1.2-2.3 s
instead of 1.0-1.1 s. Raising the threshold to its maximum and the trim threshold far above it keeps
freed activations in the heap for the next step (what tcmalloc or jemalloc, which CPU LLM servers
preload, do by design). The heap then stays at its peak size, which the engine's steps reach
again anyway."""

from __future__ import annotations

import ctypes
import os

ENV_VAR = "LLMC_KEEP_FREED_MEMORY"   # "0" leaves the C heap's settings alone
# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 << 20        # glibc's ceiling on 64-bit (larger values are refused)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above, once per process; False where this is not glibc or the
    user turned it off with LLMC_KEEP_FREED_MEMORY=0."""
    global _done
    if _done:
        return True
    if os.environ.get(ENV_VAR, "1").strip() == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt   # the process's own symbols: libc is loaded already
    except (OSError, AttributeError):   # not glibc (musl, macOS): nothing to tune
        return False
    _done = all(mallopt(param, value) == 1 for param, value in
                ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    return _done


__all__ = ["keep_freed_memory"]
