"""Launchers of the Triton GEMMs over quantised weights: the dequantising GEMM
(codegen/triton/templates/dequant_gemm.py.j2) and the w8a8 int8 GEMM with its per-token activation
quantiser (int8_gemm.py.j2, quantize_int8.py.j2). Each picks the rendered kernels for a scheme,
dtypes and target config, sizes the grid, and runs them; the render_* functions name the exact
sources a launch runs, for a plan to record."""

from __future__ import annotations

import functools

import torch

from llmc.codegen.triton.triton_configs import TileConfig, block_size, row_config, tile_config
from llmc.codegen.triton.triton_render import RenderedKernel, load_kernel, render_kernel
from llmc.compiler.schemes import FLOAT_OFFSET, FP8_STATIC, INT8_PER_TOKEN, SCHEMES, TRITON

# the schemes the dequantising GEMM runs: Triton's, but w8a8 (int8 activations: the int8 GEMM)
GEMM_SCHEMES = tuple(s.name for s in SCHEMES.values() if TRITON in s.families and s.activations != INT8_PER_TOKEN)
ACTIVATION_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
WEIGHT_DTYPES = {s: getattr(torch, SCHEMES[s].code_dtype) for s in GEMM_SCHEMES}
WEIGHT_LAYOUTS = {s: f"{SCHEMES[s].code_dtype} [N, K/2], two codes a byte" if SCHEMES[s].packed
                  else f"{SCHEMES[s].code_dtype} [N, K]" for s in GEMM_SCHEMES}


@functools.cache
def render_dequant_gemm(scheme: str, config: TileConfig, *, group_size: int | None = None,
                        x_dtype: str = "float32", out_dtype: str = "float32", per_channel_scale: bool = True,
                        has_act_scale: bool = False, has_bias: bool = False,
                        has_zeros: bool = False) -> RenderedKernel:
    """The kernel source for one scheme, dtype pair and tile config; `group_size` only for the
    grouped schemes (int4, affine4, affine8), `has_zeros` (minimums) read by affine ones only,
    `has_act_scale` only for fp8, `per_channel_scale=False` for scales of shape [1]."""
    if scheme not in GEMM_SCHEMES:
        raise ValueError(f"no Triton dequant GEMM for scheme {scheme!r}; known: {', '.join(GEMM_SCHEMES)}")
    assert (group_size is not None) == (SCHEMES[scheme].grouped), (scheme, group_size)
    assert not has_act_scale or SCHEMES[scheme].activations == FP8_STATIC, scheme
    # schemes with optional minimums (affine) alone carry HAS_ZEROS, so the others' sources stay as they were
    affine = {"HAS_ZEROS": has_zeros} if SCHEMES[scheme].zero_point == FLOAT_OFFSET else {}
    constants = dict(SCHEME=scheme, WEIGHT_LAYOUT=WEIGHT_LAYOUTS[scheme], X_DTYPE=x_dtype, OUT_DTYPE=out_dtype,
                     BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                     GROUP_SIZE=group_size or 0, PER_CHANNEL_SCALE=per_channel_scale,
                     HAS_ACT_SCALE=has_act_scale, HAS_BIAS=has_bias, **affine, DOT_PRECISION=config.dot_precision,
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
        scheme, config, group_size=group_size if SCHEMES[scheme].grouped else None,
        x_dtype=ACTIVATION_DTYPES[x.dtype], out_dtype=ACTIVATION_DTYPES[x.dtype],
        per_channel_scale=scales.numel() > 1 or SCHEMES[scheme].grouped, has_act_scale=act_scale is not None,
        has_bias=bias is not None, has_zeros=zeros is not None))
    grid = (_cdiv(m, config.block_m), _cdiv(n, config.block_n))
    zeros_arg = zeros if zeros is not None else scales    # unused operands still need a pointer
    stride_sg = scales.stride(1) if scales.dim() == 2 else 0
    kernel[grid](x2, qweight, scales, zeros_arg, act_scale if act_scale is not None else scales,
                 bias if bias is not None else scales, y, m, n, k,
                 x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), stride_sg,
                 y.stride(0), y.stride(1), num_warps=config.num_warps, num_stages=config.num_stages)
    return y.reshape(*x.shape[:-1], n)


# -- w8a8: int8 activations quantised at run time x int8 weights ---------------------------------
@functools.cache
def render_quantize_int8(target: str, dtype: str, in_features: int, static_scale: bool = False) -> RenderedKernel:
    """The quantiser of `dtype` rows of `in_features` to int8 codes and a scale per row: max|row| / 127
    per token, or with `static_scale` one given scale for every row."""
    config = row_config(target)
    if dtype not in ACTIVATION_DTYPES.values():
        raise ValueError(f"activations must be one of {', '.join(ACTIVATION_DTYPES.values())}, got {dtype}")
    if not 0 < in_features <= config.max_row:
        raise ValueError(f"int8 quantisation of {in_features} features: the {target} row kernels hold "
                         f"1..{config.max_row}")
    block = block_size(in_features)
    constants = dict(X_DTYPE=dtype, K=in_features, BLOCK=block, STATIC_SCALE=static_scale,
                     NUM_WARPS=config.num_warps(block))
    return render_kernel("quantize_int8.py.j2", "quantize_int8_static" if static_scale else "quantize_int8_per_token",
                         constants)


@functools.cache
def render_int8_gemm(config: TileConfig, *, out_dtype: str = "float32", has_bias: bool = False) -> RenderedKernel:
    """The int8 x int8 -> int32 GEMM with the per-token x per-channel scale epilogue."""
    if config.block_k < 32:
        raise ValueError(f"the int8 GEMM needs K tiles of at least 32 (int8 tl.dot), got block_k={config.block_k}")
    constants = dict(OUT_DTYPE=out_dtype, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                     HAS_BIAS=has_bias, NUM_WARPS=config.num_warps, NUM_STAGES=config.num_stages)
    return render_kernel("int8_gemm.py.j2", "int8_gemm", constants)


def render_w8a8_gemm(target: str, dtype: str, in_features: int, *, has_bias: bool = False,
                     has_act_scale: bool = False, config: TileConfig | None = None
                     ) -> tuple[RenderedKernel, RenderedKernel]:
    """The kernels w8a8_gemm launches, in order: the activation quantiser, then the int8 GEMM."""
    return (render_quantize_int8(target, dtype, in_features, has_act_scale),
            render_int8_gemm(config or tile_config(target), out_dtype=dtype, has_bias=has_bias))


def w8a8_gemm(x: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None = None,
              act_scale: torch.Tensor | None = None, *, target: str = "h100",
              config: TileConfig | None = None) -> torch.Tensor:
    """qlinear of the w8a8 scheme (docs/quantization.md): x [..., K] quantised to int8 per token at run
    time (or, given the fp32 [1] `act_scale`, with that static scale; the w8a8 scheme stores none),
    times qweight int8 [N, K] with int32 accumulation, scaled by each row's and each channel's fp32
    scale (w_scales [N]), plus bias -> [..., N] in x's dtype. `config` overrides the target's tiles."""
    n, k = _check_w8a8(x, qweight, w_scales, bias)
    _check_act_scale(act_scale)
    config = config or tile_config(target)
    quantizer, gemm = render_w8a8_gemm(target, ACTIVATION_DTYPES[x.dtype], k, has_bias=bias is not None,
                                       has_act_scale=act_scale is not None, config=config)
    codes, x_scales = _quantize_rows(quantizer, x, act_scale)
    m = codes.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        w_scales = w_scales.contiguous()
        grid = (_cdiv(m, config.block_m), _cdiv(n, config.block_n))
        load_kernel(gemm)[grid](
            codes, qweight, x_scales, w_scales, bias if bias is not None else w_scales, y, m, n, k,
            codes.stride(0), codes.stride(1), qweight.stride(0), qweight.stride(1), y.stride(0), y.stride(1),
            num_warps=config.num_warps, num_stages=config.num_stages)
    return y.reshape(*x.shape[:-1], n)


def _quantize_rows(kernel: RenderedKernel, x: torch.Tensor, act_scale) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()    # the kernel steps rows by stride(0)
    codes = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        load_kernel(kernel)[(x2.shape[0],)](
            x2, codes, scales, act_scale if act_scale is not None else scales, x2.stride(0), codes.stride(0),
            num_warps=dict(kernel.constants)["NUM_WARPS"])
    return codes, scales


def _check_w8a8(x, qweight, w_scales, bias) -> tuple[int, int]:
    """(N, K) after checking the operands against the w8a8 storage format."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activations must be one of {list(ACTIVATION_DTYPES)}, got {x.dtype}")
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"w8a8 qweight must be 2-D torch.int8, got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the w8a8 qweight {tuple(qweight.shape)} stands for {k}")
    if w_scales.dtype != torch.float32 or w_scales.shape != (n,):
        raise ValueError(f"w8a8 w_scales must be float32 of shape ({n},), got {w_scales.dtype} "
                         f"{tuple(w_scales.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    return n, k


def _check_act_scale(act_scale) -> None:
    if act_scale is not None and (act_scale.dtype != torch.float32 or act_scale.numel() != 1):
        raise ValueError(f"act_scale must be a one-element float32 tensor, got {act_scale.dtype} "
                         f"{tuple(act_scale.shape)}")


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
    # GGUF's own fp16 scales and minimums stay fp16 (affine schemes); every other one is fp32
    floats = SCHEMES[scheme].scale_dtypes
    for name, t in (("scales", scales), ("zeros", zeros), ("act_scale", act_scale)):
        if t is not None and t.dtype not in floats:
            allowed = " or ".join(str(dtype).removeprefix("torch.") for dtype in floats)
            raise ValueError(f"{scheme} {name} must be {allowed}, got {t.dtype}")
    n, k = qweight.shape[0], qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the {scheme} qweight {tuple(qweight.shape)} "
                         f"stands for {k}")
    if SCHEMES[scheme].grouped:
        _check_groups(scheme, scales, zeros, n, k, group_size)
    elif scales.shape not in ((n,), (1,)):
        raise ValueError(f"{scheme} scales must have shape ({n},) or (1,), got {tuple(scales.shape)}")
    if act_scale is not None and (SCHEMES[scheme].activations != FP8_STATIC or act_scale.numel() != 1):
        raise ValueError(f"act_scale is a one-element fp32 tensor of the fp8 scheme, got {scheme} "
                         f"{tuple(act_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    return n, k


def _check_groups(scheme, scales, zeros, n, k, group_size) -> None:
    """int4 needs scales and zero points, affine schemes scales and optional minimums, each [N, K/g]."""
    if not group_size or k % group_size:
        raise ValueError(f"{scheme} group_size {group_size} must divide in_features {k}")
    shape = (n, k // group_size)
    zeros_fit = zeros.shape == shape if zeros is not None else not SCHEMES[scheme].zeros_required
    if scales.shape != shape or not zeros_fit:
        raise ValueError(f"{scheme} scales and zeros must have shape {shape}, got {tuple(scales.shape)} "
                         f"and {None if zeros is None else tuple(zeros.shape)}")


__all__ = ["GEMM_SCHEMES", "render_dequant_gemm", "dequant_gemm", "render_quantize_int8",
           "render_int8_gemm", "render_w8a8_gemm", "w8a8_gemm"]
