"""Projection fusion: `fuse_qkv` and `fuse_gate_up` turn the projections of one input that feed
one attention (q, k, v) or one SwiGLU (gate, up) into a single GEMM over their weights
concatenated along N, followed by a `split` of its columns, so a layer reads its input once and
launches one GEMM instead of three (two). Float linears fuse, and so do qlinears whose stored
params concatenate exactly (docs/quantization.md): codes, per-channel scales and zero points
all run along N, so the fused GEMM computes every column as its own projection did."""

from __future__ import annotations

from dataclasses import replace

import torch

from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import ATTENTION_OPS, DTYPE_NAMES, TORCH_DTYPES, qlinear_inputs
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.quantize import param_bytes, quant_param_names

PROJECTIONS = ("linear", "qlinear")
FP8_ACT_SCALES_DIFFER = ("fp8 activation scales differ (each projection quantises its input with its own "
                         "static scale, which one GEMM cannot share exactly)")


# -- finding the projections, by the ops their outputs feed ------------------------------------
def projection_of(producers: dict[str, Node], value: str, through: tuple[str, ...] = ()) -> Node | None:
    """The linear/qlinear producing `value`, looking through one op of `through` (rope)."""
    node = producers.get(value)
    if node is not None and node.op in through:
        node = producers.get(node.inputs[0])
    return node if node is not None and node.op in PROJECTIONS else None


def qkv_candidates(graph: Graph) -> list[list[Node | None]]:
    """[q, k, v] projections of each attention: q and k arrive through their rope (or straight
    into a flash_attention that rotates them itself), v directly."""
    producers = graph.producers()
    return [[projection_of(producers, value, ("rope",)) for value in node.inputs[:3]]
            for node in graph.nodes if node.op in ATTENTION_OPS]


def gate_up_candidates(graph: Graph) -> list[list[Node | None]]:
    """[gate, up] of each silu(gate) * up (either operand order) and of each two-input swiglu."""
    producers = graph.producers()
    found = []
    for node in graph.nodes:
        if node.op == "swiglu" and len(node.inputs) == 2:
            found.append([projection_of(producers, value) for value in node.inputs])
        elif node.op == "mul":
            for a, b in (node.inputs, node.inputs[::-1]):
                silu = producers.get(a)
                if silu is not None and silu.op == "silu":
                    found.append([projection_of(producers, silu.inputs[0]), projection_of(producers, b)])
                    break
    return found


# -- when a group fuses exactly -----------------------------------------------------------------
def fusion_blocker(graph: Graph, nodes: list[Node]) -> str | None:
    """Why these projections cannot become one exact GEMM, or None when they can."""
    first = nodes[0]
    if len({n.name for n in nodes}) < len(nodes):
        return "one projection fills two roles"
    if any(n.op != first.op or n.inputs[0] != first.inputs[0] for n in nodes):
        return "projections differ in op or read different inputs"
    params = [name for n in nodes for name in n.inputs[1:]]
    if not all(name in graph.params and name in graph.weights for name in params):
        return "a weight is not a stored param"
    if any(graph.params[name].shard for name in params):
        return "a weight is sharded"
    return linear_blocker(graph, nodes) if first.op == "linear" else qlinear_blocker(graph, nodes)


def linear_blocker(graph: Graph, nodes: list[Node]) -> str | None:
    if any(n.attrs != nodes[0].attrs for n in nodes) or nodes[0].attrs.get("packed"):
        return "linear attrs differ or name a packed weight"
    weights = [graph.params[n.inputs[1]].type for n in nodes]
    if any(w.rank != 2 or w.dtype != weights[0].dtype or w.shape[1] != weights[0].shape[1] for w in weights):
        return "weights differ in dtype or in_features"
    return bias_blocker(graph, [n.inputs[2] if len(n.inputs) > 2 else None for n in nodes])


def bias_blocker(graph: Graph, biases: list[str | None]) -> str | None:
    dtypes = {graph.params[b].type.dtype for b in biases if b is not None}
    return "biases differ in dtype" if len(dtypes) > 1 else None


def qlinear_blocker(graph: Graph, nodes: list[Node]) -> str | None:
    """Same scheme, group size, K and storage; fp8 activation scales must be equal."""
    if any(without_n(n.attrs) != without_n(nodes[0].attrs) for n in nodes):
        return "qlinear schemes, group sizes or in_features differ"
    parts = [qlinear_inputs(n.inputs, n.attrs) for n in nodes]
    schemes = [graph.params[p.qweight].quant for p in parts]
    if None in schemes or any(replace(s, scales="", zeros="") != replace(schemes[0], scales="", zeros="")
                              for s in schemes):
        return "quantisation schemes of the weights differ"
    for field in ("scales", "zeros"):
        types = [graph.params[getattr(p, field)].type for p in parts if getattr(p, field) is not None]
        if len({(t.dtype, t.shape[1:]) for t in types}) > 1:
            return f"{field} differ in dtype or layout"
    acts = [graph.weights[p.act_scale] for p in parts if p.act_scale is not None]
    if any(not torch.equal(a, acts[0]) for a in acts):
        return FP8_ACT_SCALES_DIFFER
    return bias_blocker(graph, [p.bias for p in parts])


def without_n(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items() if k not in ("out_features", "has_bias")}


# -- building the fused GEMM ----------------------------------------------------------------------
def fused_param_base(graph: Graph, nodes: list[Node], kind: str) -> str:
    """`<common dotted prefix of the weights>.<kind>_proj` (model.layers.0.self_attn.qkv_proj),
    numbered when a param of that name exists."""
    common = []
    for pieces in zip(*(n.inputs[1].split(".")[:-1] for n in nodes)):
        if len(set(pieces)) > 1:
            break
        common.append(pieces[0])
    stem = ".".join(common + [f"{kind}_proj"])
    base, index = stem, 1
    while any(p == base or p.startswith(base + ".") for p in graph.params):
        index += 1
        base = f"{stem}_{index}"
    return base


def add_concat_param(graph: Graph, name: str, tensors: list[torch.Tensor], quant=None) -> str:
    t = torch.cat(tensors, dim=0).contiguous()
    graph.add_param(name, TensorType(tuple(t.shape), DTYPE_NAMES[t.dtype]), t, quant=quant)
    return name


def add_concat_params(graph: Graph, name: str, parts: list[str], rows: list[int] | None = None, quant=None) -> str:
    """Param `name`: the params `parts` concatenated along dim 0 (with `rows`, a per-tensor scale
    made per channel first), made lazily where a part's values are not made yet."""
    types = [graph.params[p].type for p in parts]
    lengths = rows if rows is not None else [t.shape[0] for t in types]
    shape = (sum(lengths), *types[0].shape[1:])
    widen = (lambda values: [per_channel(v, n) for v, n in zip(values, rows)]) if rows else (lambda values: values)
    entry = graph.weights.derive(parts, lambda values: torch.cat(widen(values), dim=0).contiguous(), shape,
                                 TORCH_DTYPES[types[0].dtype])
    graph.add_param(name, TensorType(shape, types[0].dtype), entry, quant=quant)
    return name


def concat_bias(graph: Graph, name: str, biases: list[str | None], sizes: list[int]) -> list[str]:
    """The fused bias (zeros for projections without one, an exact no-op), or none at all."""
    present = [graph.weights[b] for b in biases if b is not None]
    if not present:
        return []
    tensors = [graph.weights[b] if b is not None else present[0].new_zeros(n) for b, n in zip(biases, sizes)]
    return [add_concat_param(graph, name, tensors)]


def concat_linear(graph: Graph, nodes: list[Node], base: str, sizes: list[int]) -> tuple[list[str], dict]:
    weight = add_concat_params(graph, f"{base}.weight", [n.inputs[1] for n in nodes])
    biases = [n.inputs[2] if len(n.inputs) > 2 else None for n in nodes]
    return [weight] + concat_bias(graph, f"{base}.bias", biases, sizes), dict(nodes[0].attrs)


def per_channel(scales: torch.Tensor, n: int) -> torch.Tensor:
    """A per-tensor scale [1] as n equal per-channel scales: w = q * s is the same for every row."""
    return scales.reshape(1).expand(n) if scales.dim() == 1 and scales.numel() == 1 else scales


def concat_qlinear(graph: Graph, nodes: list[Node], base: str, sizes: list[int]) -> tuple[list[str], dict]:
    parts = [qlinear_inputs(n.inputs, n.attrs) for n in nodes]
    names = quant_param_names(f"{base}.weight")
    first = parts[0]
    quant = replace(graph.params[first.qweight].quant, scales=names["scales"],
                    zeros=names["zeros"] if first.zeros else "")
    inputs = [add_concat_params(graph, names["qweight"], [p.qweight for p in parts], quant=quant),
              add_concat_params(graph, names["scales"], [p.scales for p in parts], rows=sizes)]
    if first.zeros:
        inputs.append(add_concat_params(graph, names["zeros"], [p.zeros for p in parts]))
    if first.act_scale:
        # equal in every part (qlinear_blocker), so one copy serves the fused GEMM
        graph.add_param(names["act_scale"], graph.params[first.act_scale].type, graph.weights[first.act_scale])
        inputs.append(names["act_scale"])
    bias = concat_bias(graph, f"{base}.bias", [p.bias for p in parts], sizes)
    return inputs + bias, {**nodes[0].attrs, "out_features": sum(sizes), "has_bias": bool(bias)}


def has_per_tensor_scales(graph: Graph, nodes: list[Node]) -> bool:
    return any(n.op == "qlinear" and graph.params[qlinear_inputs(n.inputs, n.attrs).scales].type.shape == (1,)
               and n.attrs["out_features"] > 1 for n in nodes)


def fuse_group(graph: Graph, nodes: list[Node], kind: str) -> str:
    """Replace `nodes` by one GEMM and a split of its output, in their column order; returns the
    fused params' name stem."""
    base = fused_param_base(graph, nodes, kind)
    sizes = [n.out.type.shape[-1] for n in nodes]
    concat = concat_linear if nodes[0].op == "linear" else concat_qlinear
    params, attrs = concat(graph, nodes, base, sizes)
    t = nodes[0].out.type
    anchor = min(nodes, key=graph.nodes.index)
    fused = graph.insert_before(anchor, graph.make_node(
        nodes[0].op, [nodes[0].inputs[0]] + params, [TensorType(t.shape[:-1] + (sum(sizes),), t.dtype)], attrs,
        name=graph.fresh(f"{kind}_proj")))
    split = graph.insert_before(anchor, graph.make_node(
        "split", [fused.out.name], [n.out.type for n in nodes], {"sizes": sizes}, name=graph.fresh(f"{kind}_split")))
    for node, value in zip(nodes, split.outputs):
        graph.replace_uses(node.out.name, value.name)
    graph.remove_nodes(nodes)
    return base


class FuseProjections(Pass):
    stage = Stage.FUSE
    """Fuse each candidate group `candidates(graph)` finds; report the ones that cannot fuse."""
    kind = ""

    def candidates(self, graph: Graph) -> list[list[Node | None]]:
        raise NotImplementedError

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        bytes_before = param_bytes(graph)
        fused, skipped, taken, per_tensor = {}, {}, set(), 0
        for nodes in self.candidates(graph):
            if None in nodes or taken & {n.name for n in nodes}:
                continue
            reason = fusion_blocker(graph, nodes)
            if reason is not None:
                skipped.setdefault(reason, []).append([n.name for n in nodes])
                continue
            per_tensor += has_per_tensor_scales(graph, nodes)
            taken |= {n.name for n in nodes}
            fused[fuse_group(graph, nodes, self.kind)] = [n.name for n in nodes]
        graph.prune_params()
        details = {"fused": fused, "skipped": skipped, "per_tensor_scales_made_per_channel": per_tensor}
        return PassResult(len(fused), bool(fused), details, bytes_saved=bytes_before - param_bytes(graph))


@register_pass
class FuseQKV(FuseProjections):
    name = "fuse_qkv"
    description = ("q/k/v projections of one input feeding one attention -> one linear/qlinear over "
                   "the concatenated weights [Nq+Nk+Nv, K] and a split")
    kind = "qkv"

    def candidates(self, graph: Graph) -> list[list[Node | None]]:
        return qkv_candidates(graph)


@register_pass
class FuseGateUp(FuseProjections):
    name = "fuse_gate_up"
    description = ("gate/up projections of one input feeding silu(gate) * up -> one linear/qlinear over "
                   "the concatenated weights [2I, K] and a split")
    kind = "gate_up"

    def candidates(self, graph: Graph) -> list[list[Node | None]]:
        return gate_up_candidates(graph)


__all__ = ["FuseQKV", "FuseGateUp", "FuseProjections", "fusion_blocker", "qkv_candidates",
           "gate_up_candidates", "FP8_ACT_SCALES_DIFFER"]
