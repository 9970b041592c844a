"""KV cache quantisation arithmetic: keys and values stored as int8 or float8_e4m3fn with one
static scale per layer and KV head (x ≈ q · s), quantised on write and read back to the
compute dtype. The scales come from the artifact (`kv_scales.<layer>`, fp32 [2, kv_heads]).
An int4 cache instead packs each token's head as 4-bit codes with a dynamic fp16 scale per group of
channels, computed on write (compiler/schemes.py says why)."""

from __future__ import annotations

import torch

from llmc.compiler.quant import kv_int4_codes, kv_int4_group, kv_int4_scales, pack_int4, unpack_int4
from llmc.compiler.schemes import KV_CACHE_FORMATS
from llmc.errors import ArtifactError

# Largest magnitude each statically scaled storage dtype holds; the scales map a head's calibrated absmax
# onto it. (An int4 cache is a uint8 tensor of packed rows with its scales inside: PagedKVCache's kv_group.)
KV_QMAX = {f.torch_dtype: f.qmax for f in KV_CACHE_FORMATS.values() if f.static}
# int4 codes -7..7 are stored as nibbles 1..15
INT4_OFFSET = 8


def is_quantized_kv(dtype: torch.dtype) -> bool:
    return dtype in KV_QMAX


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., kv_heads, head_dim], scale fp32 [kv_heads] -> codes of `dtype`, same shape.
    int8 rounds to nearest; both saturate at ±qmax rather than wrap or overflow to NaN."""
    qmax = KV_QMAX[dtype]
    y = x.to(torch.float32) / scale[:, None]
    if dtype == torch.int8:
        y = y.round()
    return y.clamp_(-qmax, qmax).to(dtype)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., kv_heads, head_dim], scale [kv_heads] -> values of `dtype`."""
    return q.to(dtype) * scale[:, None].to(dtype)


def quantize_kv_int4(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., head_dim] -> uint8 rows [..., head_dim / 2 + 2 * head_dim / group]: the codes (-7..7, stored
    + 8) two a byte, the low nibble the even channel, then each group's fp16 scale as two bytes; the
    arithmetic of compiler/quant.py's fake_quant_kv_int4."""
    scales = kv_int4_scales(x, group)
    codes = (kv_int4_codes(x, scales) + INT4_OFFSET).to(torch.uint8)
    return torch.cat([pack_int4(codes), scales.view(torch.uint8)], dim=-1)


def dequantize_kv_int4(rows: torch.Tensor, head_dim: int, group: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_kv_int4's rows [..., row bytes] -> values [..., head_dim] of `dtype`."""
    half = head_dim // 2
    codes = unpack_int4(rows[..., :half]).to(dtype).sub_(INT4_OFFSET)
    # the scale bytes sit at an even offset of each row, so they view as fp16 once contiguous
    scales = rows[..., half:].contiguous().view(torch.float16).to(dtype)
    return (codes.view(*codes.shape[:-1], -1, group) * scales[..., None]).view(codes.shape)


def kv_group_of(kv_cache: dict, head_dim: int) -> int | None:
    """The int4 group size a manifest's model.kv_cache record asks for (None: not a grouped cache)."""
    if kv_cache.get("format") is None:
        return None
    fmt = KV_CACHE_FORMATS.get(kv_cache["format"])
    group = kv_cache.get("group_size")
    if fmt is None or not fmt.grouped or group != fmt.group_size(head_dim) or kv_cache["dtype"] != "uint8":
        raise ArtifactError(f"manifest model.kv_cache {kv_cache!r:.120} is no KV format this llmc reads (expected "
                            f"int4 in uint8 rows, groups of {kv_int4_group(head_dim)}); recompile the artifact")
    return group


def load_kv_scales(weights: dict[str, torch.Tensor], kv_cache: dict, num_layers: int,
                   num_kv_heads: int) -> list[torch.Tensor]:
    """Per layer fp32 [2, kv_heads] (row 0 keys, row 1 values) from the artifact's weights,
    named by the manifest's `kv_cache.scale_params` template."""
    template = kv_cache.get("scale_params", "kv_scales.{layer}")
    scales = []
    for layer in range(num_layers):
        name = template.format(layer=layer)
        if name not in weights:
            raise ArtifactError(f"manifest model.kv_cache asks for a {kv_cache['dtype']} KV cache, but the "
                                f"weights hold no {name!r}; the artifact is incomplete, recompile it "
                                f"with --kv-cache")
        s = weights[name].to(torch.float32)
        if tuple(s.shape) != (2, num_kv_heads) or not bool((s > 0).all()):
            raise ArtifactError(f"KV scales {name!r} must be positive fp32 [2, {num_kv_heads}], got "
                                f"{list(s.shape)}; recompile the artifact with --kv-cache")
        scales.append(s.clone())
    return scales


__all__ = ["KV_QMAX", "INT4_OFFSET", "is_quantized_kv", "quantize_kv", "dequantize_kv", "quantize_kv_int4",
           "dequantize_kv_int4", "kv_group_of", "load_kv_scales"]
