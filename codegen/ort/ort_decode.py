"""The decode graph: a cpu plan's whole forward for decode-only steps (every sequence feeding one
token) as ONE ONNX Runtime session, attention included. A decode step through the plan walk pays
for ~60 Python launches and 30 small torch attentions around its GEMVs; as one session it pays for
one run. Attention reads the paged KV cache itself: each layer's cache is an input bound to the
runtime's memory, gathered through the block tables, and the step's rotated keys and values come
out (new_keys / new_values) for the runtime to write into the cache after the run. Stored as
ort/decode.onnx with a `decode_graph` record in plan.meta; `--kernels auto` keeps it where it
measured faster than the plan walk on this machine (compiler/driver/tuning/decode_graph_choice.py)."""

from __future__ import annotations

import numpy as np

from llmc.codegen.ort.onnx_ops import MS_DOMAIN, OPSET, TRANSLATIONS, OnnxBuilder, rope_angles
from llmc.codegen.ort.ort_lowering import kept_in_torch, unforced
from llmc.compiler.ir import Graph
from llmc.compiler.ops import ATTENTION_OPS

DECODE_FILE = "ort/decode.onnx"
DECODE_KERNEL = "ort.decode"
BLOCK_TABLES = "block_tables"      # int64 [tokens, blocks]: each decode's cache blocks in order, padded
NEW_KEYS, NEW_VALUES = "new_keys", "new_values"   # float32 [layers, tokens, kv_heads, head_dim]


def cache_inputs(num_layers: int) -> list[str]:
    return [f"{kind}_cache.{layer}" for kind in ("k", "v") for layer in range(num_layers)]


def decode_refusal(graph: Graph) -> str | None:
    """Why the graph has no decode graph (None: it can have one)."""
    attention = [n for n in graph.nodes if n.op in ATTENTION_OPS]
    if not attention or "positions" not in [v.name for v in graph.inputs]:
        return "the graph has no attention or no positions input"
    layers = sorted(n.attrs["layer"] for n in attention)
    if layers != list(range(len(layers))):
        return f"attention layers {layers[:6]} are not 0 .. {len(layers) - 1} once each"
    if len({(n.attrs["num_kv_heads"], n.attrs["head_dim"]) for n in attention}) > 1:
        return "attention layers differ in KV heads or head size"
    for n in attention:
        a = n.attrs
        why = ("a quantised KV cache" if a.get("kv_cache") is not None else
               "attention logit soft-capping" if a.get("softcap") is not None else
               "non-causal attention" if not a.get("causal", True) else
               "attention inputs with leading batch dims" if any(len(graph.type_of(i).shape) != 2
                                                                for i in n.inputs[:3]) else None)
        if why:
            return f"node {n.name}: {why} has no decode-graph lowering"

    ops = {n.name: n.op for n in graph.nodes}
    for name, why in unforced(kept_in_torch(graph)).items():   # ops ORT cannot run, in graph order
        return f"node {name} ({ops[name]}): {why}"
    return None


def build_decode_graph(graph: Graph, nbits_level: int, levels: dict[str, int] | None = None) -> tuple[bytes, dict]:
    """(ONNX bytes, the plan.meta record without file hash) for `graph`'s decode graph; MatMulNBits
    at `nbits_level`, or at `levels[node]` for the nodes named there."""
    from onnx import TensorProto, helper  # onnx: the engine and every compile import this module

    levels = levels or {}
    b = OnnxBuilder(graph, graph.weights, segment=True, nbits_level=nbits_level)
    inputs = [v.name for v in graph.inputs]
    b.env = {i: i for i in inputs}
    attention = [n for n in graph.nodes if n.op in ATTENTION_OPS]
    kv_heads, head_dim = attention[0].attrs["num_kv_heads"], attention[0].attrs["head_dim"]
    new_kv: dict[int, tuple[str, str]] = {}
    for node in graph.nodes:
        if node.op in ATTENTION_OPS:
            new_kv[node.attrs["layer"]] = _paged_decode_attention(b, node)
        else:
            b.nbits_level = levels.get(node.name, nbits_level)
            TRANSLATIONS[node.op](b, node)
    outputs = list(graph.outputs)
    for out in outputs:
        b.add("Identity", [b.env[out]], [out])
    layers = range(len(attention))
    for name, which in ((NEW_KEYS, 0), (NEW_VALUES, 1)):   # [b, 1, kv * hd] a layer, stacked layer-major
        b.add("Reshape", [b.one("Concat", *(new_kv[layer][which] for layer in layers), axis=0),
                          b.ints(len(attention), -1, kv_heads, head_dim)], [name])

    def info(name, elem, shape):
        return helper.make_tensor_value_info(name, elem, shape)
    elem = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "int32": TensorProto.INT32}
    onnx_inputs = [info(i, elem[graph.type_of(i).dtype], list(graph.type_of(i).shape)) for i in inputs]
    onnx_inputs.append(info(BLOCK_TABLES, TensorProto.INT64, ["tokens", "blocks"]))
    onnx_inputs += [info(name, TensorProto.FLOAT, ["cache_blocks", "block_size", kv_heads, head_dim])
                    for name in cache_inputs(len(attention))]
    onnx_outputs = [info(o, elem[graph.type_of(o).dtype], list(graph.type_of(o).shape)) for o in outputs]
    onnx_outputs += [info(name, TensorProto.FLOAT, [len(attention), "tokens", kv_heads, head_dim])
                     for name in (NEW_KEYS, NEW_VALUES)]
    onnx_graph = helper.make_graph(b.nodes, f"{graph.name or 'llmc'}.decode", onnx_inputs, onnx_outputs,
                                   b.initializers)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if b.uses_ms else [])
    model = helper.make_model(onnx_graph, opset_imports=opsets, producer_name="llmc")
    model.ir_version = 8
    record = {"file": DECODE_FILE, "num_layers": len(attention), "num_kv_heads": kv_heads, "head_dim": head_dim,
              "inputs": inputs, "outputs": outputs,
              "initializers": {name: list(source) for name, source in sorted(b.sources.items())}}
    return model.SerializeToString(), record


def _paged_decode_attention(b: OnnxBuilder, n) -> tuple[str, str]:
    """One decode token per row: q [b, heads * hd] attends its sequence's cached keys (gathered from
    k_cache.L through block_tables, visible below its position and within the sliding window) and its
    own key. Returns this layer's rotated keys and values [b, kv_heads, hd].

    Few, large nodes: every node is a dispatch, and a small one costs more than its arithmetic (an
    earlier lowering of ~60 nodes a layer spent about as long around SmolLM2's int4 GEMVs as in them).
    The gathered keys and values are read as they lie, [b, ctx, kv_heads * hd], never transposed or
    concatenated with the own key (at batch 64 those copies cost more than the GEMMs). The queries
    are laid out block-diagonally, [b, heads, kv_heads * hd] with query head h (of KV head h // group,
    HF's repeat_kv order) in KV head h // group's columns and the softmax scale folded in, so scores
    are one MatMul against the keys transposed in place (FusedMatMul transB), and the output's
    off-diagonal blocks are masked out of a [b, heads, kv_heads * hd] product."""
    a = n.attrs
    heads, kv, hd, layer = a["num_heads"], a["num_kv_heads"], a["head_dim"], a["layer"]
    group = heads // kv
    q, k, v = (b.value(i) for i in n.inputs[:3])
    q, k = b.one("Reshape", q, b.ints(0, 1, heads * hd)), b.one("Reshape", k, b.ints(0, 1, kv * hd))
    if n.op == "flash_attention" and a.get("rope") is not None:
        cos, sin, rows = _rotary_tables(b, n.inputs[3], n.inputs[4], a["rope"]["scaling"])
        q, k = (b.one("RotaryEmbedding", x, rows, cos, sin, domain=MS_DOMAIN, num_heads=count)
                for x, count in ((q, heads), (k, kv)))                            # [b, 1, n * hd]
    v = b.one("Reshape", v, b.ints(0, 1, kv * hd))
    past_k, past_v = (b.one("Reshape", b.one("Gather", f"{kind}_cache.{layer}", BLOCK_TABLES, axis=0),
                            b.ints(0, -1, kv * hd)) for kind in ("k", "v"))      # [b, ctx, kv * hd]
    eye = np.eye(kv, dtype=np.float32).reshape(kv, 1, kv, 1)
    scaled_eye = b.const(f"const/f32/eye{kv}x{a['scale']!r}", eye * np.float32(a["scale"]))
    q_diag = b.one("Reshape", b.one("Mul", b.one("Reshape", q, b.ints(0, kv, group, 1, hd)), scaled_eye),
                   b.ints(0, heads, kv * hd))                                     # [b, heads, kv * hd]
    scores = b.one("Add", b.one("FusedMatMul", q_diag, past_k, domain=MS_DOMAIN, transB=1),
                   _decode_bias(b, past_k, a.get("window")))                      # [b, heads, ctx]
    own = b.one("FusedMatMul", q_diag, k, domain=MS_DOMAIN, transB=1)             # [b, heads, 1]
    probs = b.one("Softmax", b.one("Concat", scores, own, axis=-1), axis=-1)     # [b, heads, ctx + 1]
    p_past, p_own = b.add("Split", [probs, _ctx_and_one(b, past_k)], [b.fresh("p_past"), b.fresh("p_own")], axis=-1)
    out = b.one("Add", b.one("MatMul", p_past, past_v), b.one("MatMul", p_own, v))  # [b, heads, kv * hd]
    eye = b.const(f"const/f32/eye{kv}", eye)
    out = b.one("ReduceSum", b.one("Mul", b.one("Reshape", out, b.ints(0, kv, group, kv, hd)), eye),
                b.ints(3), keepdims=0)                                            # [b, kv, group, hd]
    b.bind(n, b.one("Reshape", out, b.ints(0, heads * hd)))
    return k, v


def _rotary_tables(b: OnnxBuilder, positions: str, inv_freq: str, scaling: float) -> tuple[str, str, str]:
    """com.microsoft.RotaryEmbedding's inputs for the step's tokens, once per graph: cos and sin
    [b, hd / 2] of each token's own position (times the rope's attention scaling) as the caches, and
    position ids [b, 1] = the row, so token i reads row i (no table of every position)."""
    def make():
        freqs = rope_angles(b, positions, inv_freq)
        cos, sin = (b.one("Mul", b.one(f, freqs), b.scalar(scaling)) for f in ("Cos", "Sin"))
        zero, one = b.i64(0), b.i64(1)
        tokens = b.one("Gather", b.one("Shape", b.value(positions)), zero, axis=0)
        rows = b.one("Unsqueeze", b.one("Range", zero, tokens, one), b.ints(1))
        return cos, sin, rows
    return b.cached(("rotary_tables", positions, inv_freq, scaling), make)


def _ctx_and_one(b: OnnxBuilder, past: str) -> str:
    """[ctx, 1]: the split of [past keys, own key] along the key axis."""
    return b.cached("ctx_and_one", lambda: b.one("Concat", b.one("Slice", b.one("Shape", past), b.ints(1), b.ints(2)),
                                                 b.ints(1), axis=0))


def _decode_bias(b: OnnxBuilder, past: str, window: int | None) -> str:
    """Additive mask [b, 1, ctx]: gathered key j (position j) is visible to the decode at position p
    when j < p (and j > p - window); its own key is attended apart. Built once per graph."""
    def make():
        zero, one = b.i64(0), b.i64(1)
        ctx = b.one("Gather", b.one("Shape", past), one, axis=0)
        keys = b.one("Unsqueeze", b.one("Range", zero, ctx, one), b.ints(0))      # [1, ctx]
        p = b.one("Unsqueeze", "positions", b.ints(1))                              # [b, 1]
        visible = b.one("Less", keys, p)
        if window is not None:
            first = b.one("Sub", p, b.i64(window - 1))
            visible = b.one("And", visible, b.one("GreaterOrEqual", keys, first))
        bias = b.one("Where", visible, b.scalar(0.0), b.scalar(float("-inf")))       # [b, ctx]
        return b.one("Unsqueeze", bias, b.ints(1))
    return b.cached(("decode_bias", window), make)


__all__ = ["build_decode_graph", "decode_refusal", "cache_inputs", "DECODE_FILE", "BLOCK_TABLES", "NEW_KEYS",
           "NEW_VALUES"]
