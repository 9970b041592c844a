"""Which Triton kernels a plan step launches: for each IR op, the exact rendered sources the runtime's
launchers (codegen/triton/triton_kernels.py, runtime/triton_attention_backend.py) render for the step's
dtypes, shapes and target, so the plan can record them and the artifact can store them. Ops absent
from KERNEL_OPS run as torch calls on the GPU (cuBLAS GEMMs, gathers, views) and launch none."""

from __future__ import annotations

from typing import Callable

from llmc.codegen.triton.triton_attention import (
    render_decode,
    render_decode_reduce,
    render_kv_cache_write,
    render_prefill,
)
from llmc.codegen.triton.triton_configs import attention_config, tile_config
from llmc.codegen.triton.triton_elementwise import render_rms_norm, render_rotary, render_swiglu
from llmc.codegen.triton.triton_gemm import render_dequant_gemm, render_w8a8_gemm
from llmc.codegen.triton.triton_moe import render_moe
from llmc.codegen.triton.triton_render import RenderedKernel
from llmc.compiler.ir import TensorType
from llmc.compiler.ops import qlinear_inputs
from llmc.compiler.schemes import INT8_PER_TOKEN, SCHEMES
from llmc.errors import TargetError

# The runtime's default KV block (runtime/engine.py EngineConfig.block_size): attention kernels are
# rendered for it, and an engine run with another block size renders (and checks) its own.
KV_BLOCK_SIZE = 16


def rms_norm_kernels(attrs, ins: list[TensorType], outs, target, configs, kv_cache_dtype) -> list[RenderedKernel]:
    x, weight = ins[0], ins[-1]
    return [render_rms_norm(target, x.dtype, x.shape[-1], len(ins) == 3, weight.dtype)]


def swiglu_kernels(attrs, ins, outs: list[TensorType], target, configs, kv_cache_dtype) -> list[RenderedKernel]:
    return [render_swiglu(target, outs[0].dtype, outs[0].shape[-1])]


def rope_kernels(attrs, ins: list[TensorType], outs, target, configs, kv_cache_dtype) -> list[RenderedKernel]:
    return [render_rotary(target, ins[0].dtype, attrs["head_dim"], rotate_k=False)]


def moe_kernels(attrs, ins: list[TensorType], outs, target, configs, kv_cache_dtype) -> list[RenderedKernel]:
    x, down = ins[0], ins[3]
    return list(render_moe(target, x.dtype, x.shape[-1], down.shape[-1]))


def qmoe_kernels(attrs, ins: list[TensorType], outs, target, configs, kv_cache_dtype) -> list[RenderedKernel]:
    scheme = attrs["scheme"]
    return list(render_moe(target, ins[0].dtype, ins[0].shape[-1], attrs["intermediate"], scheme,
                           attrs.get("group_size", -1) if SCHEMES[scheme].grouped else 0))


def qlinear_kernels(attrs, ins: list[TensorType], outs, target, configs, kv_cache_dtype) -> list[RenderedKernel]:
    """As triton_kernels.qlinear launches them: w8a8 through w8a8_gemm (per-token quantiser, then
    the int8 GEMM), the other schemes through dequant_gemm."""
    x, _, scales, zeros, act_scale, bias = qlinear_inputs(list(ins), attrs)
    scheme, config = attrs["scheme"], configs.get("gemm") or tile_config(target)
    if SCHEMES[scheme].activations == INT8_PER_TOKEN:
        return list(render_w8a8_gemm(target, x.dtype, attrs["in_features"], has_bias=bias is not None, config=config))
    group_size = attrs["group_size"] if SCHEMES[scheme].grouped else None
    return [render_dequant_gemm(scheme, config, group_size=group_size, x_dtype=x.dtype, out_dtype=x.dtype,
                                per_channel_scale=scales.numel() > 1 or SCHEMES[scheme].grouped,
                                has_act_scale=act_scale is not None, has_bias=bias is not None,
                                has_zeros=zeros is not None)]


def attention_kernels(attrs, ins: list[TensorType], outs, target, configs, kv_cache_dtype) -> list[RenderedKernel]:
    """Every kernel an attention layer may launch (TritonPagedAttention): the cache write, the
    varlen prefill, the decode kernel without and with split-K, and the split-K reduce for each
    split count decode_num_splits can choose (its tile covers the next power of two of splits)."""
    q, k = ins[0], ins[1]
    if attrs.get("softcap") is not None:
        raise ValueError("the Triton attention kernels have no soft-capping of scores (softcap)")
    cache = kv_cache_dtype or k.dtype
    config = configs.get("attention") or attention_config(target)
    rope = attrs.get("rope") is not None
    layout = dict(num_heads=attrs["num_heads"], num_kv_heads=attrs["num_kv_heads"], block_size=KV_BLOCK_SIZE,
                  window=attrs.get("window") is not None, rope=rope, config=config)
    head_dim = attrs["head_dim"]
    kernels = [render_kv_cache_write(target, k.dtype, cache, head_dim, num_kv_heads=attrs["num_kv_heads"],
                                     block_size=KV_BLOCK_SIZE, rope=rope),
               render_prefill(target, q.dtype, cache, head_dim, causal=attrs.get("causal", True), **layout)]
    kernels += [render_decode(target, q.dtype, cache, head_dim, split_k=split_k, **layout) for split_k in (False, True)]
    reduce_tiles = sorted({1 << (s - 1).bit_length() for s in range(2, config.max_splits + 1)})
    kernels += [render_decode_reduce(target, q.dtype, head_dim, num_splits=s) for s in reduce_tiles]
    return kernels


KERNEL_OPS: dict[str, Callable[..., list[RenderedKernel]]] = {
    "rms_norm": rms_norm_kernels, "add_rms_norm": rms_norm_kernels, "swiglu": swiglu_kernels,
    "rope": rope_kernels, "qlinear": qlinear_kernels, "attention": attention_kernels,
    "flash_attention": attention_kernels, "moe": moe_kernels, "qmoe": qmoe_kernels,
}


def kernels_for_step(op: str, attrs: dict, in_types: list[TensorType], out_types: list[TensorType], target: str,
                     *, configs: dict | None = None, kv_cache_dtype: str | None = None) -> list[RenderedKernel]:
    """The rendered kernels a step of `op` launches on `target` (a GPU target or family name); []
    for ops that run on torch. `configs` overrides the target's launch configs by family ("gemm":
    a TileConfig, "attention": an AttentionConfig); kv_cache_dtype is the KV cache's (default k's)."""
    select = KERNEL_OPS.get(op)
    if select is None:
        return []
    try:
        return select(attrs, in_types, out_types, target, configs or {}, kv_cache_dtype)
    except (ValueError, KeyError) as e:
        raise TargetError(f"no Triton kernel for this {op} on target {target!r}: {e}; compile for "
                          f"--target cpu or disable the pass that made it") from e


# The launch grid each template's launcher uses, over the step's run-time sizes (tokens = rows of
# the batch, seqs = sequences, N = output features), in the launchers' own terms.
GRIDS = {
    "dequant_gemm.py.j2": "(cdiv(tokens, BLOCK_M), cdiv(N, BLOCK_N))",
    "int8_gemm.py.j2": "(cdiv(tokens, BLOCK_M), cdiv(N, BLOCK_N))",
    "quantize_int8.py.j2": "(tokens,)",
    "rms_norm.py.j2": "(tokens,)",
    "swiglu.py.j2": "(tokens, cdiv(intermediate, BLOCK))",
    "moe_up.py.j2": "(tokens * top_k, cdiv(intermediate, BLOCK_N))",
    "moe_down.py.j2": "(tokens * top_k, cdiv(hidden, BLOCK_N))",
    "rotary.py.j2": "(tokens, cdiv(heads, HEADS))",
    "kv_cache_write.py.j2": "(tokens,)",
    "flash_attention_prefill.py.j2": "(cdiv(max_query_len, BLOCK_M), prefill seqs, num_heads)",
    "paged_decode.py.j2": "(decode seqs, num_kv_heads, num_splits)",
    "paged_decode_reduce.py.j2": "(decode seqs, num_heads)",
}


def kernel_record(kernel: RenderedKernel) -> dict:
    """What a plan step stores about one kernel: enough to render it again and check the text, and
    the grid its launcher uses."""
    return {"template": kernel.template, "name": kernel.name, "constants": dict(kernel.constants),
            "sha256": kernel.sha256, "grid": GRIDS[kernel.template]}


__all__ = ["KV_BLOCK_SIZE", "KERNEL_OPS", "GRIDS", "kernels_for_step", "kernel_record"]
