"""How the process's C heap hands memory to CPU tensors. glibc serves blocks over its mmap threshold
with fresh mmap()s and returns them to the OS on free, so every step's multi-megabyte activations
page-fault in again: on a 2-core VM a 2048-token bf16 prefill step of SmolLM2 spent 1.2-2.3 s
instead of 1.0-1.1 s. Raising the threshold to its maximum and the trim threshold far above it keeps
freed activations in the heap for the next step (what tcmalloc or jemalloc, which CPU LLM servers
preload, do by design). The heap then stays at its peak size, which the engine's steps reach
again anyway."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
from pathlib import Path

import torch

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


MADV_DONTNEED, MADV_HUGEPAGE, MADV_COLLAPSE = 4, 14, 25   # linux/mman.h; MADV_COLLAPSE since Linux 6.1
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
HUGE_PAGE = 2 << 20
HUGE_ENV_VAR = "LLMC_HUGE_PAGES"           # "0": 4 KiB pages wherever the kernel's defaults put them


@functools.lru_cache(maxsize=None)
def _libc(name: str, third: type):
    """The C library's `name` (madvise, mincore): (address, length, `third`) -> int; None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, third], ctypes.c_int
    return fn


def _madvise(start: int, length: int, advice: int) -> bool:
    madvise = _libc("madvise", ctypes.c_int)
    return madvise is not None and madvise(start, length, advice) == 0


def huge_pages(tensors) -> int:
    """Move the CPU tensors' memory onto 2 MiB transparent huge pages now: every 2 MiB-aligned span they
    touch is marked MADV_HUGEPAGE and collapsed (MADV_COLLAPSE). A decode step streams each weight once,
    and on 4 KiB pages every 4 KiB of it costs a TLB walk: SmolLM2's fp32 GEMVs in sequence from a C
    loop (2 threads, Intel Xeon) measured 24-25 GB/s on 4 KiB pages, 28-29 on huge ones. torch's own
    huge-page allocation (THP_MEM_ALLOC_ENABLE, llmc/__init__.py) covers only the aligned interior of
    tensors of 2 MiB and more, so a model's many smaller weights and the edges of the others stayed on
    4 KiB pages. The spans may hold other heap memory too, which is only moved; spans of a file mapping
    (weights read in place from the artifact) are refused by the kernel and stay as they are. Returns the
    bytes collapsed: 0 where the kernel refuses (huge pages off, Linux before 6.1, not Linux) or
    LLMC_HUGE_PAGES=0."""
    if os.environ.get(HUGE_ENV_VAR, "1").strip() == "0":
        return 0
    spans = set()
    for t in tensors:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        spans.update(range(start // HUGE_PAGE, (end + HUGE_PAGE - 1) // HUGE_PAGE))
    done = 0
    for span in sorted(spans):
        address = span * HUGE_PAGE
        if _madvise(address, HUGE_PAGE, MADV_HUGEPAGE) and _madvise(address, HUGE_PAGE, MADV_COLLAPSE):
            done += HUGE_PAGE
    return done


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in fresh anonymous pages, which the kernel zero-fills at each page's first
    touch: it costs neither the time to write it (torch.zeros took 1.8 s for a 1 GiB KV cache on a 2-core
    VM) nor RSS before use. Marked for huge pages, as torch marks its own large allocations."""
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)   # keeps `region` alive
    if os.environ.get(HUGE_ENV_VAR, "1").strip() != "0":
        _madvise(tensor.data_ptr(), tensor.nbytes, MADV_HUGEPAGE)
    return tensor


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the CPU tensor's anonymous pages resident now (mincore: each byte's low bit says its page
    is; of a file mapping it would report the page cache); all its bytes where that cannot be asked."""
    start = tensor.data_ptr() // PAGE * PAGE
    length = tensor.data_ptr() + tensor.nbytes - start
    pages = (ctypes.c_ubyte * -(-length // PAGE))()
    mincore = _libc("mincore", ctypes.c_void_p)
    if mincore is None or mincore(start, length, pages) != 0:
        return tensor.nbytes
    return min(tensor.nbytes, sum(b & 1 for b in bytes(pages)) * PAGE)


def anonymous_rss() -> int:
    """Bytes of this process's resident anonymous memory (/proc/self/status RssAnon; 0 off Linux)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0)


def file_mappings() -> list[tuple[int, int]]:
    """(start, end) of each private mapping of a file in this process (/proc/self/maps; none off Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    spans = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[1].endswith("p") and fields[4] != "0" and fields[5].startswith("/"):
            start, end = fields[0].split("-")
            spans.append((int(start, 16), int(end, 16)))
    return spans


def release_file_pages(tensors, mappings: list[tuple[int, int]] | None = None) -> int:
    """Unmap the resident pages of those CPU tensors that are views of a private file mapping (the
    artifact's weights; `mappings`: file_mappings(), read now when not given): pages read at load only
    to be repacked leave the process's RSS, and any page a kernel reads later faults back in from the
    page cache, unchanged (nothing writes a weight, so no page holds a private copy that this would
    drop). Only pages wholly inside the tensors' bytes go. Returns the bytes unmapped (0 off Linux)."""
    mappings = file_mappings() if mappings is None else mappings
    ranges = sorted({(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors
                     if t.device.type == "cpu" and t.nbytes and _inside(t.data_ptr(), t.nbytes, mappings)})
    released = 0
    for start, end in _merged(ranges):
        first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if last > first and _madvise(first, last - first, MADV_DONTNEED):
            released += last - first
    return released


def cpu_tensors(value):
    """The CPU tensors in `value` (tensors, and tuples, lists and dicts of them, named tuples among them)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel():
            yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from cpu_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from cpu_tensors(v)


def _inside(address: int, size: int, mappings: list[tuple[int, int]]) -> bool:
    return any(start <= address and address + size <= end for start, end in mappings)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted byte ranges joined where they touch or overlap: pages shared by neighbouring tensors go too."""
    merged: list[list[int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


__all__ = ["keep_freed_memory", "huge_pages", "zeroed", "resident_bytes", "anonymous_rss", "file_mappings",
           "release_file_pages", "cpu_tensors"]
