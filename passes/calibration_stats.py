"""Activation statistics the pruning passes score with: chosen values of the graph observed on
each calibration sequence through the reference interpreter, reduced to per-channel L2 norms
(Wanda's ‖X_j‖) or Gram matrices XᵀX, accumulated in float64."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch

from llmc.compiler.interpreter import SequentialRun, interpret
from llmc.compiler.ir import Graph
from llmc.errors import PassError
from llmc.passes.base import PassContext


def calibration_tokens(ctx: PassContext, pass_name: str) -> list[torch.Tensor]:
    """ctx.calibration as 1-D int64 token tensors; none is a PassError naming the pass."""
    calib = ctx.calibration
    if calib is None or len(calib) == 0:
        raise PassError(f"pass {pass_name!r} needs calibration text (it scores weights on activations), and "
                        f"the pipeline gave none; compile through `llmc compile` (--calib FILE, else text the "
                        f"model generates itself) or set PassContext.calibration to a list of 1-D token tensors")
    return [torch.as_tensor(seq, dtype=torch.long).reshape(-1) for seq in calib]


def prefill_inputs(graph: Graph, ids: torch.Tensor, pass_name: str) -> dict[str, torch.Tensor]:
    """One whole-sequence prefill: the tokens, positions 0..t-1, and the last row's logits."""
    known = {"input_ids": ids, "positions": torch.arange(ids.numel()),
             "logits_indices": torch.tensor([ids.numel() - 1])}
    missing = [v.name for v in graph.inputs if v.name not in known]
    if missing:
        raise PassError(f"pass {pass_name!r} cannot feed graph input(s) {missing} of graph {graph.name} "
                        f"with calibration text; it knows {sorted(known)}")
    return {v.name: known[v.name] for v in graph.inputs}


def observe(graph: Graph, ctx: PassContext, values: set[str], pass_name: str,
            on_sequence: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Run every calibration sequence; after each, on_sequence({value: tensor}) gets the
    `values` (node outputs) it produced. (A sequence at a time: its values may span every
    layer, and the pruning passes that observe them compare layers.)"""
    for ids in calibration_tokens(ctx, pass_name):
        seen: dict[str, torch.Tensor] = {}

        def hook(node, args, outs):
            for value, out in zip(node.outputs, outs):
                if value.name in values:
                    seen[value.name] = out
        interpret(graph, prefill_inputs(graph, ids, pass_name), hook=hook)
        on_sequence(seen)


class StagedRun(SequentialRun):
    """Every calibration sequence run through the graph a stretch of nodes at a time, so that a
    pass can change weights between stretches (GPTQ quantises layer by layer: each linear's
    inputs come from the already-quantised linears before it). Each sequence keeps only its
    live values; `weights` (name -> tensor) is read when a node runs, so later changes count."""

    def __init__(self, graph: Graph, ctx: PassContext, pass_name: str, weights: Mapping[str, torch.Tensor],
                 progress=None):
        envs = [prefill_inputs(graph, ids, pass_name) for ids in calibration_tokens(ctx, pass_name)]
        super().__init__(graph, envs, weights, progress=progress)


def channel_norms(graph: Graph, ctx: PassContext, values: set[str], pass_name: str) -> dict[str, torch.Tensor]:
    """{value: ‖X_j‖₂ over every calibration token, float64 [features]} for x [tokens, features]."""
    sums: dict[str, torch.Tensor] = {}

    def add(seen):
        for name, x in seen.items():
            sq = x.reshape(-1, x.shape[-1]).double().pow(2).sum(0)
            sums[name] = sums[name] + sq if name in sums else sq
    observe(graph, ctx, values, pass_name, add)
    return {name: s.sqrt() for name, s in sums.items()}


def gram_matrices(graph: Graph, ctx: PassContext, values: set[str], pass_name: str) -> dict[str, torch.Tensor]:
    """{value: XᵀX summed over every calibration token, float64 [features, features]}."""
    grams: dict[str, torch.Tensor] = {}

    def add(seen):
        for name, x in seen.items():
            x2 = x.reshape(-1, x.shape[-1]).double()
            grams[name] = grams[name] + x2.T @ x2 if name in grams else x2.T @ x2
    observe(graph, ctx, values, pass_name, add)
    return grams


__all__ = ["calibration_tokens", "prefill_inputs", "observe", "StagedRun", "channel_norms", "gram_matrices"]
