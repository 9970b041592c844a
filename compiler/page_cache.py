"""A weights file mapped on 2 MiB pages where the kernel can: the page cache keeps a file in folios the
size of the writes or reads that brought it in, and a mapping maps 4 KiB pages of small folios whatever
MADV_HUGEPAGE asks. An artifact written before llmc wrote in 2 MiB spans (compiler/weights_file.py), or
copied onto this machine by `cp` or `rsync` (64-128 KiB writes), sits in small folios until evicted; a
decode step that streams the weights then pays a TLB walk every 4 KiB: Llama-3B's Q4_1 artifact on the
2-core Xeon decoded at 70% of the DRAM bandwidth with 45% of its weights on huge pages, 77% with all.

So a large file's mapping is sampled (a few 2 MiB windows faulted in, /proc/self/smaps read) and, where
the cache holds it in small folios and a probe shows that a re-read comes back in huge ones, its clean
cached pages are dropped (posix_fadvise DONTNEED) before it is mapped again: the decode's first reads
fetch it from disk once, as 2 MiB folios. Elsewhere (not Linux, THP off, a kernel or filesystem
without large folios) the mapping is left as it comes."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

HUGE_PAGE = 2 << 20
CHECK_FROM = 64 << 20      # smaller files: the TLB walks cost little, and the check would cost more
WINDOWS = 8                # 2 MiB windows sampled across the file (16 MiB faulted in at most)
MADV_POPULATE_READ = 22    # linux/mman.h, Linux 5.14
SMALL = 0.5                # below this share of sampled bytes on huge pages, the cache is re-read


def private_map(f) -> mmap.mmap | None:
    """A copy-on-write map of open file `f` (None where it is empty), asking for huge pages: pages the
    kernel reads from disk for it come in as 2 MiB folios where the filesystem supports them."""
    if not os.fstat(f.fileno()).st_size:
        return None
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE)
    return mapped


def map_on_huge_pages(f) -> mmap.mmap | None:
    """private_map(f), after dropping the file's cached pages where they sit in small folios and a probe
    shows that they would be read back in huge ones (see the module's docstring)."""
    mapped = private_map(f)
    if mapped is None or len(mapped) < CHECK_FROM or not _thp_possible():
        return mapped
    share = huge_share(mapped)
    if share is None or share >= SMALL:
        return mapped
    mapped.close()
    if _rereads_huge(f):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return private_map(f)


def huge_share(mapped: mmap.mmap, windows: int = WINDOWS) -> float | None:
    """The share of `windows` 2 MiB windows spread over `mapped` that the kernel maps with huge pages
    once faulted in (MADV_POPULATE_READ); None where that cannot be asked."""
    spans = len(mapped) // HUGE_PAGE
    if spans == 0:
        return None
    starts = sorted({i * spans // windows * HUGE_PAGE for i in range(min(windows, spans))})
    try:
        for start in starts:
            mapped.madvise(MADV_POPULATE_READ, start, HUGE_PAGE)
    except OSError:   # before Linux 5.14
        return None
    huge = file_pmd_mapped(mapped)
    return None if huge is None else min(1.0, huge / (len(starts) * HUGE_PAGE))


def file_pmd_mapped(mapped: mmap.mmap) -> int | None:
    """Bytes of the mapping the kernel maps with huge pages (FilePmdMapped in /proc/self/smaps)."""
    view = ctypes.c_char.from_buffer(mapped)
    start = ctypes.addressof(view)
    del view   # an exported buffer would keep the map from closing
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if not head.endswith(":"):      # a mapping's first line: "start-end perms ..."
            inside = int(head.split("-")[0], 16) == start if "-" in head else False
        elif inside and head == "FilePmdMapped:":
            return int(line.split()[1]) * 1024
    return None


def _rereads_huge(f) -> bool:
    """Whether the file's first 2 MiB, dropped from the page cache and faulted in again through a fresh
    mapping, come back on a huge page: a filesystem and kernel with large folios (ext4 from Linux 6.16,
    XFS). Costs a 2 MiB read, and the writeback of a file just written (dirty pages are not dropped)."""
    os.fdatasync(f.fileno())
    os.posix_fadvise(f.fileno(), 0, HUGE_PAGE, os.POSIX_FADV_DONTNEED)
    probe = private_map(f)
    try:
        return bool(huge_share(probe, windows=1))
    finally:
        probe.close()


def _thp_possible() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode and hasattr(os, "posix_fadvise") and hasattr(mmap, "MADV_HUGEPAGE")


__all__ = ["map_on_huge_pages", "huge_share", "private_map"]
