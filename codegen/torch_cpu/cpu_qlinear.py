"""qlinear on the CPU through torch's packed weight-only GEMMs: int8 per channel with
`torch._weight_int8pack_mm`, int4 and affine4 (GGUF's 4-bit blocks) in groups with
`torch._weight_int4pack_mm_for_cpu` over weights converted once by
`torch._convert_weight_to_int4pack_for_cpu`. affine8 (GGUF's 5- to 8-bit blocks), which no torch
kernel takes in groups, is dequantised once at load and runs as an fp32 GEMM: exactly the
reference (dequantising on every call instead measured ~30x slower for SmolLM2's LM head).

Both kernels are fast only with bf16 activations, so x is cast to bf16 for the GEMM and the
result back to x's dtype. Measured on this 2-core x86 host (2 threads, quiet), N=1536 K=576 (a
SmolLM2 MLP projection), torch 2.13, casts included:
    M=1 (decode):   fp32 F.linear 72 us; int8 32 us with bf16 x vs 374 us with fp32 x;
                    int4 g64 36 us with bf16 x vs 750 us with fp32 x
    M=64 (prefill): fp32 F.linear 0.69 ms; int8 1.0 ms with bf16 x vs 24 ms with fp32 x;
                    int4 g64 0.77 ms with bf16 x vs 74 ms with fp32 x
so decode runs about twice as fast as fp32 and prefill somewhat slower.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from llmc.compiler.quant import AFFINE4_CENTRE, dequantize_affine, group_params, unpack_int4

# _weight_int8pack_mm returns garbage (K=72) or crashes (K=100) unless K is a multiple of 16.
INT8_K_MULTIPLE = 16
# _convert_weight_to_int4pack_for_cpu wants N a multiple of 16; the GEMM these group sizes.
INT4_N_MULTIPLE = 16
INT4_GROUP_SIZES = (32, 64, 128, 256)
# Ignored by the CPU conversion in torch 2.13 (any value gives the same layout); 2 as in gpt-fast.
INNER_K_TILES = 2


class Int8Weights(NamedTuple):
    qweight: torch.Tensor     # int8 [N, Kp]: K padded with zero columns to INT8_K_MULTIPLE
    scales: torch.Tensor      # bf16 [N]
    k_pad: int


class Int4Weights(NamedTuple):
    packed: torch.Tensor            # torch's CPU int4 layout of codes [Np, K], Np = N rounded up to 16
    scales_and_zeros: torch.Tensor  # bf16 [K/g, Np, 2]: w = (q - 8) * s + zero_point
    out_features: int
    group_size: int


class DenseWeights(NamedTuple):
    weight: torch.Tensor            # float32 [N, K], dequantised once


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor, zeros, group_size: int) -> Int8Weights:
    k_pad = -qweight.shape[1] % INT8_K_MULTIPLE
    q = F.pad(qweight, (0, k_pad)) if k_pad else qweight
    return Int8Weights(q.contiguous(), scales.to(torch.bfloat16).reshape(-1).contiguous(), k_pad)


def pack_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> Int4Weights | None:
    """Our w = (q - z)·s is torch's (q - 8)·s + zero_point with zero_point = (8 - z)·s.
    Padding rows have s = 0 and zero_point = 0, so they compute 0 and are sliced off."""
    if group_size not in INT4_GROUP_SIZES:
        return None
    zero_point = (8.0 - zeros.float()) * scales.float()
    return _pack_int4_codes(unpack_int4(qweight), scales, zero_point, group_size)


def _pack_int4_codes(codes: torch.Tensor, scales: torch.Tensor, zero_point: torch.Tensor,
                     group_size: int) -> Int4Weights:
    """Codes [N, K] in 0..15 with w = (q - 8)·s + zero_point, in torch's CPU int4 layout."""
    codes = codes.to(torch.int32)
    n, n_pad = codes.shape[0], -codes.shape[0] % INT4_N_MULTIPLE
    codes = F.pad(codes, (0, 0, 0, n_pad), value=8)
    s, zp = (F.pad(t.float(), (0, 0, 0, n_pad)) for t in (scales, zero_point))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), INNER_K_TILES)
    scales_and_zeros = torch.stack([s, zp], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return Int4Weights(packed, scales_and_zeros, n, group_size)


def pack_affine4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 group_size: int) -> Int4Weights | DenseWeights:
    """w = q·s + m is torch's (q - 8)·s + zero_point with zero_point = m + 8·s (without minimums
    w = (q - 8)·s, zero_point 0); group sizes torch cannot pack run dequantised."""
    if group_size not in INT4_GROUP_SIZES:
        return pack_affine8("affine4", qweight, scales, mins)
    k = 2 * qweight.shape[1]
    scales, mins = group_params(scales, k), group_params(mins, k)
    zero_point = torch.zeros_like(scales, dtype=torch.float32) if mins is None else (
        mins.float() + AFFINE4_CENTRE * scales.float())
    return _pack_int4_codes(unpack_int4(qweight), scales.float(), zero_point, group_size)


def pack_affine8(scheme: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 group_size: int = -1) -> DenseWeights:
    return DenseWeights(dequantize_affine(scheme, qweight, scales, mins).contiguous())


# scheme -> packer(qweight, scales, zeros, group_size) -> packed weights, or None to fall back
PACKERS: dict[str, Callable] = {"int8": pack_int8, "int4": pack_int4, "affine4": pack_affine4,
                                "affine8": functools.partial(pack_affine8, "affine8")}


def pack_qlinear(scheme: str, qweight, scales, zeros, group_size: int):
    """Packed CPU weights of a qlinear, or None when torch has no kernel for it."""
    packer = PACKERS.get(scheme)
    return None if packer is None else packer(qweight, scales, zeros, group_size)


def int8_matmul(x2: torch.Tensor, w: Int8Weights) -> torch.Tensor:
    if w.k_pad:
        x2 = F.pad(x2, (0, w.k_pad))
    return torch._weight_int8pack_mm(x2, w.qweight, w.scales)


def int4_matmul(x2: torch.Tensor, w: Int4Weights) -> torch.Tensor:
    y = torch._weight_int4pack_mm_for_cpu(x2, w.packed, w.group_size, w.scales_and_zeros)
    return y[:, :w.out_features]


MATMULS = {Int8Weights: int8_matmul, Int4Weights: int4_matmul}


def run_qlinear(x: torch.Tensor, weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype; the packed GEMMs run on bf16 activations, dense
    weights as the reference does (fp32)."""
    if isinstance(weights, DenseWeights):
        return F.linear(x.float(), weights.weight, None if bias is None else bias.float()).to(x.dtype)
    if x.dim() == 2 and x.is_contiguous():   # a decode step's [rows, K]: three dispatches fewer
        # .bfloat16() / .float() rather than .to(dtype): no overload resolution, ~1.3 us a call less
        y = MATMULS[type(weights)](x.bfloat16(), weights)
        out = y.float() if x.dtype == torch.float32 else y.to(x.dtype)
    else:
        y = MATMULS[type(weights)](x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous(), weights)
        out = y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


__all__ = ["Int8Weights", "Int4Weights", "DenseWeights", "PACKERS", "MATMULS", "pack_int8", "pack_int4",
           "pack_affine4", "pack_affine8", "pack_qlinear", "run_qlinear"]
