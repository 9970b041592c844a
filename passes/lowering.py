"""Lowering's own steps as passes (stage `lower`, run first in every compile and not to be
disabled): raise aten patterns into LLM ops, drop the unit batch dim, compute the LM head only
on sampled rows, and give values stable names. The pattern matching lives in compiler/lower.py."""

from __future__ import annotations

from llmc.compiler.ir import Graph
from llmc.compiler.lower import (
    canonical_names,
    drop_batch_dim,
    lower,
    refuse_unlowered,
    rename_output,
    select_logit_rows,
)
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass


class LoweringStep(Pass):
    stage = Stage.LOWER
    required = True


def done_once(done: bool, key: str) -> PassResult:
    """The result of a step that rewrites the graph once or not at all."""
    return PassResult(int(done), done, {key: done})


@register_pass
class RaiseToLLMOps(LoweringStep):
    name = "lower"
    description = "raise aten patterns (attention, rms_norm, rope, linear, ...) into LLM-level ops"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        stats = lower(graph)
        return PassResult(sum(stats.values()), any(stats.values()), stats)


@register_pass
class RefuseUnlowered(LoweringStep):
    """After cleanup, so the mask arithmetic of raised attention is gone and what remains runs."""
    name = "refuse_unlowered"
    description = "fail the compile on a fallback the KV-cache runtime cannot serve (token-mixing or non-aten op)"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        refuse_unlowered(graph)
        return PassResult(0, False, {})


@register_pass
class DropBatchDim(LoweringStep):
    name = "drop_batch_dim"
    description = "drop the unit batch dim the tracing wrapper adds, making activations token-major"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        return done_once(drop_batch_dim(graph), "batch_dim_dropped")


@register_pass
class SelectLogitRows(LoweringStep):
    name = "select_logit_rows"
    description = "compute the LM head only on the rows that are sampled (input logits_indices)"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        return done_once(select_logit_rows(graph), "logit_rows_selected")


@register_pass
class NameValues(LoweringStep):
    name = "canonical_names"
    description = "name the output `logits` and every node and value `<op>_<k>` in graph order"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        rename_output(graph)
        canonical_names(graph)
        return PassResult(len(graph.nodes), True, {})


# The lowering stage, in order: cleanup between raising and the batch-dim drop, which needs
# the wrapper's aliases and asserts gone; the refusal looks at what cleanup leaves alive.
LOWERING = ["lower", "remove_noops", "dce", "refuse_unlowered", "drop_batch_dim", "select_logit_rows",
            "canonical_names"]

__all__ = ["LOWERING", "RaiseToLLMOps", "RefuseUnlowered", "DropBatchDim", "SelectLogitRows", "NameValues"]
