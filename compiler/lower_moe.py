"""Mixture of experts, recognised structurally: transformers runs Mixtral's experts through its own
`transformers::grouped_mm_fallback` op or a data-dependent per-expert loop, neither of which traces
into aten ops lowering could read. So, while a model is exported, each MoE block whose structure llmc
knows (Mixtral's: a top-k softmax router renormalised over the chosen experts, SwiGLU experts with
[gate; up] weights, no biases) calls the opaque op `llmc::moe` instead, and lowering raises that to
the IR's `moe` op. Any other MoE block keeps its own forward and is refused at lowering (its
transformers op is not aten)."""

from __future__ import annotations

import contextlib
import types

import torch

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import OPS

MOE_TARGET = "llmc.moe.default"


@torch.library.custom_op("llmc::moe", mutates_args=())
def _moe_op(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            top_k: int) -> torch.Tensor:
    return OPS["moe"].reference(x, router, gate_up, down, top_k=top_k)[0]


@_moe_op.register_fake
def _(x, router, gate_up, down, top_k):
    return torch.empty_like(x)


def mixtral_structure(block: torch.nn.Module) -> bool:
    """Whether `block` computes exactly what the `moe` op does (checked on its classes and flags)."""
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if type(block).__name__ != "MixtralSparseMoeBlock" or type(gate).__name__ != "MixtralTopKRouter":
        return False
    flags = {k: getattr(experts, k, None) for k in ("has_gate", "has_bias", "is_transposed", "is_concatenated",
                                                    "has_post_expert_norm")}
    return (flags == {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                      "has_post_expert_norm": False}
            and _is_silu(getattr(experts, "act_fn", None))
            and type(experts)._apply_gate.__name__ == "_default_apply_gate"
            and gate.top_k == block.top_k and gate.weight.shape[0] == experts.gate_up_proj.shape[0])


def _is_silu(act) -> bool:
    probe = torch.linspace(-6, 6, 49)
    return callable(act) and torch.equal(act(probe), torch.nn.functional.silu(probe))


def _moe_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = torch.ops.llmc.moe(flat, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, self.top_k)
    return out.reshape(hidden_states.shape)


@contextlib.contextmanager
def moe_blocks_as_ops(model: torch.nn.Module):
    """For the duration of an export, Mixtral MoE blocks call `llmc::moe` (their forward restored after)."""
    blocks = [m for m in model.modules() if mixtral_structure(m)]
    for block in blocks:
        block.forward = types.MethodType(_moe_forward, block)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def raise_moe(g: Graph) -> int:
    """Replace each `llmc.moe` call of the traced graph by the IR's `moe` op."""
    count = 0
    for i, n in enumerate(g.nodes):
        if n.op == "aten" and n.attrs["target"] == MOE_TARGET:
            args = [a["$in"] if isinstance(a, dict) else a for a in n.attrs["args"]]
            moe = Node(n.name, "moe", [n.inputs[k] for k in args[:4]], [], {"top_k": int(args[4])})
            moe.outputs = n.outputs
            g.nodes[i] = moe
            count += 1
    return count
