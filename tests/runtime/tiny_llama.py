"""A hand-built two-layer Llama-like graph with random weights, and a plain op-by-op
evaluation of it through the ops.py references, shared by the codegen and runtime tests."""

from __future__ import annotations

import torch

from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.ops import run_reference

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4, 2, 8, 64, 50
EPS = 1e-5


def _f32(*shape) -> TensorType:
    return TensorType(shape, "float32")


class _Builder:
    def __init__(self, graph: Graph, seed: int):
        self.g = graph
        self.gen = torch.Generator().manual_seed(seed)

    def param(self, name: str, *shape, around: float = 0.0, scale: float = 0.2) -> str:
        self.g.add_param(name, _f32(*shape), around + scale * torch.randn(shape, generator=self.gen))
        return name

    def node(self, op: str, inputs: list[str], out: TensorType, name: str, **attrs) -> str:
        n = self.g.make_node(op, inputs, [out], attrs, name=name)
        self.g.nodes.append(n)
        return n.out.name

    def linear(self, x: str, weight: str, out_features: int, in_features: int, name: str) -> str:
        w = self.param(weight, out_features, in_features)
        return self.node("linear", [x, w], _f32("tokens", out_features), name)

    def rms_norm(self, x: str, weight: str, name: str) -> str:
        w = self.param(weight, HIDDEN, around=1.0, scale=0.1)
        return self.node("rms_norm", [x, w], _f32("tokens", HIDDEN), name, eps=EPS)


def _attention_block(b: _Builder, i: int, x: str) -> str:
    p, q_dim, kv_dim = f"layers.{i}.", HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    h = b.rms_norm(x, p + "input_norm", f"l{i}.input_norm")
    q = b.linear(h, p + "q_proj", q_dim, HIDDEN, f"l{i}.q_proj")
    k = b.linear(h, p + "k_proj", kv_dim, HIDDEN, f"l{i}.k_proj")
    v = b.linear(h, p + "v_proj", kv_dim, HIDDEN, f"l{i}.v_proj")
    rope = dict(head_dim=HEAD_DIM, scaling=1.0)
    q = b.node("rope", [q, "positions", "inv_freq"], _f32("tokens", q_dim), f"l{i}.q_rope", **rope)
    k = b.node("rope", [k, "positions", "inv_freq"], _f32("tokens", kv_dim), f"l{i}.k_rope", **rope)
    a = b.node("attention", [q, k, v], _f32("tokens", q_dim), f"l{i}.attn", num_heads=HEADS,
               num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM ** -0.5, causal=True, layer=i)
    o = b.linear(a, p + "o_proj", HIDDEN, q_dim, f"l{i}.o_proj")
    return b.node("add", [x, o], _f32("tokens", HIDDEN), f"l{i}.attn_residual")


def _mlp_block(b: _Builder, i: int, x: str) -> str:
    p = f"layers.{i}."
    h = b.rms_norm(x, p + "post_norm", f"l{i}.post_norm")
    gate = b.linear(h, p + "gate_proj", FFN, HIDDEN, f"l{i}.gate_proj")
    up = b.linear(h, p + "up_proj", FFN, HIDDEN, f"l{i}.up_proj")
    act = b.node("silu", [gate], _f32("tokens", FFN), f"l{i}.silu")
    m = b.node("mul", [act, up], _f32("tokens", FFN), f"l{i}.mul")
    d = b.linear(m, p + "down_proj", HIDDEN, FFN, f"l{i}.down_proj")
    return b.node("add", [x, d], _f32("tokens", HIDDEN), f"l{i}.mlp_residual")


def build_tiny_llama(seed: int = 0, num_layers: int = 2, aten_scale: bool = False,
                     select_rows: bool = False) -> Graph:
    """embedding -> num_layers x (attention block, MLP block) -> norm -> lm_head; with
    `aten_scale`, an aten.mul fallback scales the embeddings (as Gemma does); with
    `select_rows`, the LM head runs only on the rows named by input `logits_indices: int64[rows]`."""
    g = Graph("tiny_llama")
    b = _Builder(g, seed)
    g.add_input("input_ids", TensorType(("tokens",), "int64"))
    g.add_input("positions", TensorType(("tokens",), "int64"))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    g.add_param("inv_freq", _f32(HEAD_DIM // 2), inv_freq)
    x = b.node("embedding", ["input_ids", b.param("embed_tokens", VOCAB, HIDDEN, scale=1.0)],
               _f32("tokens", HIDDEN), "embed")
    if aten_scale:
        x = b.node("aten", [x], _f32("tokens", HIDDEN), "embed_scale", target="aten.mul.Tensor",
                   args=[{"$in": 0}, {"$float": "1.5"}], kwargs={})
    for i in range(num_layers):
        x = _mlp_block(b, i, _attention_block(b, i, x))
    x = b.rms_norm(x, "norm", "final_norm")
    if select_rows:
        g.add_input("logits_indices", TensorType(("rows",), "int64"))
        x = b.node("select_rows", [x, "logits_indices"], _f32("rows", HIDDEN), "last_rows")
        w = b.param("lm_head", VOCAB, HIDDEN)
        b.node("linear", [x, w], _f32("rows", VOCAB), "logits")
    else:
        b.linear(x, "lm_head", VOCAB, HIDDEN, "logits")
    g.outputs = ["logits"]
    g.verify()
    return g


def reference_outputs(graph: Graph, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Evaluate the graph node by node with the ops.py references (attention over all tokens)."""
    env = dict(graph.weights)
    env.update(inputs)
    for node in graph.nodes:
        outs = run_reference(node, [env[i] for i in node.inputs])
        env.update(zip((v.name for v in node.outputs), outs))
    return {o: env[o] for o in graph.outputs}


def random_tokens(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, positions) for one sequence of n tokens."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen), torch.arange(n)
