"""The Triton kernels of the `moe` and `qmoe` ops (templates moe_up.py.j2, moe_down.py.j2). Routing
(router GEMM, softmax, top-k, renormalisation) is torch, as compiler/ops.py's moe_routing; then one
program per (token, chosen expert) pair and output block runs that expert's SwiGLU rows, reading only
the chosen experts' weights (a qmoe's int8/int4 codes dequantised as they are loaded), and the pairs'
weighted outputs are summed per token in fp32."""

from __future__ import annotations

import functools

import torch

from llmc.codegen.triton.triton_configs import block_size
from llmc.codegen.triton.triton_render import RenderedKernel, load_kernel, render_kernel
from llmc.compiler.ops import DTYPE_NAMES, ExpertWeights, moe_routing
from llmc.compiler.schemes import SCHEMES

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
BLOCK_N, BLOCK_K = 32, 64


@functools.cache
def render_moe(target: str, dtype: str, hidden: int, intermediate: int, quant: str | None = None,
               group: int = 0) -> tuple[RenderedKernel, RenderedKernel]:
    """(the gate/up kernel, the down kernel) for `dtype` activations over `dtype` expert weights, or over
    experts stored as `quant` ("int8", or "int4" in groups of `group`: a qmoe's)."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"moe activations must be one of {', '.join(FLOAT_DTYPES)}, got {dtype}")
    stored = {} if quant is None else {"QUANT": quant, "GROUP": group}
    up = dict(X_DTYPE=dtype, BLOCK_N=min(BLOCK_N, block_size(intermediate)), BLOCK_K=min(BLOCK_K, block_size(hidden)),
              **stored)
    down = dict(X_DTYPE=dtype, BLOCK_N=min(BLOCK_N, block_size(hidden)), BLOCK_K=min(BLOCK_K, block_size(intermediate)),
                **stored)
    return render_kernel("moe_up.py.j2", "moe_up", up), render_kernel("moe_down.py.j2", "moe_down", down)


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, top_k: int,
        target: str = "h100") -> torch.Tensor:
    """moe_ref: x [T, H], router [E, H], gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    kernels = render_moe(target, DTYPE_NAMES[x.dtype], x.shape[1], down.shape[-1])
    return _launch(x, router, top_k, kernels, ExpertWeights(gate_up, None, None), ExpertWeights(down, None, None))


def qmoe(x: torch.Tensor, router: torch.Tensor, gate_up: ExpertWeights, down: ExpertWeights, *, top_k: int,
         scheme: str, intermediate: int, group_size: int = -1, target: str = "h100") -> torch.Tensor:
    """qmoe_ref: the experts read as stored (compiler/ops.py's qmoe layouts), dequantised in the kernels."""
    kernels = render_moe(target, DTYPE_NAMES[x.dtype], x.shape[1], intermediate, scheme,
                         group_size if SCHEMES[scheme].grouped else 0)
    return _launch(x, router, top_k, kernels, gate_up, down)


def _launch(x, router, top_k, kernels, gate_up: ExpertWeights, down: ExpertWeights) -> torch.Tensor:
    weights, experts = moe_routing(x, router, top_k)
    (tokens, hidden), (up_kernel, down_kernel) = x.shape, kernels
    inter = gate_up.qweight.shape[1] // 2
    if not tokens:
        return torch.empty_like(x)
    x = x.contiguous()
    gate_up, down = (ExpertWeights(*(None if t is None else t.contiguous() for t in w)) for w in (gate_up, down))
    pairs = tokens * top_k
    rows = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
    ids = experts.reshape(-1).contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    up_n = dict(up_kernel.constants)["BLOCK_N"]
    load_kernel(up_kernel)[(pairs, -(-inter // up_n))](x, rows, ids, *_stored(gate_up), h, hidden, inter, x.stride(0),
                                                      *_strides(gate_up), h.stride(0))
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    down_n = dict(down_kernel.constants)["BLOCK_N"]
    load_kernel(down_kernel)[(pairs, -(-hidden // down_n))](h, ids, weights.reshape(-1).contiguous(), *_stored(down), y,
                                                            hidden, inter, h.stride(0), *_strides(down), y.stride(0))
    return y.reshape(tokens, top_k, hidden).sum(1).to(x.dtype)


def _stored(w: ExpertWeights) -> tuple:
    """The kernels' weight pointers: the codes, then for stored experts the scales and the zeros
    (the scales again for int8, which has none and never reads them)."""
    if w.scales is None:
        return (w.qweight,)
    return w.qweight, w.scales, w.scales if w.zeros is None else w.zeros


def _strides(w: ExpertWeights) -> tuple:
    """Per expert and per row: the codes', then for stored experts the scales' (and zeros')."""
    codes = (w.qweight.stride(0), w.qweight.stride(1))
    return codes if w.scales is None else codes + (w.scales.stride(0), w.scales.stride(1))
