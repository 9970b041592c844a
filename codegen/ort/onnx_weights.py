"""How a plan parameter becomes an ONNX initializer: a named transform from the stored tensor to the
layout an ONNX op reads (transposed, widened, repacked for MatMulNBits). The ONNX export applies it
at export time; ORT segments record the name and the runtime applies it at load, so the weights are
stored once, in weights.safetensors. Torch only: the runtime imports this module."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from llmc.compiler.quant import K_SUPER, group_params, is_packed, pack_int4, unpack_int4

NBITS_INT8_ZERO = 128     # MatMulNBits bits=8 without zero points reads codes as unsigned, zero 128


def _same(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t


def _transposed(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.t()


def _float32(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """float32 values; K-quant packed group params (compiler/quant.py) unpacked, their group count read
    from `dims` (the initializer's shape: rows x groups values)."""
    if not is_packed(t):
        return t.float()
    if not dims:
        raise ValueError("packed group params need the initializer's shape to be unpacked")
    rows, width = t.shape
    groups = math.prod(dims) // rows
    return group_params(t, K_SUPER * ((width - groups) // 2))


def _int4_codes(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """uint8 [N, K/2] packed nibbles -> one uint8 a code."""
    return unpack_int4(t)


def _unsigned_int8(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """int8 codes q -> uint8 q + 128 (flipping the sign bit is that addition in two's complement)."""
    return t.view(torch.uint8) ^ NBITS_INT8_ZERO


def _transposed_unsigned_int8(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """int8 codes [N, K] -> uint8 q + 128 as [K, N], the B of an unsigned MatMulInteger."""
    return _unsigned_int8(t.t(), dims)


def _scales_per_block(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Per-row scales [N] repeated for each of a row's K/block MatMulNBits blocks: [N * K/block]."""
    rows = t.numel()
    return t.float().reshape(rows, 1).expand(rows, dims[0] // rows)


def _nibble_zeros(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Integer zero points [N, blocks] packed two a byte as MatMulNBits reads them (a row's odd last
    block padded with zero)."""
    codes = t.round().to(torch.uint8)
    return pack_int4(F.pad(codes, (0, 1)) if codes.shape[1] % 2 else codes)


def _byte_pairs(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [..., K] as uint8 bytes: the even-k and odd-k columns (views)."""
    if t.dtype != torch.int8 or t.shape[-1] % 2:
        raise ValueError(f"nibble halves need int8 codes with an even number of columns, got {t.dtype} "
                         f"{list(t.shape)}")
    u = t.contiguous().view(torch.uint8)
    return u[..., 0::2], u[..., 1::2]


def _high_nibbles(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """int8 codes q = 16 h + l (h = floor(q / 16) in -8..7, l in 0..15): h + 8, packed two a byte (even
    k low), which a 4-bit MatMulNBits with its default zero point 8 and scales 16 s reads as 16 h s.
    On q's bits: h is its top nibble in two's complement, and h + 8 that nibble with its top bit
    flipped. (Byte arithmetic on a view: a 28M-code LM head in ~0.1 s, not seconds.)"""
    even, odd = _byte_pairs(t)
    return ((even >> 4) | (odd & 0xF0)) ^ 0x88


def _low_nibbles(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """int8 codes q = 16 h + l: l, packed (read with zero point 0 as l s)."""
    even, odd = _byte_pairs(t)
    return (even & 0x0F) | (odd << 4)


def _float32_times_16(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """16 s in float32: exact, a power of two."""
    return _float32(t, dims) * 16


TRANSFORMS: dict[str, Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]] = {
    "same": _same, "T": _transposed, "f32": _float32, "int4_codes": _int4_codes, "u8": _unsigned_int8,
    "T_u8": _transposed_unsigned_int8,
    "scales_per_block": _scales_per_block, "nibble_zeros": _nibble_zeros,
    "high_nibbles": _high_nibbles, "low_nibbles": _low_nibbles, "f32_x16": _float32_times_16,
}


def integral_zeros(zeros: torch.Tensor) -> bool:
    """Whether int4 zero points are whole codes 0..15 (MatMulNBits then takes them packed)."""
    z = zeros.float()
    return bool(torch.equal(z, z.round()) and z.min() >= 0 and z.max() <= 15)


def initializer(tensor: torch.Tensor, transform: str, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """The contiguous tensor an ONNX initializer holds for a parameter under `transform`, shaped
    `dims` (None: as the transform gives it); a transform or dims that do not fit raise ValueError."""
    if transform not in TRANSFORMS:
        raise ValueError(f"unknown initializer transform {transform!r}; known: {', '.join(TRANSFORMS)}")
    out = TRANSFORMS[transform](tensor, tuple(dims or ()))
    if dims is None:
        return out.contiguous()
    numel = 1
    for d in dims:
        numel *= d
    if out.numel() != numel:
        raise ValueError(f"transform {transform} of a {list(tensor.shape)} tensor gives {out.numel()} elements, "
                         f"not the {list(dims)} the initializer declares")
    return out.reshape(tuple(dims)).contiguous()


__all__ = ["TRANSFORMS", "NBITS_INT8_ZERO", "integral_zeros", "initializer"]
