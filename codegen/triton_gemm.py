"""Launchers of the dequantising Triton GEMM (codegen/templates/dequant_gemm.py.j2): pick the
rendered kernel for a scheme, dtypes and target tile config, size the grid, and run it."""

from __future__ import annotations

import torch

from llmc.codegen.triton_configs import TileConfig, tile_config
from llmc.codegen.triton_render import RenderedKernel, load_kernel, render_kernel

GEMM_SCHEMES = ("int8", "int4", "fp8")
ACTIVATION_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
WEIGHT_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}
WEIGHT_LAYOUTS = {"int8": "int8 [N, K]", "int4": "uint8 [N, K/2], two codes a byte",
                  "fp8": "float8_e4m3fn [N, K]"}


def render_dequant_gemm(scheme: str, config: TileConfig, *, group_size: int | None = None,
                        x_dtype: str = "float32", out_dtype: str = "float32", per_channel_scale: bool = True,
                        has_act_scale: bool = False, has_bias: bool = False) -> RenderedKernel:
    """The kernel source for one scheme, dtype pair and tile config; `group_size` only for int4,
    `has_act_scale` only for fp8, `per_channel_scale=False` for scales of shape [1]."""
    if scheme not in GEMM_SCHEMES:
        raise ValueError(f"no Triton dequant GEMM for scheme {scheme!r}; known: {', '.join(GEMM_SCHEMES)}")
    assert (group_size is not None) == (scheme == "int4"), (scheme, group_size)
    assert not has_act_scale or scheme == "fp8", scheme
    constants = dict(SCHEME=scheme, WEIGHT_LAYOUT=WEIGHT_LAYOUTS[scheme], X_DTYPE=x_dtype, OUT_DTYPE=out_dtype,
                     BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                     GROUP_SIZE=group_size or 0, PER_CHANNEL_SCALE=per_channel_scale,
                     HAS_ACT_SCALE=has_act_scale, HAS_BIAS=has_bias, DOT_PRECISION=config.dot_precision,
                     NUM_WARPS=config.num_warps, NUM_STAGES=config.num_stages)
    return render_kernel("dequant_gemm.py.j2", f"dequant_gemm_{scheme}", constants)


def dequant_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                 *, scheme: str, group_size: int | None = None, act_scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, target: str = "h100",
                 config: TileConfig | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(qweight)^T (+ bias) -> [..., N] in x's dtype, storage as in
    docs/quantization.md; `config` overrides the target's tile config."""
    config = config or tile_config(target)
    n, k = _check_operands(x, qweight, scales, zeros, scheme, group_size, act_scale, bias)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    scales = scales.contiguous()                           # the kernel indexes zeros with scales' strides
    zeros = zeros.contiguous() if zeros is not None else None
    kernel = load_kernel(render_dequant_gemm(
        scheme, config, group_size=group_size if scheme == "int4" else None,
        x_dtype=ACTIVATION_DTYPES[x.dtype], out_dtype=ACTIVATION_DTYPES[x.dtype],
        per_channel_scale=scales.numel() > 1 or scheme == "int4", has_act_scale=act_scale is not None,
        has_bias=bias is not None))
    grid = (_cdiv(m, config.block_m), _cdiv(n, config.block_n))
    zeros_arg = zeros if zeros is not None else scales    # unused operands still need a pointer
    stride_sg = scales.stride(1) if scales.dim() == 2 else 0
    kernel[grid](x2, qweight, scales, zeros_arg, act_scale if act_scale is not None else scales,
                 bias if bias is not None else scales, y, m, n, k,
                 x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), stride_sg,
                 y.stride(0), y.stride(1), num_warps=config.num_warps, num_stages=config.num_stages)
    return y.reshape(*x.shape[:-1], n)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_operands(x, qweight, scales, zeros, scheme, group_size, act_scale, bias) -> tuple[int, int]:
    """(N, K) after checking every operand against the storage formats; mismatches are bugs of
    the caller (the artifact was verified at load), so they raise ValueError."""
    if scheme not in GEMM_SCHEMES:
        raise ValueError(f"no Triton dequant GEMM for scheme {scheme!r}; known: {', '.join(GEMM_SCHEMES)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activations must be one of {list(ACTIVATION_DTYPES)}, got {x.dtype}")
    if qweight.dtype != WEIGHT_DTYPES[scheme] or qweight.dim() != 2:
        raise ValueError(f"{scheme} qweight must be 2-D {WEIGHT_DTYPES[scheme]}, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    for name, t in (("scales", scales), ("zeros", zeros), ("act_scale", act_scale)):
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"{scheme} {name} must be float32, got {t.dtype}")
    n, k = qweight.shape[0], qweight.shape[1] * (2 if scheme == "int4" else 1)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the {scheme} qweight {tuple(qweight.shape)} "
                         f"stands for {k}")
    if scheme == "int4":
        _check_groups(scales, zeros, n, k, group_size)
    elif scales.shape not in ((n,), (1,)):
        raise ValueError(f"{scheme} scales must have shape ({n},) or (1,), got {tuple(scales.shape)}")
    if act_scale is not None and (scheme != "fp8" or act_scale.numel() != 1):
        raise ValueError(f"act_scale is a one-element fp32 tensor of the fp8 scheme, got {scheme} "
                         f"{tuple(act_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    return n, k


def _check_groups(scales, zeros, n, k, group_size) -> None:
    if not group_size or k % group_size:
        raise ValueError(f"int4 group_size {group_size} must divide in_features {k}")
    shape = (n, k // group_size)
    if zeros is None or scales.shape != shape or zeros.shape != shape:
        raise ValueError(f"int4 scales and zeros must both have shape {shape}, got {tuple(scales.shape)} "
                         f"and {None if zeros is None else tuple(zeros.shape)}")


__all__ = ["GEMM_SCHEMES", "render_dequant_gemm", "dequant_gemm"]
