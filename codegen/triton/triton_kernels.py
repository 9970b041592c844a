"""Triton kernels: each "triton.<op>" plan step run on a GPU (or Triton's interpreter) with the
interface of codegen/torch_cpu/cpu_kernels.py (inputs, the step's attrs, the per-forward context it names).
Norms, SwiGLU, rotary and quantised GEMMs launch Triton kernels; attention goes to the attention
backend (runtime/triton_attention_backend.py), which launches the paged attention kernels; ops
that are torch calls whatever the device (linear, embedding, cast, split, aten, ...) run
cpu_kernels' torch code."""

from __future__ import annotations

from typing import Callable

import torch

from llmc.codegen.torch_cpu import cpu_kernels
from llmc.codegen.triton.triton_elementwise import rms_norm as launch_rms_norm
from llmc.codegen.triton.triton_elementwise import rotary
from llmc.codegen.triton.triton_elementwise import swiglu as launch_swiglu
from llmc.codegen.triton.triton_gemm import dequant_gemm, w8a8_gemm
from llmc.codegen.triton.triton_moe import moe as launch_moe
from llmc.codegen.triton.triton_moe import qmoe as launch_qmoe
from llmc.compiler.ops import OPS, qlinear_inputs, qmoe_inputs, split_kv_scales
from llmc.compiler.quant import group_params, is_packed
from llmc.compiler.schemes import INT8_PER_TOKEN, SCHEMES
from llmc.errors import ArtifactError, RuntimeLlmcError

TRITON_KERNELS: dict[str, Callable[..., list[torch.Tensor]]] = {}

# Ops whose cpu_kernels implementation is plain torch on any device (qlinear's is not: it packs
# weights for torch's CPU-only GEMMs); the collectives and send/recv are torch.distributed calls,
# which go over NCCL between GPUs.
TORCH_OPS = ("embedding", "qembedding", "linear", "silu", "mul", "add", "select_rows", "cast", "split", "aten",
             "all_reduce", "all_gather", "send", "recv")


def kernel(op: str, context: tuple[str, ...] = ()):
    """Register `fn` as kernel triton.<op>, as cpu_kernels.kernel does for cpu.<op> (no Triton
    kernel needs a load-time `prepare`: the GEMMs read the stored weights as they are)."""
    def register(fn):
        fn.context = context
        TRITON_KERNELS[f"triton.{op}"] = fn
        return fn
    return register


for _op in TORCH_OPS:
    TRITON_KERNELS[f"triton.{_op}"] = cpu_kernels.CPU_KERNELS[f"cpu.{_op}"]


@kernel("rms_norm", context=("target",))
def rms_norm(x, weight, *, eps, target, **attrs):
    return [launch_rms_norm(x, weight, eps, target=target)]


@kernel("add_rms_norm", context=("target",))
def add_rms_norm(x, residual, weight, *, eps, target, **attrs):
    """[rms_norm(x + residual), x + residual] in one launch."""
    return list(launch_rms_norm(x, weight, eps, residual, target=target))


@kernel("swiglu", context=("target",))
def swiglu(*inputs, target, **attrs):
    return [launch_swiglu(*inputs, target=target)]


@kernel("rope", context=("target",))
def rope(x, positions, inv_freq, *, head_dim, scaling=1.0, target, **attrs):
    return [rotary(x, positions, inv_freq, head_dim=head_dim, scaling=scaling, target=target)]


@kernel("moe", context=("target",))
def moe(x, router, gate_up, down, *, top_k, target, **attrs):
    return [launch_moe(x, router, gate_up, down, top_k=top_k, target=target)]


@kernel("qmoe", context=("target",))
def qmoe(*inputs, top_k, scheme, intermediate, target, group_size=-1, **attrs):
    x, router, gate_up, down = qmoe_inputs(list(inputs), scheme)
    return [launch_qmoe(x, router, gate_up, down, top_k=top_k, scheme=scheme, intermediate=intermediate,
                        group_size=group_size, target=target)]


@kernel("qlinear", context=("target", "launch_configs"))
def qlinear(*inputs, scheme, target, launch_configs=None, group_size=None, **attrs):
    """int8/int4/fp8 weights dequantised inside the GEMM; w8a8 quantises activations per token and
    multiplies int8 codes. Tiles: the plan's "gemm" launch config (the target's without one)."""
    x, qweight, scales, zeros, act_scale, bias = qlinear_inputs(list(inputs), attrs)
    config = (launch_configs or {}).get("gemm")
    if SCHEMES[scheme].activations == INT8_PER_TOKEN:
        return [w8a8_gemm(x, qweight, scales, bias=bias, act_scale=act_scale, target=target, config=config)]
    if is_packed(scales):   # a GGUF K-quant's packed group params: values for the GEMM (a few KB a weight)
        scales, zeros = group_params(scales, attrs["in_features"]), group_params(zeros, attrs["in_features"])
    return [dequant_gemm(x, qweight, scales, zeros, scheme=scheme,
                         group_size=group_size if SCHEMES[scheme].grouped else None,
                         act_scale=act_scale, bias=bias, target=target, config=config)]


@kernel("attention", context=("backend",))
def attention(q, k, v, kv_scales=None, *, backend, layer, num_heads, num_kv_heads, head_dim, scale, causal=True,
              window=None, **attrs):
    """q: [tokens, num_heads*head_dim], k/v: [tokens, num_kv_heads*head_dim]: the backend writes
    k/v to its cache and attends over each sequence's context. A quantised cache's scales input
    holds the params the backends were built with (the executor loads them once), so it is not
    read per launch."""
    _check_backend(backend, layer)
    return [backend.forward(layer, q, k, v, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            scale=scale, causal=causal, window=window)]


@kernel("flash_attention", context=("backend",))
def flash_attention(*inputs, backend, layer, num_heads, num_kv_heads, head_dim,
                    scale, causal=True, window=None, rope=None, **attrs):
    """attention with the rotary embedding fused (when `rope` is set, q and k arrive unrotated):
    the cache write rotates k, the attention kernels rotate q as they load it."""
    _check_backend(backend, layer)
    (q, k, v, *rest), _ = split_kv_scales(inputs, attrs)
    positions, inv_freq = rest if rope is not None else (None, None)
    rotary = {} if rope is None else dict(positions=positions, inv_freq=inv_freq, rope_scaling=float(rope["scaling"]))
    return [backend.forward(layer, q, k, v, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            scale=scale, causal=causal, window=window, **rotary)]


def _check_backend(backend, layer: int) -> None:
    if not getattr(backend, "runs_triton", False):
        raise RuntimeLlmcError(f"attention layer {layer} of a Triton plan was given a {type(backend).__name__} "
                               f"backend; give it TritonPagedAttention or TritonNoCacheAttention "
                               f"(runtime/triton_attention_backend.py), or none")


def resolve_kernel(name: str) -> Callable[..., list[torch.Tensor]]:
    """The kernel a "triton.*" plan step names; an IR op with neither a Triton nor a torch kernel
    runs its reference, which defines its meaning (and is torch on any device)."""
    fn = TRITON_KERNELS.get(name)
    if fn is not None:
        return fn
    ns, _, op = name.partition(".")
    if ns == "triton" and op in OPS and f"cpu.{op}" not in cpu_kernels.CPU_KERNELS:
        return cpu_kernels.resolve_kernel(f"cpu.{op}")
    raise ArtifactError(f"plan names kernel {name!r}, which this llmc does not have (Triton kernels: "
                        f"{sorted(TRITON_KERNELS)}); recompile the model with this llmc")


__all__ = ["TRITON_KERNELS", "TORCH_OPS", "kernel", "resolve_kernel"]
