"""qlinear on the CPU for the schemes that quantise activations too: fp8 (static per-tensor
activation scale) and w8a8 (per-token dynamic int8 activations). Weights are prepared once at
load; both GEMMs multiply exact codes and apply the scales to the output.

fp8: torch._scaled_mm runs on the CPU in torch 2.13 but is ~35x slower than a bf16 GEMM, so the
e4m3 weight codes are widened once to bf16 (exact: e4m3 has 3 mantissa bits, bf16 7), the
activations rounded to e4m3 codes with the static scale and widened the same way, and one bf16
GEMM runs. w8a8: torch._int_mm (int8 x int8 -> int32) runs on the CPU for every M, K, N we
tried (M = 1..64, K = 64, 72, 100, 576), unlike CUDA (M > 16, K and N multiples of 8); without
it the int8 codes, exact in bf16, take the bf16 GEMM. Measured on this 2-core x86 host, one
thread, N=1536 K=576 (a SmolLM2 MLP projection), torch 2.13, whole kernel (activation
quantisation included):
    M=1:  fp32 F.linear 113 us; fp8 161 us; w8a8 54 us; torch._scaled_mm (fp8) 3.8 ms
    M=64: fp32 F.linear 1.2-1.9 ms; bf16 F.linear 0.88 ms; fp8 0.90 ms; w8a8 0.38 ms;
          torch._scaled_mm (fp8) 5.3 ms
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmc.compiler.quant import FP8_E4M3_MAX, INT8_MAX

INT_MM = getattr(torch, "_int_mm", None)


class Fp8Weights(NamedTuple):
    codes: torch.Tensor               # bf16 [N, K]: the e4m3 codes, widened exactly
    scales: torch.Tensor              # fp32 [N] per channel, or [1] per tensor
    act_scale: torch.Tensor | None    # fp32 [1]; None: activations are not quantised


class W8A8Weights(NamedTuple):
    qweight: torch.Tensor             # int8 [N, K]
    scales: torch.Tensor              # fp32 [N]


def pack_fp8(qweight: torch.Tensor, scales: torch.Tensor, act_scale: torch.Tensor | None) -> Fp8Weights:
    act = None if act_scale is None else act_scale.float().reshape(1)
    return Fp8Weights(qweight.to(torch.bfloat16).contiguous(), scales.float().reshape(-1), act)


def pack_w8a8(qweight: torch.Tensor, scales: torch.Tensor, act_scale=None) -> W8A8Weights:
    return W8A8Weights(qweight.contiguous(), scales.float().reshape(-1))


def fp8_matmul(x2: torch.Tensor, w: Fp8Weights) -> torch.Tensor:
    """x2 fp32 [M, K] -> fp32 [M, N] = fp8(x/a)·a · (q·s)ᵀ, codes multiplied in one bf16 GEMM."""
    if w.act_scale is None:
        return F.linear(x2.to(torch.bfloat16), w.codes).float() * w.scales
    codes = (x2 / w.act_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return F.linear(codes.to(torch.bfloat16), w.codes).float() * (w.scales * w.act_scale)


def quantize_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (int8 codes [M, K], fp32 scales [M, 1]), as fake_quant_int8_per_token rounds."""
    scales = x2.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (x2 / scales).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def w8a8_matmul(x2: torch.Tensor, w: W8A8Weights) -> torch.Tensor:
    """x2 fp32 [M, K] -> fp32 [M, N]: int8 x int8 with int32 accumulation, then both scales."""
    q, x_scales = quantize_per_token(x2)
    if INT_MM is None:
        return F.linear(q.to(torch.bfloat16), w.qweight.to(torch.bfloat16)).float() * x_scales * w.scales
    acc = INT_MM(q, w.qweight.t())     # exact while K·127² < 2³¹ (K < 133,000)
    # widen, then scale in place: torch.mul(acc, x_scales) does the same in one pass but through
    # torch's unvectorised mixed-dtype path, 5x slower at M=512 N=3072 (6.1 ms against 1.1 ms)
    return acc.float().mul_(x_scales).mul_(w.scales)


PACKERS = {"fp8": pack_fp8, "w8a8": pack_w8a8}
MATMULS = {Fp8Weights: fp8_matmul, W8A8Weights: w8a8_matmul}


def pack_a8_qlinear(scheme: str, qweight: torch.Tensor, scales: torch.Tensor,
                    act_scale: torch.Tensor | None = None):
    """Prepared CPU weights of an fp8/w8a8 qlinear, or None for another scheme."""
    packer = PACKERS.get(scheme)
    return None if packer is None else packer(qweight, scales, act_scale)


def run_a8_qlinear(x: torch.Tensor, weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype; activations are quantised from fp32."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    y = MATMULS[type(weights)](x2, weights)
    out = y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


__all__ = ["Fp8Weights", "W8A8Weights", "pack_fp8", "pack_w8a8", "pack_a8_qlinear", "run_a8_qlinear",
           "quantize_per_token", "INT_MM"]
