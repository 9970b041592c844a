"""`prune_layers`: remove whole decoder layers. Each layer's block influence on calibration text
is BI = 1 − mean over tokens of cos(h_in, h_out), h_in and h_out the residual stream entering
and leaving it (Men et al., 2024, "ShortGPT"); the `count` least influential layers are cut in
one shot by joining the stream around them, and the remaining attention layers are renumbered
0..n-1 so the KV cache, which is indexed by layer, stays dense."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmc.compiler.ir import Graph
from llmc.compiler.lower import number_layers
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.calibration_stats import observe
from llmc.passes.cleanup import DeadCodeElimination
from llmc.passes.decoder_structure import DecoderLayer, decoder_layers, size_report, sizes
from llmc.passes.options import PassOptions, option


def block_influence(graph: Graph, ctx: PassContext, layers: list[DecoderLayer], pass_name: str) -> list[float]:
    """1 − mean cos(h_in, h_out) per layer over every calibration token (float64)."""
    values = {v for layer in layers for v in (layer.input, layer.output)}
    cos_sum, tokens = torch.zeros(len(layers), dtype=torch.float64), 0

    def add(seen):
        nonlocal tokens
        for i, layer in enumerate(layers):
            h_in, h_out = (seen[v].reshape(-1, seen[v].shape[-1]).double() for v in (layer.input, layer.output))
            cos_sum[i] += F.cosine_similarity(h_in, h_out, dim=-1).sum()
        tokens += seen[layers[0].input].reshape(-1, seen[layers[0].input].shape[-1]).shape[0]
    observe(graph, ctx, values, pass_name, add)
    return (1.0 - cos_sum / tokens).tolist()


def least_influential(influence: list[float], count: int) -> list[int]:
    """Indices of the `count` lowest block influences, ascending (ties to the lower index)."""
    return sorted(sorted(range(len(influence)), key=lambda i: (influence[i], i))[:count])


def remove_layers(graph: Graph, layers: list[DecoderLayer], doomed: list[int], ctx: PassContext) -> None:
    """Route each doomed layer's readers to its input, drop what no longer feeds the outputs,
    and renumber the attention layers densely in graph order."""
    for i in sorted(doomed, reverse=True):  # later layers first: a removed layer's input may be the next one's output
        graph.replace_uses(layers[i].output, layers[i].input)
    DeadCodeElimination().run(graph, ctx)
    number_layers(graph)


@register_pass
class PruneLayers(Pass):
    name = "prune_layers"
    description = "remove the decoder layers with the lowest block influence 1 − cos(h_in, h_out) on calibration text"
    stage = Stage.PRUNE
    lossy = True
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        count: int = option(1, "decoder layers to remove (at least 1, fewer than the model has)")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        count = self.options.count
        layers = decoder_layers(graph, self.name)
        if not 1 <= count < len(layers):
            raise PassError(f"prune_layers: count={count} must be at least 1 and below the model's "
                            f"{len(layers)} decoder layers")
        before = sizes(graph)
        influence = block_influence(graph, ctx, layers, self.name)
        doomed = least_influential(influence, count)
        remove_layers(graph, layers, doomed, ctx)
        details = {"layers_before": len(layers), "layers_after": len(layers) - count, "removed_layers": doomed,
                   "block_influence": [round(b, 6) for b in influence], **size_report(before, graph)}
        return PassResult(count, True, details, bytes_saved=details["bytes_removed"])


__all__ = ["PruneLayers", "block_influence", "least_influential", "remove_layers"]
