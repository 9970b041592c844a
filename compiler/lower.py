"""Lowering: raise aten patterns of a translated graph into LLM-level ops (embedding,
linear, rms_norm, rope, attention, silu, mul, add) and drop the unit batch dim.
Whatever no pattern claims stays an `aten` fallback node.

Attention is matched on whole SDPA nodes, before anything decomposes them, and in its unfused
form (matmul -> scale -> mask -> softmax -> matmul, as eager attention and ONNX imports write
it), before the mask's add is raised on its own; either way its mask is classified by evaluating
the mask subgraph on probe inputs, so it does not matter how a model builds its causal mask."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.lower_heads import flat_heads, new_param, raise_column_splits, raise_linear_forms, subgraph_for
from llmc.compiler.lower_moe import raise_moe
from llmc.compiler.ops import ATTENTION_OPS, OPS, infer_types
from llmc.compiler.trace import ATTENTION_WINDOWS, TOKENS
from llmc.errors import IRError

LAYOUT_NOOPS = {"aten.alias.default", "aten.clone.default", "aten.contiguous.default"}
# Unary elementwise aten ops: shape-polymorphic, so they survive dropping the batch dim.
ELEMENTWISE_ATEN = {f"aten.{op}.default" for op in ("gelu", "relu", "tanh", "sigmoid", "exp", "neg", "abs",
                                                      "sqrt", "rsqrt", "erf", "log", "sin", "cos", "hardswish")}
SCALAR_ARITHMETIC = {f"aten.{op}" for op in ("mul.Tensor", "add.Tensor", "sub.Tensor", "div.Tensor", "rsub.Scalar",
                                               "pow.Tensor_Scalar", "mul.Scalar", "add.Scalar")}
CASTS = {"aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default"}


class Matcher:
    """Read-only queries over aten nodes: producers, args, transparent casts."""

    def __init__(self, g: Graph):
        self.g = g
        self.prod = g.producers()
        self.users = g.users()
        self.types = g.types()

    def node(self, value: str | None) -> Node | None:
        return self.prod.get(value) if value is not None else None

    @staticmethod
    def is_(node: Node | None, *targets: str) -> bool:
        return node is not None and node.op == "aten" and node.attrs["target"] in targets

    @staticmethod
    def arg(node: Node, i: int, kw: str | None = None, default=None):
        """The i-th positional (or keyword `kw`) arg, with {"$in": k} resolved to a value name."""
        args = node.attrs["args"]
        a = args[i] if i < len(args) else node.attrs["kwargs"].get(kw, default) if kw else default
        return _resolve(a, node.inputs)

    def through_noops(self, value: str) -> str:
        """Walk up through casts that keep the dtype and layout-only copies."""
        while True:
            n = self.node(value)
            if n is None or n.op != "aten":
                return value
            t = n.attrs["target"]
            src = n.inputs[0] if n.inputs else None
            if t in LAYOUT_NOOPS or (t in CASTS and src and self.types[src].dtype == self.types[value].dtype):
                value = src
            else:
                return value

    def only_user(self, value: str) -> Node | None:
        users = [u for u in self.users.get(value, []) if not self.is_(u, "aten._assert_tensor_metadata.default")]
        return users[0] if len(users) == 1 else None


def _resolve(a, inputs):
    if isinstance(a, dict) and "$in" in a:
        return inputs[a["$in"]]
    if isinstance(a, list):
        return [_resolve(x, inputs) for x in a]
    return a


# -- simple one-to-one raises ----------------------------------------------------------
def raise_simple(g: Graph) -> int:
    m = Matcher(g)
    count = 0
    for i, n in enumerate(g.nodes):
        new = _simple(m, n)
        if new is not None:
            new.outputs = n.outputs
            g.nodes[i] = new
            count += 1
    return count


def _tensor(m: Matcher, a) -> bool:
    return isinstance(a, str) and a in m.types and m.types[a].dtype != "symint"


def _simple(m: Matcher, n: Node) -> Node | None:
    if n.op != "aten":
        return None
    t, a = n.attrs["target"], n.attrs["args"]
    if t == "aten.embedding.default":  # padding_idx and sparse only matter for training
        return Node(n.name, "embedding", [m.arg(n, 1), m.arg(n, 0)], [])
    if t == "aten.linear.default":
        ins = [m.arg(n, 0), m.arg(n, 1)] + ([m.arg(n, 2)] if len(a) > 2 and m.arg(n, 2) else [])
        return Node(n.name, "linear", ins, [])
    if t == "aten.silu.default":
        return Node(n.name, "silu", [m.arg(n, 0)], [])
    if t == "aten.gelu.default":
        return Node(n.name, "gelu", [m.arg(n, 0)], [], {"approximate": m.arg(n, 1, "approximate", "none")})
    if t == "aten.layer_norm.default":
        return _layer_norm(m, n)
    # in place (Falcon's `mlp_output += attention_output`) is the same when nothing else reads x
    in_place = t in ("aten.mul_.Tensor", "aten.add_.Tensor") and m.only_user(m.arg(n, 0)) is n
    if (t in ("aten.mul.Tensor", "aten.add.Tensor") or in_place) and not n.attrs["kwargs"]:
        x, y = m.arg(n, 0), m.arg(n, 1)
        if _tensor(m, x) and _tensor(m, y) and m.types[x].dtype == m.types[y].dtype:
            return Node(n.name, t.split(".")[1].rstrip("_"), [x, y], [])
    return None


def _layer_norm(m: Matcher, n: Node) -> Node | None:
    """layer_norm over the last dim, with a gain and bias, a gain alone, or neither."""
    x, shape, weight, bias = (m.arg(n, i, kw) for i, kw in ((0, None), (1, None), (2, "weight"), (3, "bias")))
    if shape != [m.types[x].shape[-1]] or (bias is not None and weight is None):
        return None
    return Node(n.name, "layer_norm", [v for v in (x, weight, bias) if v is not None], [],
                {"eps": float(m.arg(n, 4, "eps", 1e-5))})


# -- rms_norm --------------------------------------------------------------------------
def raise_rms_norm(g: Graph) -> int:
    """weight * (x * rsqrt(mean(x^2, -1, keepdim) + eps)) -> rms_norm(x, weight, eps)."""
    m = Matcher(g)
    count = 0
    for n in list(g.nodes):
        if not m.is_(n, "aten.rsqrt.default"):
            continue
        hit = _match_rms(m, n)
        if hit is None:
            continue
        final, x, weight, eps = hit
        new = Node(final.name, "rms_norm", [x, weight], final.outputs, {"eps": eps})
        g.nodes[g.nodes.index(final)] = new
        count += 1
    return count


def _match_rms(m: Matcher, rsqrt: Node):
    add = m.node(m.arg(rsqrt, 0))
    if not m.is_(add, "aten.add.Tensor") or not isinstance(m.arg(add, 1), (int, float)):
        return None
    mean = m.node(m.arg(add, 0))
    if not m.is_(mean, "aten.mean.dim") or m.arg(mean, 1) not in ([-1],) or m.arg(mean, 2) is not True:
        return None
    pw = m.node(m.arg(mean, 0))
    if not m.is_(pw, "aten.pow.Tensor_Scalar") or m.arg(pw, 1) != 2:
        return None
    x = m.through_noops(m.arg(pw, 0))
    normed = m.only_user(rsqrt.outputs[0].name)
    if not m.is_(normed, "aten.mul.Tensor") or m.through_noops(m.arg(normed, 0)) != x:
        return None
    cur = normed.outputs[0].name
    user = m.only_user(cur)
    while m.is_(user, *CASTS) and m.types[user.outputs[0].name].dtype == m.types[x].dtype:
        cur, user = user.outputs[0].name, m.only_user(user.outputs[0].name)
    if not m.is_(user, "aten.mul.Tensor"):
        return None
    a, b = m.arg(user, 0), m.arg(user, 1)
    weight = _gain(m, a if b == cur else b)
    if weight is None or m.g.params[weight].type.rank != 1:
        return None
    return user, x, weight, float(m.arg(add, 1))


def _gain(m: Matcher, value: str) -> str | None:
    """The norm's gain param: a param, or (Gemma) param + c, folded into a param of its own."""
    value = m.through_noops(value)
    if value in m.g.params:
        return value
    add = m.node(value)
    if not m.is_(add, "aten.add.Tensor") or add.attrs["kwargs"]:
        return None
    param, offset = m.through_noops(m.arg(add, 0)), _scalar(m.arg(add, 1))
    if param not in m.g.params or offset is None:
        return None
    return new_param(m.g, f"{param}.plus_{offset:g}", m.g.weights[param] + offset)


# -- rope + attention --------------------------------------------------------------------
@dataclass
class _Rope:
    source: str          # the head-split tensor [1, heads, T, hd] before rotation
    positions: str
    inv_freq: str
    scaling: float
    rotary_dim: int | None = None   # partial rotary: only the first rotary_dim features of a head turn


def _match_any_rope(m: Matcher, value: str) -> _Rope | None:
    """Rotary on the whole head, or partial: cat([rope(x[..., :r]), x[..., r:]], -1) (GPT-NeoX, Phi)."""
    rope = _match_rope(m, value)
    if rope is not None:
        return rope
    cat = m.node(m.through_noops(value))
    if not m.is_(cat, "aten.cat.default") or len(m.arg(cat, 0)) != 2 or m.arg(cat, 1) not in (-1, 3):
        return None
    rotated, passed = m.arg(cat, 0)
    rope, rest = _match_rope(m, rotated), m.node(passed)
    if rope is None or not m.is_(rest, "aten.slice.Tensor") or m.arg(rest, 1) not in (-1, 3):
        return None
    x, rotary_dim = m.arg(rest, 0), m.arg(rest, 2)
    if not isinstance(rotary_dim, int) or not isinstance(m.arg(rest, 3), int):
        return None
    head_dim = m.types[x].shape[-1]
    if m.through_noops(rope.source) == x and rotary_dim >= head_dim:  # nothing passes (Phi-3 at factor 1)
        return _Rope(x, rope.positions, rope.inv_freq, rope.scaling)
    first = m.node(rope.source)
    if (not m.is_(first, "aten.slice.Tensor") or m.arg(first, 0) != x or m.arg(first, 1) not in (-1, 3)
            or m.arg(first, 2) not in (0, None) or m.arg(first, 3) != rotary_dim or m.arg(rest, 3) < head_dim
            or not 0 < rotary_dim < head_dim):
        return None
    return _Rope(x, rope.positions, rope.inv_freq, rope.scaling, rotary_dim)


def _match_rope(m: Matcher, value: str) -> _Rope | None:
    """x*cos + cat(-x2, x1)*sin, with cos/sin built from positions and an inv_freq param."""
    add = m.node(m.through_noops(value))
    if not m.is_(add, "aten.add.Tensor"):
        return None
    l_mul, r_mul = m.node(m.arg(add, 0)), m.node(m.arg(add, 1))
    if not (m.is_(l_mul, "aten.mul.Tensor") and m.is_(r_mul, "aten.mul.Tensor")):
        return None
    x, cos_v = m.arg(l_mul, 0), m.arg(l_mul, 1)
    cat, sin_v = m.node(m.arg(r_mul, 0)), m.arg(r_mul, 1)
    if not m.is_(cat, "aten.cat.default"):
        return None
    parts = m.arg(cat, 0)
    neg, first = (m.node(p) for p in parts) if len(parts) == 2 else (None, None)
    if not (m.is_(neg, "aten.neg.default") and m.is_(first, "aten.slice.Tensor")):
        return None
    second = m.node(m.arg(neg, 0))
    if not m.is_(second, "aten.slice.Tensor") or m.arg(second, 0) != x or m.arg(first, 0) != x:
        return None
    table = _match_rope_table(m, cos_v, "aten.cos.default")
    if table is None or _match_rope_table(m, sin_v, "aten.sin.default") != table:
        return None
    return _Rope(x, *table)


def _strip(m: Matcher, value: str, targets: set[str]) -> str:
    while True:
        value = m.through_noops(value)
        n = m.node(value)
        if n is not None and n.op == "aten" and n.attrs["target"] in targets:
            value = n.inputs[0]
        else:
            return value


_SHAPE_OPS = {"aten.unsqueeze.default", "aten.expand.default", "aten.transpose.int",
              "aten.view.default", "aten.reshape.default"} | CASTS


def _match_rope_table(m: Matcher, value: str, trig: str):
    """cos/sin table -> (positions input, inv_freq param, scaling)."""
    scaling = 1.0
    v = _strip(m, value, _SHAPE_OPS)
    n = m.node(v)
    if m.is_(n, "aten.mul.Tensor") and isinstance(m.arg(n, 1), (int, float)):
        scaling = float(m.arg(n, 1))
        n = m.node(_strip(m, m.arg(n, 0), _SHAPE_OPS))
    if not m.is_(n, trig):
        return None
    cat = m.node(_strip(m, n.inputs[0], _SHAPE_OPS))
    if not m.is_(cat, "aten.cat.default") or len(set(m.arg(cat, 0))) != 1:
        return None
    freqs = m.node(_strip(m, m.arg(cat, 0)[0], _SHAPE_OPS))
    if not m.is_(freqs, "aten.mul.Tensor", "aten.matmul.default", "aten.bmm.default"):
        return None
    ends = {_strip(m, i, _SHAPE_OPS) for i in freqs.inputs}
    positions = [e for e in ends if e in {v.name for v in m.g.inputs}]
    inv_freq = [e for e in ends if e in m.g.params]
    if positions != ["positions"] or len(inv_freq) != 1:
        return None
    return "positions", inv_freq[0], scaling


def _repeat_kv_source(m: Matcher, value: str) -> str:
    """reshape(expand(unsqueeze(x, 2), [b, kvh, rep, T, hd]), [b, kvh*rep, T, hd]) -> x."""
    rs = m.node(m.through_noops(value))
    if not m.is_(rs, "aten.reshape.default", "aten.view.default"):
        return value
    ex = m.node(m.through_noops(rs.inputs[0]))
    if not m.is_(ex, "aten.expand.default"):
        return value
    un = m.node(m.through_noops(ex.inputs[0]))
    if not m.is_(un, "aten.unsqueeze.default") or m.arg(un, 1) != 2:
        return value
    return un.inputs[0]


def _merge_heads_user(m: Matcher, heads_out: Node) -> Node | None:
    """Follow [1, H, T, hd] -> transpose(1, 2) (or permute) -> reshape [1, T, H*hd]; returns the last node."""
    out_t = m.types[heads_out.outputs[0].name]
    cur, transposed = heads_out.outputs[0].name, False
    while True:
        u = m.only_user(cur)
        if u is None or u.op != "aten":
            return None
        t = u.attrs["target"]
        ut = m.types[u.outputs[0].name]
        swaps = (t == "aten.transpose.int" and sorted([m.arg(u, 1), m.arg(u, 2)]) == [1, 2]) or (
            t == "aten.permute.default" and m.arg(u, 1) == [0, 2, 1, 3])
        if swaps and not transposed:
            transposed = True
        elif t in ("aten.reshape.default", "aten.view.default") and not transposed:
            if ut.shape != out_t.shape:
                return None
        elif t in ("aten.reshape.default", "aten.view.default") and transposed:
            heads, hd = out_t.shape[1], out_t.shape[3]
            return u if ut.rank == 3 and ut.shape[-1] == heads * hd else None
        elif t not in LAYOUT_NOOPS:
            return None
        cur = u.outputs[0].name


@dataclass
class _Core:
    """One attention found in aten form: softmax(q k^T * scale + mask) v over heads-first
    tensors [1, heads, T, hd] (k and v perhaps repeat_kv'd up to q's heads)."""
    q: str
    k: str
    v: str
    scale: float | None          # None: SDPA's default, 1/sqrt(head_dim)
    out: Node                    # the node giving the heads-first result
    # (mask value, how it applies) or None for causal attention without a mask tensor; how:
    # "keep" True/0 where visible (SDPA, where), "add" an additive float, "fill" True where hidden
    mask: tuple[str, str] | None
    softcap: float | None = None  # scores s -> softcap * tanh(s / softcap) before the mask (Gemma 2)


SDPA = "aten.scaled_dot_product_attention.default"
SOFTMAX = ("aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default")
# A score pushed this low weighs nothing after softmax next to any realistic visible score (exp underflows).
HIDDEN_SCORE = -1e4


def raise_attention(g: Graph) -> int:
    """SDPA nodes, and attention written out as matmul -> scale -> mask -> softmax -> matmul, whose
    mask is causal or a causal sliding window -> rope + attention ops. Layers are numbered in graph
    order, and each layer's window is checked against the model config's (graph meta)."""
    m = Matcher(g)
    cores = [c for c in (_sdpa_core(m, n) or _unfused_core(m, n) for n in g.nodes) if c is not None]
    configured = g.meta.get(ATTENTION_WINDOWS)
    windows = mask_windows(g, {c.mask for c in cores if c.mask is not None}, configured or ())
    count = 0
    for core in cores:
        built = _build_attention(m, core, windows.get(core.mask)) if core.mask is None or core.mask in windows else None
        if built is None:
            continue
        merged, nodes = built
        for n in nodes:
            g.insert_before(merged, n)
        g.replace_uses(merged.outputs[0].name, nodes[-1].outputs[0].name)
        count += 1
    if count:
        number_layers(g)
        check_windows(g, configured)
    return count


def check_windows(g: Graph, configured: list[int | None] | None) -> None:
    """Refuse a graph whose attention windows (read off the traced masks) differ from the config's."""
    attns = [n for n in g.nodes if n.op in ATTENTION_OPS]
    if configured is None or len(configured) != len(attns):
        return  # no config, or attention lowering could not raise: refuse_unlowered names that node
    for n, want in zip(attns, configured):
        got = n.attrs.get("window")
        if got != want:
            raise IRError(f"attention layer {n.attrs['layer']}: the config gives sliding_window={want} for it, "
                          f"but the traced mask {'has a window of ' + str(got) if got else 'is plain causal'}; "
                          f"the model's code and config disagree, so llmc cannot tell what it computes")


def number_layers(g: Graph) -> None:
    """Give attention ops their KV-cache index: 0, 1, ... in graph order."""
    for layer, n in enumerate(n for n in g.nodes if n.op in ATTENTION_OPS):
        n.attrs["layer"] = layer


def _sdpa_core(m: Matcher, sdpa: Node) -> _Core | None:
    if not m.is_(sdpa, SDPA) or m.arg(sdpa, 4, "dropout_p", 0.0):
        return None
    mask, is_causal = m.arg(sdpa, 3, "attn_mask"), m.arg(sdpa, 5, "is_causal", False)
    if (mask is None) != bool(is_causal):  # neither or both: not (only) causal
        return None
    return _Core(m.arg(sdpa, 0), m.arg(sdpa, 1), m.arg(sdpa, 2), m.arg(sdpa, 6, "scale"), sdpa,
                 None if mask is None else (mask, "keep"))


def _unfused_core(m: Matcher, softmax: Node) -> _Core | None:
    if not m.is_(softmax, *SOFTMAX) or m.arg(softmax, 1) not in (-1, 3):
        return None
    masked = _split_mask(m, m.through_noops(m.arg(softmax, 0)))
    out = _probs_times_v(m, softmax)
    if masked is None or out is None:
        return None
    (q, k, scale, softcap), mask = masked
    return _Core(q, k, out[1], scale, out[0], mask, softcap)


def _scalar(a) -> float | None:
    if isinstance(a, dict) and "$float" in a:
        return float(a["$float"])
    return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def _split_mask(m: Matcher, value: str):
    """scores + mask, masked_fill(scores, mask, -inf) or where(mask, scores, -inf) ->
    ((q, k, scale) of the scores, (mask, how)); None without a mask."""
    n = m.node(value)
    if m.is_(n, "aten.add.Tensor") and not n.attrs["kwargs"]:
        a, b = m.arg(n, 0), m.arg(n, 1)
        for scores, mask in ((a, b), (b, a)):
            qk = _scaled_scores(m, scores) if _tensor(m, mask) else None
            if qk is not None:
                return qk, (mask, "add")
    fill = m.is_(n, "aten.masked_fill.Scalar") and (_scalar(m.arg(n, 2)) or 0) <= HIDDEN_SCORE
    keep = m.is_(n, "aten.where.ScalarOther") and (_scalar(m.arg(n, 2)) or 0) <= HIDDEN_SCORE
    if fill or keep:
        scores, mask = (m.arg(n, 0), m.arg(n, 1)) if fill else (m.arg(n, 1), m.arg(n, 0))
        qk = _scaled_scores(m, scores)
        return None if qk is None else (qk, (mask, "fill" if fill else "keep"))
    return None


def _scaled_scores(m: Matcher, value: str) -> tuple[str, str, float, float | None] | None:
    """matmul(q, transpose(k, -2, -1)) [* s | / d] [soft-capped] -> (q, k, scale, softcap)."""
    value, softcap = _soft_capped(m, value)
    n = m.node(m.through_noops(value))
    scale = 1.0
    s = _scalar(m.arg(n, 1)) if m.is_(n, "aten.mul.Tensor", "aten.div.Tensor") else None
    if s:
        scale = s if n.attrs["target"] == "aten.mul.Tensor" else 1.0 / s
        n = m.node(m.through_noops(m.arg(n, 0)))
    if not m.is_(n, "aten.matmul.default") or m.types[n.outputs[0].name].rank != 4:
        return None
    kt = m.node(m.through_noops(m.arg(n, 1)))
    if not m.is_(kt, "aten.transpose.int") or sorted([m.arg(kt, 1) % 4, m.arg(kt, 2) % 4]) != [2, 3]:
        return None
    return m.arg(n, 0), m.arg(kt, 0), scale, softcap


def _soft_capped(m: Matcher, value: str) -> tuple[str, float | None]:
    """tanh(s / c) * c -> (s, c); anything else -> (value, None)."""
    outer = m.node(m.through_noops(value))
    cap = _scalar(m.arg(outer, 1)) if m.is_(outer, "aten.mul.Tensor") else None
    tanh = m.node(m.through_noops(m.arg(outer, 0))) if cap else None
    inner = m.node(m.through_noops(tanh.inputs[0])) if m.is_(tanh, "aten.tanh.default") else None
    if not m.is_(inner, "aten.div.Tensor") or _scalar(m.arg(inner, 1)) != cap:
        return value, None
    return m.arg(inner, 0), cap


def _probs_times_v(m: Matcher, softmax: Node) -> tuple[Node, str] | None:
    """softmax -> [casts, inert dropout] -> matmul(·, v) -> (that matmul, v)."""
    cur = softmax.outputs[0].name
    while True:
        u = m.only_user(cur)
        if m.is_(u, "aten.matmul.default") and m.arg(u, 0) == cur:
            return u, m.arg(u, 1)
        inert_dropout = m.is_(u, "aten.dropout.default") and (m.arg(u, 1) == 0 or m.arg(u, 2) is False)
        if not (inert_dropout or m.is_(u, *LAYOUT_NOOPS, *CASTS)):
            return None
        cur = u.outputs[0].name


@dataclass
class _Heads:
    """q or k (or v) as lowering rebuilds it: a flat [1, T, heads*hd] projection, then a per-head
    RMS norm (Qwen3's q_norm/k_norm) and rotary, in that order, as the model applies them."""
    flat: str
    type: TensorType     # flat's
    nodes: list          # nodes to insert that compute `flat` (a column-picking linear), if any
    norm: tuple[str, float] | None = None   # (weight [hd], eps)
    rope: _Rope | None = None


def _heads(m: Matcher, value: str, head_dim: int, role: str) -> _Heads | None:
    """A heads-first q, k or v -> where its features come from, and what turns them on the way."""
    rope = _match_any_rope(m, value) if role != "v" else None
    x = rope.source if rope else value
    norm = _head_norm(m, x, head_dim) if role != "v" else None
    if norm is not None:
        x, norm = norm
    flat = flat_heads(m.g, m.prod, x, role)
    return None if flat is None else _Heads(*flat, norm, rope)


def _head_norm(m: Matcher, value: str, head_dim: int):
    """transpose(rms_norm(y [1, T, heads, hd], w [hd]), 1, 2) -> (y, (w, eps))."""
    tr = m.node(m.through_noops(value))
    if not m.is_(tr, "aten.transpose.int") or sorted([m.arg(tr, 1), m.arg(tr, 2)]) != [1, 2]:
        return None
    norm = m.node(m.through_noops(tr.inputs[0]))
    if norm is None or norm.op != "rms_norm" or m.types[norm.inputs[1]].shape != (head_dim,):
        return None
    return norm.inputs[0], (norm.inputs[1], norm.attrs["eps"])


def _build_attention(m: Matcher, core: _Core, window: int | None) -> tuple[Node, list[Node]] | None:
    """(the node merging heads back, the nodes that replace the pattern: column-picking linears,
    per-head norms, rope, attention)."""
    qt = m.types[core.q]
    if qt.rank != 4 or not isinstance(qt.shape[1], int) or not isinstance(qt.shape[3], int):
        return None
    heads, hd = qt.shape[1], qt.shape[3]
    merged = _merge_heads_user(m, core.out)
    parts = [_heads(m, v, hd, role) for v, role in ((core.q, "q"), (_repeat_kv_source(m, core.k), "k"),
                                                     (_repeat_kv_source(m, core.v), "v"))]
    if merged is None or None in parts or parts[0].type.shape[-1] != heads * hd:
        return None
    q, k, v = parts
    kv_features = k.type.shape[-1]
    if v.type.shape[-1] != kv_features or kv_features % hd or heads % (kv_features // hd):
        return None
    g, nodes = m.g, [n for part in parts for n in part.nodes]
    attention_inputs = [_turned(g, part, name, hd, nodes) for part, name in ((q, "q"), (k, "k"))] + [v.flat]
    attrs = {"num_heads": heads, "num_kv_heads": kv_features // hd, "head_dim": hd,
             "scale": float(core.scale) if core.scale is not None else 1.0 / math.sqrt(hd),
             "causal": True, "layer": 0, **({"window": window} if window is not None else {}),
             **({"softcap": core.softcap} if core.softcap is not None else {})}
    out_type = TensorType(q.type.shape, q.type.dtype)
    nodes.append(g.make_node("attention", attention_inputs, [out_type], attrs, name=g.fresh("attention")))
    return merged, nodes


def _turned(g: Graph, part: _Heads, name: str, head_dim: int, nodes: list) -> str:
    """Append the per-head norm and rotary `part` goes through; returns the value attention reads."""
    value, t = part.flat, part.type
    if part.norm is not None:
        nodes.append(g.make_node("qk_norm", [value, part.norm[0]], [t], {"head_dim": head_dim, "eps": part.norm[1]},
                                 name=g.fresh(f"{name}_norm")))
        value = nodes[-1].outputs[0].name
    rope = part.rope
    if rope is not None:
        op, attrs = ("rope", {"head_dim": head_dim, "scaling": rope.scaling}) if rope.rotary_dim is None else (
            "partial_rope", {"head_dim": head_dim, "rotary_dim": rope.rotary_dim, "scaling": rope.scaling})
        nodes.append(g.make_node(op, [value, rope.positions, rope.inv_freq], [t], attrs, name=g.fresh(f"rope_{name}")))
        value = nodes[-1].outputs[0].name
    return value


def mask_windows(g: Graph, masks: set[tuple[str, str]], configured=()) -> dict[tuple[str, str], int | None]:
    """Of the (mask value, how it applies) pairs, those that hide exactly the future, or the future
    and all but the last `window` keys, at every probe length -> their window (None: plain causal).
    Evaluated, not pattern-matched: HF builds masks many ways. Lengths past each configured window
    are probed, so a window longer than the short probes is seen."""
    if not masks:
        return {}
    longest = [w for w in configured if w is not None]
    lengths = sorted({5, 7, 67, *(w + 1 for w in longest), *(w + 3 for w in longest)})
    observed: dict[tuple[str, str], set] = {mask: set() for mask in masks}
    values = sorted({v for v, _ in masks})
    vocab = next((p.type.shape[0] for n, p in g.params.items() if "embed" in n), 2)
    for t in lengths:
        ids = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(t))
        vals = interpret(subgraph_for(g, set(values)), {"input_ids": ids, "positions": torch.arange(t)},
                         want=values)
        for v, how in masks:
            observed[(v, how)].add((t, _band_width(vals[v], how, t)))
    return {mask: window for mask, seen in observed.items() if (window := _one_window(seen)) is not False}


def _one_window(seen: set[tuple[int, int | None]]):
    """The window all probes agree on (None: causal at every length), or False: not a causal band.
    A probe no longer than the window sees a causal mask, so only longer ones disagree."""
    if any(width is None for _, width in seen):
        return False
    windows = {width for t, width in seen if width < t}
    if len(windows) > 1:
        return False
    window = windows.pop() if windows else None
    return False if window is not None and any(width == t > window for t, width in seen) else window


def _band_width(mask: torch.Tensor, how: str, t: int) -> int | None:
    """w when every [t, t] slice of the mask shows query i seeing exactly keys i - w + 1 .. i
    (w = t for plain causal); None when it is no such band."""
    visible = _visible(mask, how, t)
    if visible is None:
        return None
    width = int(visible.sum(-1).max())
    rows = torch.arange(t)
    band = (rows[None, :] <= rows[:, None]) & (rows[None, :] > rows[:, None] - width)
    return width if width >= 1 and bool((visible == band).all()) else None


def _visible(mask: torch.Tensor, how: str, t: int) -> torch.Tensor | None:
    """[slices, t, t] True where a query sees a key, from the mask as it applies; None when the mask
    is no visible/hidden mask (a soft bias, a score not low enough to hide)."""
    try:  # every [t, t] slice of the mask (it may carry batch and head dims)
        rows = torch.broadcast_to(mask, (*mask.shape[:-2], t, t)).reshape(-1, t, t)
    except RuntimeError:
        return None
    if mask.dtype == torch.bool:
        return None if how == "add" else rows if how == "keep" else ~rows
    if how == "fill" or not mask.is_floating_point():
        return None
    visible = rows == 0
    return visible if bool((visible | (rows <= HIDDEN_SCORE)).all()) else None


# -- what lowering leaves must act on each token alone ------------------------------------
# Reductions and scans that mix tokens when a dim they act along is the token axis: where their
# dims argument sits (position, keyword); without one they act along every dim.
DIM_OPS = {**dict.fromkeys(("softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "cumsum",
                            "cumprod", "logsumexp", "sum", "mean", "amax", "amin", "max", "min", "prod", "var",
                            "std", "argmax", "argmin"), (1, "dim")),
           "flip": (1, "dims"), "roll": (2, "dims"), "linalg_vector_norm": (2, "dim")}


def refuse_unlowered(g: Graph) -> None:
    """Raise IRError naming the first fallback node the KV-cache runtime cannot serve: an op from
    another namespace than aten (a model's custom op), SDPA that lowering did not raise, or one that
    mixes tokens across the sequence (attention over a mask that is neither causal nor a sliding
    window, soft-capped scores, a scan). The runtime feeds each step only its new tokens, so such a
    node would silently see only those."""
    types = g.types()
    fallbacks = [n for n in g.nodes if n.op == "aten"]
    # name the attention itself before the mask arithmetic that feeds it
    attention_first = sorted(fallbacks, key=lambda n: not any(k in n.attrs["target"] for k in ATTENTION_HINTS))
    for n in attention_first:
        target = n.attrs["target"]
        if _namespace_refusal(target):
            raise IRError(f"node {n.name} ({target}) {_namespace_refusal(target)}; llmc cannot compile this model "
                          f"(its code calls an op llmc has no lowering or kernel for)")
        why = _token_mixing(n, target, types)
        if why:
            raise IRError(f"node {n.name} ({target}) {why}; llmc cannot compile this model (lowering raises "
                          f"softmax attention over heads split from projections, under a causal or "
                          f"sliding-window mask)")


ATTENTION_HINTS = ("scaled_dot_product", "softmax")


def _namespace_refusal(target: str) -> str | None:
    namespace = target.split(".")[0]
    return None if namespace in ("aten", "operator") else f"is an op of namespace {namespace!r}, not aten"


def _token_mixing(n: Node, target: str, types: dict[str, TensorType]) -> str | None:
    if "scaled_dot_product" in target:
        return "is attention that lowering did not raise to the attention op"
    for v in n.outputs:
        if sum(_is_token_dim(d) for d in v.type.shape) > 1:
            return f"pairs tokens with tokens (its result is {v.type}): attention that lowering did not raise"
    op = target.split(".")[1]
    x = n.inputs[0] if n.inputs else None
    if op not in DIM_OPS or x is None or types[x].dtype == "symint":
        return None
    shape = types[x].shape
    dims = Matcher.arg(n, *DIM_OPS[op])
    dims = range(len(shape)) if dims is None else dims if isinstance(dims, list) else [dims]
    if any(isinstance(d, int) and -len(shape) <= d < len(shape) and _is_token_dim(shape[d]) for d in dims):
        return f"reduces or scans along the token axis of its {types[x]} input"
    return None


def _is_token_dim(d) -> bool:
    return isinstance(d, str) and TOKENS in d


# -- batch dim ------------------------------------------------------------------------
def drop_batch_dim(g: Graph) -> bool:
    """Remove the wrapper's unsqueeze(·, 0) on inputs and select(·, 0, 0) on the output when
    every other node is an LLM op, then re-infer types token-major."""
    m = Matcher(g)
    edges = [n for n in g.nodes if n.op == "aten"]
    unsq = [n for n in edges if m.is_(n, "aten.unsqueeze.default") and m.arg(n, 1) == 0
            and n.inputs[0] in ("input_ids", "positions")]
    sel = [n for n in edges if m.is_(n, "aten.select.int") and m.arg(n, 1) == 0 and m.arg(n, 2) == 0
           and n.outputs[0].name in g.outputs]
    dropped = unsq + sel + _batch_reshapes(m, edges)
    dropped += [n for n in edges if m.is_(n, "aten.sym_size.int")
                and all(u in dropped for u in m.users.get(n.outputs[0].name, []))]
    rest = [n for n in edges if n not in dropped and not _shape_preserving(m, n)]
    if rest or not sel or any(OPS[n.op].infer is None for n in g.nodes if n.op != "aten"):
        return False
    for n in dropped:
        if n.inputs:
            g.replace_uses(n.outputs[0].name, n.inputs[0])
    g.remove_nodes(dropped)
    types = g.types()
    for n in g.nodes:
        if n.op == "aten":  # an elementwise fallback keeps its input's shape
            new = [TensorType(types[n.inputs[0]].shape, v.type.dtype) for v in n.outputs]
        else:
            new = infer_types(n, [types[i] for i in n.inputs])
        n.outputs = [type(v)(v.name, t) for v, t in zip(n.outputs, new)]
        types.update({v.name: v.type for v in n.outputs})
    return True


def _batch_reshapes(m: Matcher, edges: list[Node]) -> list[Node]:
    """Reshapes that only add or remove the unit batch dim ([1, tokens, F] <-> [tokens, F], OPT's
    MLP): without a batch dim they are identities."""
    found = []
    for n in edges:
        if m.is_(n, "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"):
            a, b = m.types[n.inputs[0]].shape, m.types[n.outputs[0].name].shape
            if a == (1,) + b or b == (1,) + a:
                found.append(n)
    return found


def _shape_preserving(m: Matcher, n: Node) -> bool:
    """A unary elementwise fallback, or arithmetic of one tensor with numbers (x * 0.5, x ** 3)."""
    if n.attrs["target"] in ELEMENTWISE_ATEN:
        return True
    return n.attrs["target"] in SCALAR_ARITHMETIC and len(n.inputs) == 1 and m.arg(n, 0) == n.inputs[0]


def rename_output(g: Graph, name: str = "logits") -> None:
    """Give the single graph output a stable name the runtime can rely on."""
    if len(g.outputs) != 1 or g.outputs[0] == name:
        return
    old = g.outputs[0]
    for n in g.nodes:
        for v in n.outputs:
            if v.name == old:
                v.name = name
    g.replace_uses(old, name)


def lower(g: Graph) -> dict[str, int]:
    """Raise patterns in place (attention before anything that would take SDPA apart);
    returns how many of each were raised."""
    stats = {"linear": raise_linear_forms(g), "column_splits": raise_column_splits(g),
             "rms_norm": raise_rms_norm(g)}  # q/k norms are per head
    stats["attention"] = raise_attention(g)
    stats["moe"] = raise_moe(g)
    stats["simple"] = raise_simple(g)
    return stats


def select_logit_rows(g: Graph) -> bool:
    """Compute the LM head only on the rows that are sampled (the last token of each
    sequence): adds input `logits_indices: int64[rows]`, as vLLM's compute_logits does."""
    prod = g.producers()
    head = prod.get(g.outputs[0]) if len(g.outputs) == 1 else None
    if head is None or head.op != "linear" or g.type_of(head.inputs[0]).rank != 2:
        return False
    g.add_input("logits_indices", TensorType(("rows",), "int64"))
    hidden = head.inputs[0]
    sel = g.make_node("select_rows", [hidden, "logits_indices"],
                      [TensorType(("rows",) + g.type_of(hidden).shape[1:], g.type_of(hidden).dtype)])
    g.insert_before(head, sel)
    head.inputs[0] = sel.out.name
    head.outputs = [type(v)(v.name, TensorType(("rows",) + v.type.shape[1:], v.type.dtype)) for v in head.outputs]
    return True


def canonical_names(g: Graph) -> None:
    """Rename nodes and values `<op>_<k>` in graph order, so printed IR reads by op and
    names do not depend on how the tracer numbered things."""
    counters: dict[str, int] = {}
    mapping: dict[str, str] = {}
    for n in g.nodes:
        kind = n.attrs["target"].split(".")[1] if n.op == "aten" else n.op
        k = counters[kind] = counters.get(kind, -1) + 1
        n.name = f"{kind}_{k}"
        for i, v in enumerate(n.outputs):
            new = n.name if i == 0 else f"{n.name}.{i}"
            mapping[v.name] = new if v.name not in g.outputs else v.name
            v.name = mapping[v.name]
    for n in g.nodes:
        n.inputs = [mapping.get(i, i) for i in n.inputs]
