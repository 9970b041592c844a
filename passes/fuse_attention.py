"""`fuse_attention`: each `attention` op becomes one `flash_attention` op, taking in the `rope`
ops that rotate its q and k when both rotate by the same positions, inv_freq and scaling and
feed nothing else: the fused kernel rotates q and k in its prologue, so the rotated copies never
go through memory. Where q, k and v come from (linears, a fused QKV's split) does not matter."""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass


def shared_rope(attn: Node, producers: dict[str, Node], users: dict[str, list[Node]]):
    """The (q rope, k rope) nodes to fold into `attn`, or None when they cannot be."""
    q_rope, k_rope = producers.get(attn.inputs[0]), producers.get(attn.inputs[1])
    if q_rope is None or k_rope is None or q_rope is k_rope or {q_rope.op, k_rope.op} != {"rope"}:
        return None
    if q_rope.inputs[1:] != k_rope.inputs[1:]:
        return None
    if {q_rope.attrs["head_dim"], k_rope.attrs["head_dim"]} != {attn.attrs["head_dim"]}:
        return None
    if q_rope.attrs.get("scaling", 1.0) != k_rope.attrs.get("scaling", 1.0):
        return None
    # a rotated q/k read elsewhere too must stay computed; then the attention fuses without it
    if any(users.get(r.out.name) != [attn] for r in (q_rope, k_rope)):
        return None
    return q_rope, k_rope


def flash_node(attn: Node, ropes: tuple[Node, Node] | None) -> Node:
    """The flash_attention node standing in `attn`'s place (same name and output value)."""
    attrs = {"window": None, **attn.attrs, "rope": None}
    inputs = list(attn.inputs)
    if ropes is not None:
        q_rope, k_rope = ropes
        inputs = [q_rope.inputs[0], k_rope.inputs[0], attn.inputs[2], *q_rope.inputs[1:3]]
        attrs["rope"] = {"scaling": float(q_rope.attrs.get("scaling", 1.0))}
    return Node(attn.name, "flash_attention", inputs, attn.outputs, attrs)


@register_pass
class FuseAttention(Pass):
    name = "fuse_attention"
    description = "attention (and the rope on its q and k) -> one flash_attention op"
    stage = Stage.FUSE

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        producers, users = graph.producers(), graph.users()
        fused, absorbed = 0, []
        for i, node in enumerate(graph.nodes):
            if node.op != "attention":
                continue
            ropes = shared_rope(node, producers, users)
            graph.nodes[i] = flash_node(node, ropes)
            absorbed += list(ropes or ())
            fused += 1
        graph.remove_nodes(absorbed)
        return PassResult(fused, fused > 0, {"flash_attention": fused, "rope_folded": len(absorbed)})


__all__ = ["FuseAttention", "flash_node", "shared_rope"]
