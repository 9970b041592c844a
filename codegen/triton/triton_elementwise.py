"""Launchers of the row-wise Triton kernels: RMSNorm (with the residual add fused), SwiGLU and
rotary embedding (codegen/triton/templates/rms_norm, swiglu, rotary .py.j2). Each `render_*` names the
exact source a launch runs for its target, dtype and shape constants, so a plan can record it
(template, name, constants, sha256); the launch functions render through those same functions.

Semantics and rounding are compiler/ops.py's: rms_norm_ref, silu then mul, rope_ref."""

from __future__ import annotations

import functools

import torch

from llmc.codegen.triton.triton_configs import block_size, row_config
from llmc.codegen.triton.triton_render import RenderedKernel, load_kernel, render_kernel
from llmc.compiler.ops import DTYPE_NAMES, TORCH_DTYPES

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


# -- rendering -----------------------------------------------------------------------------------
@functools.cache
def render_rms_norm(target: str, dtype: str, hidden: int, has_residual: bool,
                    weight_dtype: str | None = None) -> RenderedKernel:
    """RMSNorm over rows of `hidden` `dtype` features (`has_residual`: adds the residual first and
    stores the sum too); the output dtype is `dtype` promoted with `weight_dtype` (default `dtype`),
    as rms_norm_ref's `weight * h` gives."""
    config = row_config(target)
    _check_dtype(dtype, "x")
    out_dtype = _promoted(dtype, _check_dtype(weight_dtype or dtype, "weight"))
    if not 0 < hidden <= config.max_row:
        raise ValueError(f"rms_norm over {hidden} features: the {target} row kernels hold 1..{config.max_row}")
    block = block_size(hidden)
    constants = dict(X_DTYPE=dtype, OUT_DTYPE=out_dtype, HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual,
                     NUM_WARPS=config.num_warps(block))
    return render_kernel("rms_norm.py.j2", "rms_norm_residual" if has_residual else "rms_norm", constants)


@functools.cache
def render_swiglu(target: str, dtype: str, intermediate: int) -> RenderedKernel:
    """silu(gate) * up over rows of `intermediate` `dtype` features."""
    config = row_config(target)
    block = min(config.swiglu_block, block_size(intermediate))
    constants = dict(X_DTYPE=_check_dtype(dtype, "gate and up"), BLOCK=block, NUM_WARPS=config.num_warps(block))
    return render_kernel("swiglu.py.j2", "swiglu", constants)


@functools.cache
def render_rotary(target: str, dtype: str, head_dim: int, rotate_k: bool = False) -> RenderedKernel:
    """Rotary embedding of `dtype` heads of `head_dim` (even); `rotate_k`: q and k in one launch."""
    config = row_config(target)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    block_half = block_size(head_dim // 2)
    constants = dict(X_DTYPE=_check_dtype(dtype, "x"), HEAD_DIM=head_dim, BLOCK_HALF=block_half,
                     HEADS=config.rotary_heads, ROTATE_K=rotate_k,
                     NUM_WARPS=config.num_warps(2 * config.rotary_heads * block_half))
    return render_kernel("rotary.py.j2", "rotary_qk" if rotate_k else "rotary", constants)


# -- launching -----------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             *, target: str = "h100"):
    """x [..., H] -> rms_norm_ref(x, weight, eps) [..., H]; with `residual` (shaped and typed as x)
    -> (out, summed): summed = x + residual in x's dtype, out its RMSNorm."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm residual must match x {x.dtype} {tuple(x.shape)}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    kernel = render_rms_norm(target, _dtype_name(x, "x"), hidden, residual is not None, _dtype_name(weight, "weight"))
    constants = dict(kernel.constants)
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else x2        # unused operands still need a pointer
    out = torch.empty(x2.shape, dtype=TORCH_DTYPES[constants["OUT_DTYPE"]], device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        load_kernel(kernel)[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, summed, x2.stride(0), res2.stride(0), out.stride(0),
            summed.stride(0), float(eps), num_warps=constants["NUM_WARPS"])
    out = out.reshape(x.shape)
    return out if residual is None else (out, summed.reshape(x.shape))


def swiglu(gate_up: torch.Tensor, up: torch.Tensor | None = None, *, target: str = "h100") -> torch.Tensor:
    """silu(gate) * up [..., I]: from the packed gate_up [..., 2I] (gate first), or with `up`
    [..., I] given, from gate = `gate_up` [..., I] and `up`."""
    if up is None:
        if gate_up.shape[-1] % 2:
            raise ValueError(f"packed gate_up needs an even last dim, got {tuple(gate_up.shape)}")
        half = gate_up.shape[-1] // 2
        gate_up, up = gate_up[..., :half], gate_up[..., half:]
    gate = gate_up
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)} "
                         f"must match")
    inter = gate.shape[-1]
    kernel = render_swiglu(target, _dtype_name(gate, "gate and up"), inter)
    constants = dict(kernel.constants)
    gate2, up2 = _rows(gate), _rows(up)
    out = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        grid = (gate2.shape[0], -(-inter // constants["BLOCK"]))
        load_kernel(kernel)[grid](gate2, up2, out, inter, gate2.stride(0), up2.stride(0), out.stride(0),
                                  num_warps=constants["NUM_WARPS"])
    return out.reshape(gate.shape)


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, head_dim: int,
           scaling: float = 1.0, target: str = "h100") -> torch.Tensor:
    """rope_ref: x [..., T, H * head_dim] rotated by the angles positions [T] x inv_freq [head_dim / 2]
    (cos and sin times `scaling`), rotate-half convention."""
    return _launch_rotary(x, None, positions, inv_freq, head_dim, scaling, target)[0]


def rotary_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
              head_dim: int, scaling: float = 1.0, target: str = "h100") -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(q), rotary(k)) in one launch; q [..., T, Hq * head_dim], k [..., T, Hk * head_dim]."""
    return _launch_rotary(q, k, positions, inv_freq, head_dim, scaling, target)


def _launch_rotary(x, k, positions, inv_freq, head_dim, scaling, target):
    kernel = render_rotary(target, _dtype_name(x, "x"), head_dim, rotate_k=k is not None)
    constants = dict(kernel.constants)
    x2 = _rows(x)
    pos = positions.reshape(-1)
    if pos.numel() != x2.shape[0] or inv_freq.numel() != head_dim // 2:
        raise ValueError(f"rotary of {x2.shape[0]} tokens with head_dim {head_dim} needs {x2.shape[0]} positions "
                         f"and {head_dim // 2} inverse frequencies, got {pos.numel()} and {inv_freq.numel()}")
    k2 = x2 if k is None else _rows(k)                  # unused operands still need a pointer
    if k is not None and (k.dtype != x.dtype or k2.shape[0] != x2.shape[0]):
        raise ValueError(f"rotary_qk: k {k.dtype} {tuple(k.shape)} must have q's dtype {x.dtype} and tokens")
    heads, k_heads = _heads(x2, head_dim, "x"), (0 if k is None else _heads(k2, head_dim, "k"))
    # grid (tokens, head blocks): x's blocks, then k's
    blocks = -(-heads // constants["HEADS"]) + -(-k_heads // constants["HEADS"])
    x_out = torch.empty_like(x2)
    k_out = x_out if k is None else torch.empty_like(k2)
    if x2.shape[0] and blocks:
        load_kernel(kernel)[(x2.shape[0], blocks)](
            x2, k2, pos.contiguous(), inv_freq.contiguous(), x_out, k_out, heads, k_heads,
            x2.stride(0), k2.stride(0), x_out.stride(0), k_out.stride(0), float(scaling),
            num_warps=constants["NUM_WARPS"])
    return x_out.reshape(x.shape), (None if k is None else k_out.reshape(k.shape))


# -- helpers -------------------------------------------------------------------------------------
def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., F] as [rows, F] with unit feature stride (the kernels step rows by stride(0))."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _heads(t2: torch.Tensor, head_dim: int, what: str) -> int:
    if t2.shape[1] % head_dim:
        raise ValueError(f"rotary {what} has {t2.shape[1]} features, not a multiple of head_dim {head_dim}")
    return t2.shape[1] // head_dim


def _dtype_name(t: torch.Tensor, what: str) -> str:
    return _check_dtype(DTYPE_NAMES.get(t.dtype, str(t.dtype)), what)


def _check_dtype(name: str, what: str) -> str:
    if name not in FLOAT_DTYPES:
        raise ValueError(f"{what} must be one of {', '.join(FLOAT_DTYPES)}, got {name}")
    return name


def _promoted(a: str, b: str) -> str:
    return DTYPE_NAMES[torch.promote_types(TORCH_DTYPES[a], TORCH_DTYPES[b])]


__all__ = ["render_rms_norm", "render_swiglu", "render_rotary", "rms_norm", "swiglu", "rotary", "rotary_qk"]
