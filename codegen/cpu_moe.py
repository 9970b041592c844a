"""The CPU kernel of the `moe` op, run sparsely: route every token, then for each expert that some
token chose, gather those tokens and run that expert's SwiGLU MLP on them alone, so an expert no
token chose is never read (the reference in compiler/ops.py runs every expert densely)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmc.codegen.cpu_kernels import kernel
from llmc.compiler.ops import moe_routing


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


@kernel("moe")
def moe(x, router, gate_up, down, *, top_k, **attrs):
    weights, experts = moe_routing(x, router, top_k)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, rows, slots in expert_groups(experts, router.shape[0]):
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, rows, y.float() * weights[rows, slots, None])
    return [out.to(x.dtype)]
