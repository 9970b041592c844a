"""GGUF block formats decoded with whole-tensor torch ops into what they store: integer codes
with a float scale (and minimum) per group of 16 or 32 weights. Those parts either become llmc's
grouped-affine quantised params (affine4/affine8, compiler/quant.py; the compile keeps the file's
quantisation) or are dequantised to float32 here. The scales and minimums are computed with the
formulas and float32 operation order of gguf.quants.dequantize (the reference), and the affine
dequantisation rounds as it does, so both results are bit-identical to it; types without a torch
version here go through the reference itself."""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Callable, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize as reference_dequantize

from llmc.compiler.quant import AFFINE4_CENTRE, dequantize_affine_codes, pack_int4, pack_k_params, unpack_int4
from llmc.compiler.weight_store import LazyTensor

Q = GGMLQuantizationType


class BlockParts(NamedTuple):
    """One GGUF tensor's blocks as codes and per-group scales (and minimums)."""
    scheme: str                   # "affine4": codes 0..15; "affine8": codes -128..127
    codes: torch.Tensor | None    # uint8 / int8 [blocks, block_size]; None where `packed` holds them
    scales: torch.Tensor          # float16 (the file's own) or float32 [blocks, block_size / group_size]
    mins: torch.Tensor | None     # like scales, or None: w = q * s (affine4: (q - 8) * s)
    packed: torch.Tensor | None = None   # affine4: uint8 [blocks, block_size / 2] as pack_int4 packs codes
    # K-quants: scales (and minimums) as their super-block's fp16 factor [blocks, 1] and the groups' integers
    # [blocks, groups], which the artifact keeps packed (compiler/quant.py's pack_k_params)
    k_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    k_mins: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def block_size(self) -> int:
        return self.codes.shape[1] if self.codes is not None else 2 * self.packed.shape[1]

    def unpacked_codes(self) -> torch.Tensor:
        return self.codes if self.codes is not None else unpack_int4(self.packed)


class AffineWeight(NamedTuple):
    """A GGUF weight as llmc stores it: w = q * s (+ m) in groups of group_size along K."""
    scheme: str                   # "affine4" | "affine8"
    format: str                   # the GGUF type it came from, e.g. "Q4_1"
    group_size: int
    qweight: torch.Tensor         # affine4: uint8 [N, K/2] (packed); affine8: int8 [N, K]
    scales: torch.Tensor          # float16 where that holds every value exactly, else float32 [N, K/g];
    mins: torch.Tensor | None     # K-quants' packed uint8 [N, 2 K/256 + K/g] (compiler/quant.py's pack_k_params)

    @property
    def symmetric(self) -> bool:
        return self.mins is None

    def rows(self, index: torch.Tensor) -> AffineWeight:
        """The weight with its output rows reordered by `index` (undoing llama.cpp's q/k permutation)."""
        pick = (lambda t: None if t is None else t.index_select(0, index).contiguous())
        return self._replace(qweight=pick(self.qweight), scales=pick(self.scales), mins=pick(self.mins))


class LazyBlocks(NamedTuple):
    """A GGUF weight's AffineWeight before its blocks are decoded: what it is now, the parts when
    `load` is called (decoded afresh each time), and the lazy float values of the same tensor."""
    scheme: str
    format: str
    group_size: int
    symmetric: bool
    load: Callable[[], AffineWeight]
    values: LazyTensor


# block formats decoded into affine parts: (scheme, group size, stores a minimum per group)
BLOCK_LAYOUTS: dict[GGMLQuantizationType, tuple[str, int, bool]] = {
    Q.Q4_0: ("affine4", 32, False), Q.Q4_1: ("affine4", 32, True), Q.Q5_0: ("affine8", 32, False),
    Q.Q5_1: ("affine8", 32, True), Q.Q8_0: ("affine8", 32, False), Q.Q4_K: ("affine4", 32, True),
    Q.Q5_K: ("affine8", 32, True), Q.Q6_K: ("affine8", 16, False),
}


class RecentParts:
    """The last few tensors' decoded parts: a weight's codes, scales and minimums are written as
    three params (and a fused projection reads each part of each source), so without this every
    block would be decoded once per part. Bounded by count, so by a few weights' bytes; one per loaded file."""

    def __init__(self, size: int = 4):
        self.size, self.entries = size, []   # (tensor, parts), most recent last

    def get(self, tensor: ReaderTensor) -> AffineWeight | None:
        for i, (held, parts) in enumerate(self.entries):
            if held is tensor:
                self.entries.append(self.entries.pop(i))
                return parts
        return None

    def put(self, tensor: ReaderTensor, parts: AffineWeight) -> None:
        self.entries = (self.entries + [(tensor, parts)])[-self.size:]


def lazy_decode(tensor: ReaderTensor, rows: torch.Tensor | None = None,
                recent: RecentParts | None = None) -> tuple[LazyTensor, LazyBlocks | None]:
    """decode(tensor) made lazy: its float32 values, and for a 2-D block-format tensor its affine
    parts, each decoded when asked (with its output rows reordered by `rows` when given)."""
    shape = torch_shape(tensor)

    def values() -> torch.Tensor:
        decoded = decode(tensor)[0]
        return decoded if rows is None else decoded.index_select(0, rows).contiguous()

    lazy = LazyTensor(shape, torch.float32, values)
    layout = BLOCK_LAYOUTS.get(tensor.tensor_type)
    if layout is None or len(shape) != 2:
        return lazy, None

    def parts() -> AffineWeight:
        affine = None if recent is None else recent.get(tensor)
        if affine is None:
            affine = affine_weight(block_parts(tensor), tensor.tensor_type.name, shape)
            affine = affine if rows is None else affine.rows(rows)
            if recent is not None:
                recent.put(tensor, affine)
        return affine

    scheme, group_size, has_mins = layout
    return lazy, LazyBlocks(scheme, tensor.tensor_type.name, group_size, not has_mins, parts, lazy)


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """The tensor's shape in torch order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """`tensor` as float32, in torch dimension order."""
    return decode(tensor)[0]


def decode(tensor: ReaderTensor) -> tuple[torch.Tensor, AffineWeight | None]:
    """`tensor` as float32 in torch dimension order and, for a 2-D tensor in a block format
    decoded here, as llmc's affine params, from one parse of its blocks. Float tensors and
    other block types (dequantised by the reference) have no affine form."""
    shape = torch_shape(tensor)
    if tensor.tensor_type in FLOAT_DECODERS:
        return FLOAT_DECODERS[tensor.tensor_type](raw_bytes(tensor)).reshape(shape), None
    parts = block_parts(tensor)
    if parts is None:
        values = np.array(reference_dequantize(tensor.data, tensor.tensor_type))
        return torch.from_numpy(values).reshape(shape), None
    centre = AFFINE4_CENTRE if parts.scheme == "affine4" and parts.mins is None else 0
    values = dequantize_affine_codes(parts.unpacked_codes(), parts.scales, parts.mins, centre).reshape(shape)
    return values, (affine_weight(parts, tensor.tensor_type.name, shape) if len(shape) == 2 else None)


def affine_weight(parts: BlockParts, source_format: str, shape: tuple[int, int]) -> AffineWeight:
    """A [rows, K] tensor's block parts as llmc's affine params (scales and minimums per group)."""
    rows, k = shape
    group_size = parts.block_size // parts.scales.shape[1]
    if parts.packed is not None:
        qweight = parts.packed.reshape(rows, k // 2)
    else:
        qweight = parts.codes.reshape(rows, k)
        qweight = pack_int4(qweight) if parts.scheme == "affine4" else qweight
    store = (lambda t: None if t is None else narrowest_float(t.reshape(rows, k // group_size)))
    packed = (lambda f_i: pack_k_params(f_i[0].reshape(rows, -1), f_i[1].reshape(rows, -1)))
    scales = packed(parts.k_scales) if parts.k_scales else store(parts.scales)
    mins = packed(parts.k_mins) if parts.k_mins else store(parts.mins)
    return AffineWeight(parts.scheme, source_format, group_size, qweight, scales, mins)


def narrowest_float(values: torch.Tensor) -> torch.Tensor:
    """float16 when it holds every value exactly (GGUF's own fp16 scales), else float32."""
    if values.dtype == torch.float16:
        return values.contiguous()
    half = values.to(torch.float16)
    return half if torch.equal(half.float(), values) else values.contiguous()


def raw_bytes(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor's bytes, copied (the map is read-only); the mapped pages they were read from
    are then given back, so reading a whole file leaves none of it in the process's memory."""
    copied = torch.from_numpy(np.array(tensor.data).reshape(-1).view(np.uint8))
    unmap_pages(tensor.data)
    return copied


def unmap_pages(mapped: np.ndarray) -> None:
    """Drop the process's pages wholly inside `mapped`, a view of a read-only shared file mapping:
    a later read faults them back in from the page cache, unchanged (Linux; a no-op elsewhere)."""
    start, end = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    madvise = getattr(LIBC, "madvise", None)
    if last > first and madvise is not None:
        madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
MADV_DONTNEED = 4


def block_parts(tensor: ReaderTensor) -> BlockParts | None:
    decoder = BLOCK_DECODERS.get(tensor.tensor_type)
    if decoder is None:
        return None
    _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    return decoder(raw_bytes(tensor).reshape(-1, type_size))


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """One fp16 field per block, as float32 of shape (blocks, 1)."""
    return _half16(blocks, start).float()


def _half16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """One fp16 field per block, as it is stored: float16 of shape (blocks, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16)


def _repacked(packed: torch.Tensor, width: int) -> torch.Tensor:
    """GGUF's nibbles (each run of `width` bytes holds `width` codes in its low nibbles, then the
    next `width` in its high ones) as pack_int4 packs those codes (two consecutive codes a byte,
    the first low), byte by byte without unpacking: (n, bytes) uint8."""
    runs = packed.reshape(packed.shape[0], -1, width)
    even, odd = runs[..., 0::2], runs[..., 1::2]     # codes 2i, 2i+1 (low) and width+2i, width+2i+1 (high)
    low, high = (even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)
    return torch.cat([low, high], dim=-1).reshape(packed.shape[0], -1)


def _nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's bytes split into low then high nibbles, `width` bytes at a time: (n, -1, width) uint8."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return ((packed.reshape(packed.shape[0], -1, 1, width) >> shifts) & 0x0F).reshape(packed.shape[0], -1, width)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 per block), as (n, 32) uint8."""
    word = qh.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((word >> torch.arange(32)) & 1).to(torch.uint8)


def _flat(codes: torch.Tensor) -> torch.Tensor:
    return codes.reshape(codes.shape[0], -1)


def _q4_0(blocks: torch.Tensor) -> BlockParts:
    return BlockParts("affine4", None, _half16(blocks, 0), None, _repacked(blocks[:, 2:], 16))


def _q4_1(blocks: torch.Tensor) -> BlockParts:
    return BlockParts("affine4", None, _half16(blocks, 0), _half16(blocks, 2), _repacked(blocks[:, 4:], 16))


def _q5_0(blocks: torch.Tensor) -> BlockParts:
    low = _flat(_nibbles(blocks[:, 6:], 16))
    codes = (low | (_high_bits(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return BlockParts("affine8", codes, _half(blocks, 0), None)


def _q5_1(blocks: torch.Tensor) -> BlockParts:
    low = _flat(_nibbles(blocks[:, 8:], 16))
    codes = (low | (_high_bits(blocks[:, 4:8]) << 4)).to(torch.int8)
    return BlockParts("affine8", codes, _half(blocks, 0), _half(blocks, 2))


def _q8_0(blocks: torch.Tensor) -> BlockParts:
    return BlockParts("affine8", blocks[:, 2:].contiguous().view(torch.int8), _half16(blocks, 0), None)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins per block, packed in 12 bytes (gguf's Q4_K.get_scale_min)."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(1)
    scale = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, minimum


def _k_groups(blocks: torch.Tensor) -> dict:
    """Q4_K/Q5_K's eight sub-block scales d·sc and minimums -(dmin·m), float32 (blocks, 8), and their parts
    (d, sc) and (-dmin, m) for the packed form."""
    scale, minimum = _k_scale_min(blocks[:, 4:16])
    d, neg_dmin = _half16(blocks, 0), -_half16(blocks, 2)   # negating an fp16 is exact
    return {"scales": d.float() * scale.float(), "mins": neg_dmin.float() * minimum.float(),
            "k_scales": (d, scale), "k_mins": (neg_dmin, minimum)}


def _q4_k(blocks: torch.Tensor) -> BlockParts:
    return BlockParts("affine4", None, packed=_repacked(blocks[:, 16:], 32), **_k_groups(blocks))


def _q5_k(blocks: torch.Tensor) -> BlockParts:
    n = blocks.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> shifts) & 0x01       # bit j of byte i: sub-block j
    codes = _nibbles(blocks[:, 48:], 32) | (high << 4)
    return BlockParts("affine8", _flat(codes).to(torch.int8), **_k_groups(blocks))


def _q6_k(blocks: torch.Tensor) -> BlockParts:
    n = blocks.shape[0]
    d, sc = _half16(blocks, 208), blocks[:, 192:208].contiguous().view(torch.int8)
    scales = d.float() * sc.float()
    low = _nibbles(blocks[:, :128], 64).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1, 32)
    return BlockParts("affine8", _flat((low | (high << 4)).to(torch.int8) - 32), scales, None, k_scales=(d, sc))


def _bf16(raw: torch.Tensor) -> torch.Tensor:
    return (raw.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


FLOAT_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: lambda raw: raw.view(torch.float32), Q.F16: lambda raw: raw.view(torch.float16).float(),
    Q.BF16: _bf16,
}
BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], BlockParts]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
