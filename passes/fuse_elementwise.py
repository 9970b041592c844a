"""Elementwise fusion: `fuse_swiglu` turns silu(gate) * up into one `swiglu` (reading the packed
output of a fused gate/up GEMM directly when there is one), and `fuse_rms_norm` turns a residual
add feeding an rms_norm into one `add_rms_norm` that also yields the sum for the next residual."""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass


def silu_times(producers: dict[str, Node], mul: Node) -> tuple[Node, str, str] | None:
    """(the silu, gate, up) when `mul` computes silu(gate) * up, in either operand order."""
    for a, b in (mul.inputs, mul.inputs[::-1]):
        silu = producers.get(a)
        if silu is not None and silu.op == "silu":
            return silu, silu.inputs[0], b
    return None


def packed_split(producers: dict[str, Node], gate: str, up: str) -> Node | None:
    """The split whose two equal halves are exactly gate then up: swiglu can read its input."""
    split = producers.get(gate)
    if split is None or split.op != "split" or [v.name for v in split.outputs] != [gate, up]:
        return None
    a, b = split.attrs["sizes"]
    return split if a == b else None


def only_used_by(users: dict[str, list[Node]], outputs: list[str], value: str, nodes: list[Node]) -> bool:
    return value not in outputs and {n.name for n in users.get(value, [])} <= {n.name for n in nodes}


@register_pass
class FuseSwiGLU(Pass):
    name = "fuse_swiglu"
    description = ("silu(gate) * up -> swiglu; reads a fused gate_up GEMM's output packed, "
                   "dropping its split")
    stage = Stage.FUSE

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        producers, users, types = graph.producers(), graph.users(), graph.types()
        dead: list[Node] = []
        made = packed = repacked = 0
        for node in list(graph.nodes):
            if node.op == "mul" and (match := silu_times(producers, node)) is not None:
                silu, gate, up = match
                if not types[gate] == types[up] == node.out.type:
                    continue        # a broadcasting mul is no SwiGLU
                swiglu = graph.make_node("swiglu", [gate, up], [node.out.type], name=graph.fresh("swiglu"))
                graph.nodes[graph.nodes.index(node)] = swiglu
                graph.replace_uses(node.out.name, swiglu.out.name)
                readers = [node]
                if only_used_by(users, graph.outputs, silu.out.name, [node]):
                    dead.append(silu)
                    readers.append(silu)
                made += 1
            elif node.op == "swiglu" and len(node.inputs) == 2:
                swiglu, readers = node, [node]
            else:
                continue
            done = self._pack(swiglu, readers, producers, users, graph.outputs, dead)
            packed += done
            repacked += done and swiglu is node
        graph.remove_nodes(dead)
        # a match is a swiglu made from silu * mul, or a two-input one now reading its packed input
        details = {"swiglu": made, "packed": packed, "repacked": repacked}
        return PassResult(made + repacked, bool(made or packed), details)

    @staticmethod
    def _pack(swiglu: Node, readers: list[Node], producers, users, outputs: list[str], dead: list[Node]) -> bool:
        """Read gate/up from the split's input when they are its two halves; the split goes when
        nothing but `readers` (the mul and silu this swiglu replaces) read its halves."""
        split = packed_split(producers, *swiglu.inputs)
        if split is None:
            return False
        gate, up = swiglu.inputs
        swiglu.inputs = [split.inputs[0]]
        if all(only_used_by(users, outputs, v, readers) for v in (gate, up)):
            dead.append(split)
        return True


@register_pass
class FuseRMSNorm(Pass):
    name = "fuse_rms_norm"
    description = ("add(x, residual) feeding an rms_norm -> add_rms_norm, whose second output "
                   "keeps the sum for the next residual add")
    stage = Stage.FUSE

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        users, types = graph.users(), graph.types()
        sources = set(graph.params) | {v.name for v in graph.inputs}
        fused = []
        for add in list(graph.nodes):
            norm = self._norm_of(add, users, types, sources)
            if norm is None:
                continue
            node = graph.make_node("add_rms_norm", add.inputs + [norm.inputs[1]], [norm.out.type, add.out.type],
                                   dict(norm.attrs), name=graph.fresh("add_rms_norm"))
            graph.nodes[graph.nodes.index(add)] = node
            types.update((v.name, v.type) for v in node.outputs)
            graph.remove_nodes([norm])
            graph.replace_uses(norm.out.name, node.outputs[0].name)
            graph.replace_uses(add.out.name, node.outputs[1].name)
            fused.append([add.name, norm.name])
        return PassResult(len(fused), bool(fused), {"fused": fused})

    @staticmethod
    def _norm_of(add: Node, users, types, sources: set[str]) -> Node | None:
        """The first rms_norm that normalises `add`'s sum, when add does not broadcast and the
        norm's weight [dim] is a param or graph input (so the fused node, at the add's place,
        can read it)."""
        if add.op != "add" or not types[add.inputs[0]] == types[add.inputs[1]] == add.out.type:
            return None
        for norm in users.get(add.out.name, []):
            if (norm.op == "rms_norm" and norm.inputs[0] == add.out.name and norm.inputs[1] in sources
                    and types[norm.inputs[1]].shape == add.out.type.shape[-1:]):
                return norm
        return None


__all__ = ["FuseSwiGLU", "FuseRMSNorm", "silu_times", "packed_split"]
