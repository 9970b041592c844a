"""Where tensor parallelism cuts a decoder, found from the dataflow: the column-parallel projections
that make an attention's q/k/v (through rope) or an MLP's channels (through elementwise ops), the
row-parallel projection that reads them back into the residual stream (o_proj, down_proj), and the
LM head that makes the logits. Projections are `linear` or `qlinear` nodes."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import ATTENTION_OPS, OPS
from llmc.errors import PassError

PROJECTIONS = ("linear", "qlinear")
# Ops between a q/k projection and the attention that keep its [tokens, heads * head_dim] layout.
HEAD_PRESERVING = ("rope",)


@dataclass
class ParallelPair:
    """Column projections whose outputs feed, through `between`, one row projection; `attention`
    is the attention node between them (None for an MLP)."""
    columns: list[Node]
    row: Node
    attention: Node | None = None


def attention_pairs(graph: Graph, pass_name: str) -> list[ParallelPair]:
    """Each attention node with its q, k, v projections (columns, in that order) and o_proj (row)."""
    producers, users = graph.producers(), graph.users()
    pairs = []
    for node in graph.nodes:
        if node.op not in ATTENTION_OPS:
            continue
        columns = [_head_projection(node, value, role, producers, users, pass_name)
                   for role, value in zip("qkv", node.inputs[:3])]
        readers = users.get(node.out.name, [])
        if len(readers) != 1 or readers[0].op not in PROJECTIONS or readers[0].inputs[0] != node.out.name:
            raise PassError(f"{pass_name}: attention node {node.name}'s output is read by "
                            f"{[r.name for r in readers]}, not by one output projection; tensor parallelism "
                            f"handles Llama-style attention blocks only")
        pairs.append(ParallelPair(columns, readers[0], node))
    return pairs


def _head_projection(attention: Node, value: str, role: str, producers: dict, users: dict, pass_name: str) -> Node:
    node = producers.get(value)
    while node is not None and node.op in HEAD_PRESERVING:
        node = producers.get(node.inputs[0])
    if node is None or node.op not in PROJECTIONS:
        found = "a graph input" if node is None else f"{node.op} node {node.name}"
        raise PassError(f"{pass_name}: attention node {attention.name}'s {role} input comes from {found}, not "
                        f"from its own projection (through rope); fused or unusual projections are not "
                        f"sharded: run the shard pass before fusion")
    if len(users.get(node.out.name, [])) != 1:
        raise PassError(f"{pass_name}: projection {node.name} ({role} of attention {attention.name}) has other "
                        f"readers; its heads cannot be split across ranks")
    return node


def mlp_pairs(graph: Graph) -> list[ParallelPair]:
    """Each projection whose input channels are made, through elementwise ops alone, by other
    projections (gate/up -> silu, mul -> down) that nothing else reads."""
    producers, users = graph.producers(), graph.users()
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    pairs = []
    for node in graph.nodes:
        if node.op in PROJECTIONS:
            columns = _channel_projections(node, producers, users)
            if columns:
                pairs.append(ParallelPair(sorted(columns, key=lambda n: index[n.name]), node))
    return pairs


def _channel_projections(row: Node, producers: dict, users: dict) -> list[Node]:
    first = producers.get(row.inputs[0])
    if first is None or not OPS[first.op].elementwise:
        return []
    columns, inside, stack = {}, {row.name}, [first]
    while stack:
        node = stack.pop()
        if node.name in inside:
            continue
        inside.add(node.name)
        if node.op in PROJECTIONS:
            columns[node.name] = node
        elif OPS[node.op].elementwise and all(v in producers for v in node.inputs):
            stack += [producers[v] for v in node.inputs]
        else:
            return []
    # each channel value feeds only the block: no other node may read a rank's partial channels
    if any(u.name not in inside for name in inside - {row.name} for u in users.get(name, [])):
        return []
    return list(columns.values())


def token_embedding(graph: Graph) -> Node | None:
    """The float embedding lookup of the graph's input ids (None: none, or a quantised one)."""
    return next((n for n in graph.nodes if n.op == "embedding" and n.inputs[0] == "input_ids"
                 and n.inputs[1] in graph.weights), None)


def lm_head(graph: Graph) -> Node | None:
    """The projection that makes the graph's (first) output, the logits."""
    node = graph.producers().get(graph.outputs[0]) if graph.outputs else None
    return node if node is not None and node.op in PROJECTIONS else None


__all__ = ["PROJECTIONS", "ParallelPair", "attention_pairs", "mlp_pairs", "token_embedding", "lm_head"]
