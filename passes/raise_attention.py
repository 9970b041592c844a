"""`raise_attention`: attention still in aten form when the pipeline runs (an SDPA node, or
matmul -> scale -> causal mask -> softmax -> matmul, with or without repeat_kv) becomes the
`attention` op. The matcher is lowering's (compiler/lower.py), and lowering already runs it on
every traced model: it has to, since the batch dim can only be dropped once no aten op is left
and the mask's add must be matched before it is raised on its own. So after lowering this pass
finds nothing; it serves graphs that reach a pipeline without lowering."""

from __future__ import annotations

from llmc.compiler.ir import Graph
from llmc.compiler.lower import raise_attention
from llmc.passes.base import Pass, PassContext, PassResult, register_pass
from llmc.passes.cleanup import DeadCodeElimination


@register_pass
class RaiseAttention(Pass):
    name = "raise_attention"
    description = "aten attention (SDPA, or matmul/softmax/matmul with a causal mask) -> the attention op"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        raised = raise_attention(graph)
        if not raised:
            return PassResult(0, False, {"attention": 0})
        # the replaced matmuls, softmax and mask computation are dead now
        removed = DeadCodeElimination().run(graph, ctx).matches
        return PassResult(raised, True, {"attention": raised, "aten_nodes_removed": removed})


__all__ = ["RaiseAttention"]
