"""Quantisation arithmetic of the storage formats in docs/quantization.md: quantise and
dequantise weights (int8 per channel, int4 in groups with zero points, fp8 e4m3, and the
grouped-affine codes GGUF block formats import as), pack int4 codes two to a byte, and
fake-quantise activations (fp8 static, int8 per token). Pure torch; which scheme uses which
function is compiler/schemes.py's table."""

from __future__ import annotations

import torch

INT8_MAX = 127           # symmetric int8 uses -127..127, so -q is always representable
INT4_MAX = 15            # int4 codes are unsigned, 0..15
FP8_E4M3_MAX = 448.0     # largest finite float8_e4m3fn


def fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): elsewhere torch's bf16 GEMM widens
    its operands on every call and runs far below fp32's (256 x 576 x 1536 on an AVX2 Zen 3: 45 against
    7.6 ms), so work that takes bf16 for speed keeps fp32 there."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (for exact tests); every other float works in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero row or group has scale 0; any positive scale represents it exactly.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# -- int8, symmetric per output channel: w = q * s -----------------------------------------
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], scales fp32 [N]); |w - q*s| <= s/2."""
    w = weight.to(compute_dtype(weight))
    scales = _safe((w.abs().amax(dim=1) / INT8_MAX).float())
    # Round against the scale as stored (fp32), so the bound holds for what is saved.
    q = torch.round(w / scales.to(w.dtype)[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K], scales [N] (or [1]) -> w [N, K] in `dtype`."""
    return q.to(dtype) * scales.to(dtype).reshape(-1, 1)


# -- int4, asymmetric in groups of g along K: w = (q - z) * s, q in 0..15 ----------------------
def int4_grid(groups: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero point of each row of `groups` [..., g] (GPTQ's min/max grid): the
    range always holds 0, so zero weights stay exact, and z lies in 0..2^bits-1."""
    return int4_grid_of_range(groups.amin(-1), groups.amax(-1), bits)


def int4_grid_of_range(lo: torch.Tensor, hi: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """int4_grid of groups whose least and greatest values are lo and hi."""
    maxq = 2 ** bits - 1
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scales = _safe(((hi - lo) / maxq).float())
    zeros = torch.round(-lo / scales.to(lo.dtype)).clamp(0, maxq).float()
    return scales, zeros


def quantize_to_grid(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int = 4) -> torch.Tensor:
    """Integer codes (in the groups' float dtype) of groups [..., g] on the grid (scales, zeros) [...]."""
    s, z = scales.to(groups.dtype)[..., None], zeros.to(groups.dtype)[..., None]
    # the same operations in place on one quotient: a table's worth of temporaries is not made thrice
    return torch.div(groups, s).round_().add_(z).clamp_(0, 2 ** bits - 1)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest: weight [N, K] -> (codes uint8 [N, K] in 0..15, scales fp32 [N, K/g],
    zeros fp32 [N, K/g]); |w - (q - z)*s| <= s/2. K must be a multiple of group_size."""
    n, k = weight.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    groups = weight.to(compute_dtype(weight)).reshape(n, k // group_size, group_size)
    scales, zeros = int4_grid(groups)
    codes = quantize_to_grid(groups, scales, zeros)
    return codes.reshape(n, k).to(torch.uint8), scales, zeros


def dequantize_int4_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpacked codes [N, K], scales/zeros [N, K/g] -> w [N, K] in `dtype`; groups contiguous along K."""
    n, k = codes.shape
    groups = scales.shape[1]
    # one [N, K] allocation, worked in place: an LM head's dequantised weight is hundreds of MB,
    # and each temporary (broadcast scales, a difference) would cost as much again
    w = codes.to(dtype, copy=True).reshape(n, groups, k // groups)
    w.sub_(zeros.to(dtype)[..., None]).mul_(scales.to(dtype)[..., None])
    return w.reshape(n, k)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [N, K/2] -> w [N, K] in `dtype`."""
    return dequantize_int4_codes(unpack_int4(packed), scales, zeros, dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> uint8 [N, K/2]; the low nibble holds the even k."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes uint8 [N, K]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# -- grouped affine, as GGUF blocks store weights, in groups of g along K ------------------------
# affine4: codes 0..15 packed as int4, w = q * s + m, or w = (q - 8) * s without minimums (Q4_0);
# affine8: codes -128..127 as int8, w = q * s (+ m). s and m are float16 or float32 [N, K/g].
# The fp32 product q * s is exact for every GGUF format llmc imports (fp16, or fp16 times a 6-bit
# scale, times a code of at most 6 bits) or rounds once as GGUF's own Q6_K does, and + m rounds
# once, as gguf.quants.dequantize does: the weights are bit-identical to the file's.
AFFINE4_CENTRE = 8

# K-quant group params, packed: GGUF's Q4_K/Q5_K/Q6_K scale each group of g (32 or 16) weights by d * c, an
# fp16 factor d per super-block of 256 weights times a small signed integer c per group (minimums alike, with
# -dmin). Their fp32 products are exact (11 by at most 8 significant bits) but not fp16-exact, so stored as
# fp32 they took 2 bits a weight (a 4.5-bit Q4_K weight became 6); packed they take 0.625 (4.625 a weight).
# A packed row is uint8 [2 S + G]: the S = K/256 factors d (fp16 bits), then the G = K/g integers c (int8).
# Unpacking gives the very fp32 values, so every kernel computes what it did on the fp32 params.
K_SUPER = 256


def pack_k_params(factors: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """fp16 factors [N, S] and integers [N, G] (each within int8) -> packed uint8 [N, 2 S + G]."""
    n = factors.shape[0]
    return torch.cat([factors.to(torch.float16).contiguous().view(torch.uint8).reshape(n, -1),
                      ints.to(torch.int8).view(torch.uint8).reshape(n, -1)], dim=1)


def is_packed(params: torch.Tensor | None) -> bool:
    """Whether group params are K-quant packed (uint8) rather than float values."""
    return params is not None and params.dtype == torch.uint8


def packed_groups(width: int, k: int) -> int:
    """Groups G of a packed row `width` bytes wide over K inputs (width = 2 K/256 + G)."""
    return width - 2 * (k // K_SUPER)


def group_params(params: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """Group scales or minimums [N, G] as float values: float ones as they are, packed ones unpacked to fp32."""
    if not is_packed(params):
        return params
    n, supers = params.shape[0], k // K_SUPER
    factors = params[:, :2 * supers].contiguous().view(torch.float16).float()
    ints = params[:, 2 * supers:].contiguous().view(torch.int8).float()
    return (ints.reshape(n, supers, -1) * factors[..., None]).reshape(n, -1)


def dequantize_affine(scheme: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored codes (uint8 [N, K/2] for affine4, int8 [N, K] for affine8), scales/mins [N, K/g]
    -> w [N, K] in `dtype`."""
    if scheme == "affine4":
        centre = AFFINE4_CENTRE if mins is None else 0
        return dequantize_affine_codes(unpack_int4(qweight), scales, mins, centre, dtype)
    return dequantize_affine_codes(qweight, scales, mins, 0, dtype)


def dequantize_affine_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                            centre: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpacked codes [N, K], scales/mins [N, K/g] (or K-quant packed) -> w = (q - centre) * s (+ m) [N, K]
    in `dtype`."""
    # in place on one fresh copy: a whole model's weights pass through here at load, and each
    # further [N, K] temporary costs its page faults (the same operations, so the same values)
    scales, mins = group_params(scales, codes.shape[1]), group_params(mins, codes.shape[1])
    q = codes.to(dtype, copy=True)
    if centre:
        q.sub_(centre)
    n, k = q.shape
    groups = q.view(n, scales.shape[1], -1).mul_(scales.to(dtype)[..., None])
    if mins is not None:
        groups.add_(mins.to(dtype)[..., None])
    return q


# -- fp8 e4m3: w = q * s, activations through a static per-tensor scale ------------------------
def quantize_fp8(weight: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q float8_e4m3fn [N, K], scales fp32 [N] per channel, else [1])."""
    w = weight.to(compute_dtype(weight))
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scales = _safe((amax / FP8_E4M3_MAX).float())
    q = (w / scales.to(w.dtype)[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scales.to(dtype).reshape(-1, 1)


def fake_quant_fp8(x: torch.Tensor, act_scale: torch.Tensor) -> torch.Tensor:
    """x̂ = fp8(x / a) * a with the static scale a [1]; saturates at ±448·a."""
    a = act_scale.to(x.dtype)
    return (x / a).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * a


def fake_quant_int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per row of x [..., K] with scale amax(|row|)/127, quantised and back."""
    scales = _safe(x.abs().amax(dim=-1, keepdim=True) / INT8_MAX)
    return torch.round(x / scales).clamp(-INT8_MAX, INT8_MAX) * scales


# -- KV cache: static scale per head (formats: compiler/schemes.py) ----------------------------
# KV-cache storage dtypes -> the largest magnitude each holds (a head's scale maps its absmax there;
# int4's per-group scale maps its group's absmax there)
KV_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "int4": 7.0}
# int4 KV: channels along head_dim that share one dynamic scale (llama.cpp's q4_0 block along head_dim)
KV_INT4_GROUP = 32
FP16_MAX = 65504.0


def fake_quant_kv(x: torch.Tensor, scale: torch.Tensor, storage: str) -> torch.Tensor:
    """x [..., kv_heads, head_dim] through a static-scale KV cache of `storage` and back, with the
    runtime's arithmetic (runtime/kv_quant.py; a test holds the two equal): int8 rounds to
    nearest, both saturate at ±qmax; scale fp32 [kv_heads]."""
    qmax = KV_QMAX[storage]
    y = (x.to(torch.float32) / scale[:, None]).clamp(-qmax, qmax)
    y = y.round() if storage == "int8" else y.to(torch.float8_e4m3fn).to(torch.float32)
    return (y * scale[:, None]).to(x.dtype)


def kv_int4_group(head_dim: int) -> int:
    """Channels per int4 KV scale: KV_INT4_GROUP, or the whole head where head_dim is no multiple of it."""
    return KV_INT4_GROUP if head_dim % KV_INT4_GROUP == 0 else head_dim


def kv_int4_row_bytes(head_dim: int, group: int) -> int:
    """Bytes of one token's head in an int4 KV cache: its codes two a byte, then an fp16 scale a group."""
    return head_dim // 2 + 2 * (head_dim // group)


def kv_int4_scales(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., head_dim] -> the fp16 scale of each `group` channels [..., head_dim / group]: the group's
    absmax / 7, kept inside fp16's range (a group beyond 7 * 65504 saturates)."""
    groups = x.to(torch.float32).reshape(*x.shape[:-1], -1, group)
    return (groups.abs().amax(dim=-1) / KV_QMAX["int4"]).clamp_(max=FP16_MAX).to(torch.float16)


def kv_int4_codes(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] and kv_int4_scales' scales -> codes in -7..7 (float32, same shape): round to
    nearest at the stored fp16 scale; an all-zero group (scale 0) gets codes 0."""
    s = scales.to(torch.float32)
    s = torch.where(s > 0, s, torch.ones_like(s))
    groups = x.to(torch.float32).reshape(*scales.shape, -1)
    return (groups / s[..., None]).round_().clamp_(-KV_QMAX["int4"], KV_QMAX["int4"]).reshape(x.shape)


def fake_quant_kv_int4(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., head_dim] through an int4 KV cache and back, with the runtime's arithmetic
    (runtime/kv_quant.py packs these codes): per token and head, each `group` channels share a dynamic
    fp16 scale absmax / 7 and round to codes -7..7, so |x - back| <= scale / 2 = absmax / 14."""
    scales = kv_int4_scales(x, group)
    codes = kv_int4_codes(x, scales)
    back = codes.reshape(*scales.shape, -1) * scales.to(torch.float32)[..., None]
    return back.reshape(x.shape).to(x.dtype)


__all__ = ["INT8_MAX", "INT4_MAX", "FP8_E4M3_MAX", "compute_dtype", "quantize_int8",
           "dequantize_int8", "int4_grid", "quantize_to_grid", "quantize_int4", "dequantize_int4",
           "dequantize_int4_codes", "pack_int4", "unpack_int4", "quantize_fp8", "dequantize_fp8",
           "fake_quant_fp8", "fake_quant_int8_per_token", "KV_QMAX", "fake_quant_kv",
           "KV_INT4_GROUP", "kv_int4_group", "kv_int4_row_bytes", "kv_int4_scales", "kv_int4_codes",
           "fake_quant_kv_int4",
           "AFFINE4_CENTRE", "K_SUPER", "pack_k_params", "is_packed", "packed_groups", "group_params",
           "dequantize_affine", "dequantize_affine_codes"]
