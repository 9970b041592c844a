"""Where a decoder's parts sit in the IR, found from the dataflow rather than from param names:
each attention node with the q/k/v/o linears around it, each MLP (a down projection fed through
elementwise ops by the linears that make its channels), and each decoder layer as the span of the
residual stream between the value entering it and the value leaving it. Also the bookkeeping
that structural pruning shares: resizing params, re-typing the graph, counting params and KV bytes."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch

from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import OPS, infer_types
from llmc.compiler.schemes import kv_head_bytes
from llmc.errors import PassError
from llmc.passes.quantize import param_bytes

# Ops between a q/k projection and the attention that keep its [tokens, heads * head_dim] layout
# (each acts on every head alike, by its head_dim attr).
HEAD_PRESERVING = {"rope", "partial_rope", "qk_norm"}


@dataclass
class AttentionBlock:
    """One attention node and its projections: q/k/v are the linears whose outputs (through
    rope, for q and k) feed it; o is the linear reading its output."""
    attention: Node
    q: Node
    k: Node
    v: Node
    o: Node

    @property
    def num_heads(self) -> int:
        return self.attention.attrs["num_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.attention.attrs["num_kv_heads"]

    @property
    def head_dim(self) -> int:
        return self.attention.attrs["head_dim"]

    @property
    def group_size(self) -> int:
        """Query heads per KV head: q head h reads KV head h // group_size."""
        return self.num_heads // self.num_kv_heads


@dataclass
class MLPBlock:
    """A down projection and the linears that make its input channels (`up`: gate and up of a
    gated MLP, joined by elementwise ops such as silu and mul)."""
    down: Node
    up: list[Node]

    @property
    def channels(self) -> int:
        return self.up[0].out.type.shape[-1]


@dataclass
class DecoderLayer:
    """The residual stream value entering a layer and the value leaving it, and its attention."""
    attention: Node
    input: str
    output: str


# -- attention ---------------------------------------------------------------------------------
def attention_blocks(graph: Graph, pass_name: str) -> list[AttentionBlock]:
    """Every attention node with its projections, in graph order; a layout this cannot read
    (fused or quantised projections, ops other than rope in between) is a PassError."""
    producers, users = graph.producers(), graph.users()
    blocks = []
    for node in graph.nodes:
        if node.op != "attention":
            continue
        q, k, v = (projection(graph, node, value, role, producers, users, pass_name)
                   for role, value in zip("qkv", node.inputs))
        readers = users.get(node.out.name, [])
        if len(readers) != 1 or readers[0].op != "linear" or readers[0].inputs[0] != node.out.name:
            raise PassError(f"{pass_name}: attention node {node.name}'s output is read by "
                            f"{[r.name for r in readers]}, not by one output-projection linear; "
                            f"this pass handles Llama-style attention blocks only")
        o = check_float_linear(graph, readers[0], pass_name)
        blocks.append(AttentionBlock(node, q, k, v, o))
    return blocks


def projection(graph: Graph, attention: Node, value: str, role: str, producers: dict,
               users: dict, pass_name: str) -> Node:
    """The linear projecting `value`, one of the attention's q/k/v inputs, through
    head-preserving nodes; each value on the way must feed only the next node."""
    between = []
    node = producers.get(value)
    while node is not None and node.op in HEAD_PRESERVING:
        between.append(node)
        node = producers.get(node.inputs[0])
    if node is None or node.op != "linear":
        found = "a graph input" if node is None else f"{node.op} node {node.name}"
        raise PassError(f"{pass_name}: attention node {attention.name}'s {role} input comes from {found}, "
                        f"not from a linear (through rope); run this pass before fusion or quantisation")
    for n in [node] + between:
        if len(users.get(n.out.name, [])) != 1:
            raise PassError(f"{pass_name}: {n.op} node {n.name} on attention {attention.name}'s {role} path "
                            f"has other readers ({[u.name for u in users[n.out.name]]}); its heads cannot be cut")
    return check_float_linear(graph, node, pass_name)


def check_float_linear(graph: Graph, node: Node, pass_name: str) -> Node:
    """`node` if it is a linear over stored float params that no other node reads."""
    users = graph.users()
    for name in node.inputs[1:]:
        param = graph.params.get(name)
        if param is None or param.quant is not None or name not in graph.weights:
            raise PassError(f"{pass_name}: linear {node.name} reads {name!r}, not a stored float weight; "
                            f"run pruning before quantisation")
        if len(users.get(name, [])) != 1:
            raise PassError(f"{pass_name}: param {name!r} of linear {node.name} is shared with "
                            f"{[u.name for u in users[name] if u is not node]}; a shared weight cannot be cut")
    return node


# -- MLP ---------------------------------------------------------------------------------------
def mlp_blocks(graph: Graph, pass_name: str) -> list[MLPBlock]:
    """Every linear whose input is made, through elementwise ops alone, by other linears over
    the same channels (gate/up -> silu, mul -> down), in graph order."""
    producers, users = graph.producers(), graph.users()
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    blocks = []
    for node in graph.nodes:
        block = mlp_feeding(node, producers, users) if node.op == "linear" else None
        if block is not None:
            block.up.sort(key=lambda n: index[n.name])
            for linear in [node] + block.up:
                check_float_linear(graph, linear, pass_name)
            blocks.append(block)
    return blocks


def mlp_feeding(down: Node, producers: dict, users: dict) -> MLPBlock | None:
    """The MLP whose down projection is `down`, or None when its input is not such a block."""
    first = producers.get(down.inputs[0])
    if first is None or not OPS[first.op].elementwise:
        return None
    ups, inside, stack = [], {down.name}, [first]
    while stack:
        node = stack.pop()
        if node.name in inside:
            continue
        inside.add(node.name)
        if node.op == "linear":
            ups.append(node)
            continue
        if node.op not in OPS or not OPS[node.op].elementwise:
            return None
        for value in node.inputs:
            if value not in producers:  # a param or graph input mixed into the channels
                return None
            stack.append(producers[value])
    # every channel value must feed only the block: nothing else may see the cut channels
    if any(u.name not in inside for n in inside - {down.name} for u in users.get(n, [])):
        return None
    return MLPBlock(down, ups)


# -- decoder layers ------------------------------------------------------------------------------
def decoder_layers(graph: Graph, pass_name: str) -> list[DecoderLayer]:
    """Each attention node's decoder layer along the residual stream. It starts at the value r
    that the first residual add after the attention, add(r, f(r)), adds the attention branch
    to; it ends where the next layer starts or, for the last layer, where the chain of residual
    adds add(v, g(v)) that follows ends."""
    dag = dataflow(graph)
    attentions = [n for n in graph.nodes if n.op == "attention"]
    found = [residual_add(dag, a, pass_name) for a in attentions]
    layers = []
    for i, (attention, (add, residual)) in enumerate(zip(attentions, found)):
        nxt = found[i + 1][1] if i + 1 < len(found) else None
        output = residual_end(dag, add.out.name, nxt)
        if nxt is not None and output != nxt:
            raise PassError(f"{pass_name}: the residual stream leaving attention {attention.name}'s layer "
                            f"({output}) does not enter the next layer ({nxt}); cannot find the decoder layers")
        layers.append(DecoderLayer(attention, residual, output))
    return layers


def dataflow(graph: Graph) -> nx.DiGraph:
    """graph.to_networkx() with each node's position and a value's producer and readers."""
    dag = graph.to_networkx()
    for i, node in enumerate(graph.nodes):
        dag.nodes[node.name].update(index=i, node=node)
    dag.graph["producer"] = {v.name: n.name for n in graph.nodes for v in n.outputs}
    dag.graph["users"] = graph.users()
    return dag


def residual_add(dag: nx.DiGraph, attention: Node, pass_name: str) -> tuple[Node, str]:
    """(the first add after `attention` of a value computed from it and a value r the
    attention is itself computed from, r): the attention's residual add and its layer input."""
    branch = nx.descendants(dag, attention.name) | {attention.name}
    before = nx.ancestors(dag, attention.name)
    producer = dag.graph["producer"]
    readers = {u.name: u for name in branch for v in dag.nodes[name]["node"].outputs
               for u in dag.graph["users"].get(v.name, []) if u.op == "add"}
    adds = sorted(readers.values(), key=lambda n: dag.nodes[n.name]["index"])
    for add in adds:
        outside = [v for v in add.inputs if producer.get(v) not in branch]
        if len(outside) == 1 and producer.get(outside[0]) in before:
            return add, outside[0]
    raise PassError(f"{pass_name}: no residual add follows attention node {attention.name}; "
                    f"cannot find its decoder layer")


def residual_end(dag: nx.DiGraph, value: str, stop: str | None) -> str:
    """Follow residual adds add(v, g(v)) from `value` until `stop`, or until none reads v."""
    producer = dag.graph["producer"]
    while value != stop:
        below = nx.descendants(dag, producer[value])
        step = next((u for u in dag.graph["users"].get(value, []) if u.op == "add" and
                     any(x != value and producer.get(x) in below for x in u.inputs)), None)
        if step is None:
            return value
        value = step.out.name
    return value


# -- shapes and sizes ------------------------------------------------------------------------------
def set_weight(graph: Graph, name: str, tensor: torch.Tensor) -> None:
    """Store a resized weight and give its param the new shape."""
    graph.weights[name] = tensor.contiguous()
    param = graph.params[name]
    param.type = TensorType(tuple(tensor.shape), param.type.dtype)


def retype(graph: Graph, pass_name: str) -> None:
    """Recompute every node's output types from its inputs after params changed shape; a node
    with no type rule (an aten fallback) reading a changed value is a PassError."""
    old = graph.types()
    types = {v.name: v.type for v in graph.inputs} | {p.name: p.type for p in graph.params.values()}
    for node in graph.nodes:
        expected = infer_types(node, [types[i] for i in node.inputs])
        if expected is None:
            if any(types[i] != old[i] for i in node.inputs if i not in graph.params):
                raise PassError(f"{pass_name}: aten node {node.name} reads a value this pass resized, "
                                f"and llmc cannot re-derive its output shape; this model cannot be pruned so")
            expected = [v.type for v in node.outputs]
        for value, t in zip(node.outputs, expected):
            value.type = t
            types[value.name] = t


def param_count(graph: Graph) -> int:
    return sum(p.type.numel() for p in graph.params.values())


def kv_bytes_per_token(graph: Graph) -> int:
    """Bytes one token's keys and values take in the cache across all attention layers."""
    total = 0
    for node in graph.nodes:
        if node.op == "attention":
            dtype = node.attrs.get("kv_cache") or graph.type_of(node.inputs[1]).dtype
            total += 2 * node.attrs["num_kv_heads"] * kv_head_bytes(dtype, node.attrs["head_dim"])
    return total


def size_report(before: dict, graph: Graph) -> dict:
    """Params, bytes and KV bytes per token before (from `sizes(graph)` taken earlier) and now."""
    after = sizes(graph)
    return {"params_before": before["params"], "params_after": after["params"],
            "params_removed": before["params"] - after["params"],
            "bytes_removed": before["bytes"] - after["bytes"],
            "kv_bytes_per_token_before": before["kv"], "kv_bytes_per_token_after": after["kv"]}


def sizes(graph: Graph) -> dict:
    return {"params": param_count(graph), "bytes": param_bytes(graph), "kv": kv_bytes_per_token(graph)}


__all__ = ["AttentionBlock", "MLPBlock", "DecoderLayer", "attention_blocks", "mlp_blocks", "decoder_layers",
           "dataflow", "set_weight", "retype", "param_count", "kv_bytes_per_token",
           "size_report", "sizes", "check_float_linear"]
