"""The CPU kernels of the `moe` and `qmoe` ops, run sparsely: route every token, then for each expert
that some token chose, gather those tokens and run that expert's SwiGLU MLP on them alone, so an
expert no token chose is never read (the references in compiler/ops.py run every expert densely). A
qmoe dequantises a chosen expert's int8/int4 weights for the step it runs in."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmc.codegen.torch_cpu.cpu_kernels import kernel
from llmc.compiler.ops import expert_weights, moe_routing, qmoe_inputs


def expert_groups(experts: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each chosen expert e: (e, token rows, their top-k slot), from ids [tokens, top_k]."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    top_k = experts.shape[1]
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start:start + n]
            groups.append((e, pairs // top_k, pairs % top_k))
        start += n
    return groups


def sparse_moe(x, router, top_k: int, expert_mlp) -> torch.Tensor:
    """Route x [T, H] and sum, per token, its chosen experts' expert_mlp(e, rows of x) by their weights."""
    weights, experts = moe_routing(x, router, top_k)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, rows, slots in expert_groups(experts, router.shape[0]):
        out.index_add_(0, rows, expert_mlp(e, x[rows]).float() * weights[rows, slots, None])
    return out.to(x.dtype)


def swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


@kernel("moe")
def moe(x, router, gate_up, down, *, top_k, **attrs):
    return [sparse_moe(x, router, top_k, lambda e, rows: swiglu_expert(rows, gate_up[e], down[e]))]


@kernel("qmoe")
def qmoe(*inputs, top_k, scheme, **attrs):
    x, router, gate_up, down = qmoe_inputs(list(inputs), scheme)

    def expert_mlp(e, rows):
        dense = [expert_weights(scheme, w, e, x.dtype) for w in (gate_up, down)]
        return swiglu_expert(rows, *dense)
    return [sparse_moe(x, router, top_k, expert_mlp)]
