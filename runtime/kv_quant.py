"""KV cache quantisation arithmetic: keys and values stored as int8 or float8_e4m3fn with one
static scale per layer and KV head (x ≈ q · s), quantised on write and read back to the
compute dtype. The scales come from the artifact (`kv_scales.<layer>`, fp32 [2, kv_heads])."""

from __future__ import annotations

import torch

from llmc.compiler.schemes import KV_CACHE_FORMATS
from llmc.errors import ArtifactError

# Largest magnitude each storage dtype holds; the scales map a head's calibrated absmax onto it.
KV_QMAX = {f.torch_dtype: f.qmax for f in KV_CACHE_FORMATS.values()}


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


__all__ = ["KV_QMAX", "is_quantized_kv", "quantize_kv", "dequantize_kv", "load_kv_scales"]
