"""The Triton kernels of the `moe` op (templates moe_up.py.j2, moe_down.py.j2). Routing (router
GEMM, softmax, top-k, renormalisation) is torch, as compiler/ops.py's moe_routing; then one program
per (token, chosen expert) pair and output block runs that expert's SwiGLU rows, reading only the
chosen experts' weights, and the pairs' weighted outputs are summed per token in fp32."""

from __future__ import annotations

import functools

import torch

from llmc.codegen.triton_configs import block_size
from llmc.codegen.triton_render import RenderedKernel, load_kernel, render_kernel
from llmc.compiler.ops import DTYPE_NAMES, moe_routing

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
BLOCK_N, BLOCK_K = 32, 64


@functools.cache
def render_moe(target: str, dtype: str, hidden: int, intermediate: int) -> tuple[RenderedKernel, RenderedKernel]:
    """(the gate/up kernel, the down kernel) for `dtype` activations and expert weights."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"moe activations must be one of {', '.join(FLOAT_DTYPES)}, got {dtype}")
    up = dict(X_DTYPE=dtype, BLOCK_N=min(BLOCK_N, block_size(intermediate)), BLOCK_K=min(BLOCK_K, block_size(hidden)))
    down = dict(X_DTYPE=dtype, BLOCK_N=min(BLOCK_N, block_size(hidden)), BLOCK_K=min(BLOCK_K, block_size(intermediate)))
    return render_kernel("moe_up.py.j2", "moe_up", up), render_kernel("moe_down.py.j2", "moe_down", down)


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, top_k: int,
        target: str = "h100") -> torch.Tensor:
    """moe_ref: x [T, H], router [E, H], gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    weights, experts = moe_routing(x, router, top_k)
    tokens, hidden = x.shape
    inter = down.shape[-1]
    up_kernel, down_kernel = render_moe(target, DTYPE_NAMES[x.dtype], hidden, inter)
    if not tokens:
        return torch.empty_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    pairs = tokens * top_k
    rows = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
    ids = experts.reshape(-1).contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    up_n = dict(up_kernel.constants)["BLOCK_N"]
    load_kernel(up_kernel)[(pairs, -(-inter // up_n))](x, rows, ids, gate_up, h, hidden, inter, x.stride(0),
                                                      gate_up.stride(0), gate_up.stride(1), h.stride(0))
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    down_n = dict(down_kernel.constants)["BLOCK_N"]
    load_kernel(down_kernel)[(pairs, -(-hidden // down_n))](h, ids, weights.reshape(-1).contiguous(), down, y,
                                                            hidden, inter, h.stride(0), down.stride(0),
                                                            down.stride(1), y.stride(0))
    return y.reshape(tokens, top_k, hidden).sum(1).to(x.dtype)
