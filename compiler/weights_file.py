"""The artifact's weights file (safetensors) written a tensor at a time and read as a memory map.
safetensors' own save_file takes every tensor as bytes at once and load_file copies every tensor
into memory; a model larger than memory needs neither. The file is what save_file writes for the
same tensors (its order and data bytes), but for a header padded to 64 bytes, not 8."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Callable

import torch

from llmc.compiler.page_cache import map_on_huge_pages
from llmc.compiler.weight_store import Entry, as_lazy, values_of

# safetensors orders tensors by dtype, widest first as its Rust enum lists them, then by name
DTYPE_CODES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.uint16: "U16", torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
DTYPE_RANK = {dtype: rank for rank, dtype in enumerate(DTYPE_CODES)}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# the header is padded with spaces (as safetensors pads it to 8) so the data starts on a 64-byte
# boundary: weights whose sizes are multiples of 64 bytes then sit where SIMD kernels may read them
# in place from the mapping (torch's int8 GEMM crashes on an int8 weight 4 bytes off)
HEADER_ALIGN = 64
MAX_HEADER_BYTES = 100 << 20   # safetensors' own bound on a header


def file_order(tensors: dict[str, Entry]) -> list[str]:
    return sorted(tensors, key=lambda name: (DTYPE_RANK[tensors[name].dtype], name))


def header_bytes(tensors: dict[str, Entry], order: list[str]) -> bytes:
    header, offset = {}, 0
    for name in order:
        t = as_lazy(tensors[name])
        header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % HEADER_ALIGN)   # after the 8 bytes of its length
    return struct.pack("<Q", len(text)) + text


def write_weights_file(path: Path, tensors: dict[str, Entry],
                       progress: Callable[[int], None] | None = None) -> None:
    """Write `tensors` (tensors or lazy tensors) to `path`, making one at a time; `progress(bytes)`
    after each."""
    order = file_order(tensors)
    with open(path, "wb") as f:
        out = AlignedWriter(f)
        out.write(header_bytes(tensors, order))
        for name in order:
            values = values_of(tensors[name]).detach().to("cpu").contiguous()
            if values.numel():
                out.write(memoryview(values.reshape(-1).view(torch.uint8).numpy()))
            if progress is not None:
                progress(values.numel() * values.element_size())
        out.close()


# Writes of whole, aligned 2 MiB spans leave the file in the page cache as 2 MiB folios (ext4 from Linux
# 6.16, XFS), which a mapping of it then maps with huge pages: the kernels read the weights in place at
# the TLB cost of anonymous huge pages (2 threads streaming a 3B model's weights on 4 KiB pages ran ~15%
# slower), and a load copies nothing. A tensor at a time, unaligned, left 40% of a 1.9 GB file so.
WRITE_SPAN = 2 << 20


class AlignedWriter:
    """A file written in whole WRITE_SPAN-aligned spans (the last one short): bytes before the next
    boundary wait in a buffer; the aligned bulk of a large write goes straight from its memory."""

    def __init__(self, f):
        self.f, self.pending = f, bytearray()

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        if self.pending or len(data) < WRITE_SPAN:
            room = WRITE_SPAN - len(self.pending)
            self.pending += data[:room]
            data = data[room:]
            if len(self.pending) < WRITE_SPAN:
                return
            self.f.write(self.pending)
            self.pending = bytearray()
        bulk = len(data) - len(data) % WRITE_SPAN
        if bulk:
            self.f.write(data[:bulk])
        self.pending += data[bulk:]

    def close(self) -> None:
        self.f.write(self.pending)
        self.pending = bytearray()


def map_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `path` as views of one private memory map: pages are read
    from the file as they are touched and shared with the page cache; a write to a tensor
    copies its page rather than changing the file."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        if size > min(MAX_HEADER_BYTES, os.fstat(f.fileno()).st_size - 8):   # read nothing a lie asks for
            raise ValueError(f"its header claims {size} bytes, more than the file or {MAX_HEADER_BYTES >> 20} MiB")
        header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("its header is no JSON object")
        mapped = map_on_huge_pages(f)   # read from disk as huge folios (see WRITE_SPAN)
    base = 8 + size
    header.pop("__metadata__", None)
    return {name: mapped_tensor(mapped, base, name, entry) for name, entry in header.items()}


def mapped_tensor(mapped: mmap.mmap | None, base: int, name: str, entry: dict) -> torch.Tensor:
    dtype = DTYPES.get(entry.get("dtype"))
    shape, (start, end) = entry.get("shape"), entry.get("data_offsets", (0, -1))
    if dtype is None or not isinstance(shape, list):
        raise ValueError(f"tensor {name!r} has dtype {entry.get('dtype')!r} and shape {shape!r}")
    count = math.prod(shape)
    if end - start != count * dtype.itemsize or start < 0 or (mapped is not None and base + end > len(mapped)):
        raise ValueError(f"tensor {name!r}: bytes {start}..{end} do not hold {dtype} {shape} within the file")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start).reshape(shape)

