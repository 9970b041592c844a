"""`prune_ffn`: structured pruning of MLP channels. Channel j of an MLP (row j of gate and up,
column j of down) is scored Wanda-style by the down projection weights it feeds and the size of
its activation on calibration text, score_j = ‖X_j‖₂ · Σ_i |W_down[i, j]| (Sun et al., 2023,
"A Simple and Effective Pruning Approach for LLMs", summed over the weights one channel owns), and
the same fraction of the lowest-scoring channels is cut from every layer, so layers stay equal
(the kept count rounded to a multiple of `multiple_of`, 8 by default)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.calibration_stats import channel_norms
from llmc.passes.decoder_structure import MLPBlock, mlp_blocks, retype, set_weight, size_report, sizes
from llmc.passes.options import PassOptions, option


def channel_scores(down_weight: torch.Tensor, input_norms: torch.Tensor) -> torch.Tensor:
    """score_j = ‖X_j‖₂ · Σ_i |W_down[i, j]| for down_weight [hidden, channels], float64 [channels]."""
    return input_norms.double() * down_weight.double().abs().sum(0)


def kept_channel_count(n: int, fraction: float, multiple_of: int) -> int:
    """(1 - fraction) * n rounded to a multiple of `multiple_of` (1 when n is not one), so the
    shrunk GEMMs keep the alignment that vector units, tensor cores and 2:4 sparsity want."""
    step = multiple_of if multiple_of > 0 and n % multiple_of == 0 else 1
    keep = round((1.0 - fraction) * n / step) * step
    if not 0 < keep < n:
        raise PassError(f"prune_ffn: fraction {fraction:g} of {n} channels per layer (kept in multiples of "
                        f"{step}) leaves {keep}; choose a fraction that removes some channels but not all")
    return keep


def channels_to_keep(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Ascending indices of the `keep` highest-scoring channels (ties cut the lower index first)."""
    return torch.sort(torch.sort(scores, stable=True).indices[scores.numel() - keep:]).values


def cut_channels(graph: Graph, block: MLPBlock, keep: torch.Tensor) -> None:
    for up in block.up:
        for name in up.inputs[1:]:
            set_weight(graph, name, graph.weights[name].index_select(0, keep))
    down = block.down.inputs[1]
    set_weight(graph, down, graph.weights[down].index_select(1, keep))


@register_pass
class PruneFFN(Pass):
    name = "prune_ffn"
    description = "remove the MLP channels with the lowest Wanda score ‖X_j‖·Σ|W_down[:, j]| on calibration text"
    stage = Stage.PRUNE
    lossy = True
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        fraction: float = option(0.25, "fraction of each MLP's channels to remove", low=0.0, high=1.0, strict=True)
        multiple_of: int = option(8, "keep a channel count that is a multiple of this", low=1)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        fraction = self.options.fraction
        blocks = mlp_blocks(graph, self.name)
        if not blocks:
            raise PassError("prune_ffn: found no MLP (a down projection fed by linears through "
                            "elementwise ops) to prune")
        before = sizes(graph)
        norms = channel_norms(graph, ctx, {b.down.inputs[0] for b in blocks}, self.name)
        channels_before = [b.channels for b in blocks]
        for b in blocks:
            scores = channel_scores(graph.weights[b.down.inputs[1]], norms[b.down.inputs[0]])
            keep = kept_channel_count(b.channels, fraction, self.options.multiple_of)
            cut_channels(graph, b, channels_to_keep(scores, keep))
        retype(graph, self.name)
        details = {"channels_before": channels_before, "channels_after": [b.channels for b in blocks],
                   **size_report(before, graph)}
        removed = sum(channels_before) - sum(details["channels_after"])
        return PassResult(removed, True, details, bytes_saved=details["bytes_removed"])


__all__ = ["PruneFFN", "channel_scores", "channels_to_keep", "kept_channel_count"]
