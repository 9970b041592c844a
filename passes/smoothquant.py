"""SmoothQuant (Xiao et al. 2022, arXiv:2211.10438): `smoothquant` migrates activation outliers
into the weights with per-input-channel factors s_j = max|X_j|^alpha / max|W_j|^(1-alpha), folding
1/s into the feeding rms_norm's weight and s into the linears; `quantize_w8a8` then stores those
linears as int8 per-channel weights with per-token dynamic int8 activations (scheme w8a8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph, Node
from llmc.errors import PassError
from llmc.passes.activation_ranges import input_abs_max, require_calibration
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.options import PassOptions, option
from llmc.passes.quantize import WeightFormat, quantize_linears, rtn_int8, select_linears
from llmc.passes.quantize_calibrated import own_weight, scale_weight

# The linear attr smoothquant sets, by which quantize_w8a8 finds the linears it smoothed.
SMOOTHED = "smoothed"
NOT_SMOOTHED = "not smoothed by smoothquant (quantize_w8a8.all_linears=true quantises it)"


def smoothing_factors(x_abs_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [K] for linears sharing an input: max|X_j|^alpha / max|W_j|^(1-alpha), max|W_j| over all
    their rows. A channel never seen active (or with all-zero weights) keeps s = 1."""
    x = x_abs_max.double()
    w = torch.cat([w.double() for w in weights]).abs().amax(dim=0)
    s = x.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1 - alpha)
    return torch.where((x > 0) & (w > 0), s, torch.ones_like(s)).float()


def norm_fed_groups(graph: Graph, nodes: list[Node]) -> tuple[dict[str, list[Node]], dict[str, list[str]]]:
    """({rms_norm output: the chosen linears reading it}, {reason: weights left unsmoothed}).
    A group is smoothable when the norm's output feeds only chosen linears and each of its
    weights is read by its linear alone (folding changes nothing else)."""
    users, producers = graph.users(), graph.producers()
    chosen = {n.name for n in nodes}
    by_input: dict[str, list[Node]] = {}
    for node in nodes:
        by_input.setdefault(node.inputs[0], []).append(node)
    groups: dict[str, list[Node]] = {}
    left: dict[str, list[str]] = {}
    for x, group in by_input.items():
        norm = producers.get(x)
        if norm is None or norm.op != "rms_norm":
            reason = "input is not an rms_norm output"
        elif x in graph.outputs or any(u.name not in chosen for u in users.get(x, [])):
            reason = "rms_norm output also feeds other ops"
        elif any(len(users.get(n.inputs[1], [])) != 1 for n in group):
            reason = "weight is shared with another op"
        else:
            groups[x] = group
            continue
        left.setdefault(reason, []).extend(n.inputs[1] for n in group)
    return groups, left


def smooth_group(graph: Graph, x: str, group: list[Node], s: torch.Tensor) -> bool:
    """rms_norm(h, w / s) · (W · s)ᵀ == rms_norm(h, w) · Wᵀ; False when the norm's weight is shared.
    The weights are rescaled as they are read (lazily where the source is still in its file)."""
    norm = graph.producers()[x]
    if norm.op != "rms_norm" or not own_weight(graph, norm.inputs[1], graph.users()):
        return False
    scale_weight(graph, norm.inputs[1], lambda w: w / s)
    for node in group:
        scale_weight(graph, node.inputs[1], lambda w: w * s[None, :])
        node.attrs[SMOOTHED] = True
    return True


@register_pass
class SmoothQuant(Pass):
    name = "smoothquant"
    description = ("SmoothQuant: per-channel factors from calibration activations, folded into the rms_norm "
                   "weights and the linears they feed (q/k/v share one, gate/up share one)")
    stage = Stage.QUANTIZE
    lossy = True
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        alpha: float = option(0.5, "migration strength: 0.5 for most models, up to 0.75-0.85 for ones with "
                                   "large activation outliers", low=0.0, high=1.0)
        include_lm_head: bool = option(False, "smooth the LM head too")
        skip: list[str] = option([], "names of linears (or their weights) to leave alone")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        alpha = self.options.alpha
        require_calibration(ctx, self.name)
        nodes, _ = select_linears(graph, self.options.include_lm_head, self.options.skip)
        groups, left = norm_fed_groups(graph, nodes)
        ranges = input_abs_max(graph, ctx, [n for g in groups.values() for n in g], self.name)
        factors, smoothed = [], 0
        for x, group in groups.items():
            s = smoothing_factors(ranges[x], [graph.weights[n.inputs[1]] for n in group], alpha)
            if smooth_group(graph, x, group, s):
                factors.append(s)
                smoothed += len(group)
            else:
                left.setdefault("rms_norm weight is shared", []).extend(n.inputs[1] for n in group)
        details = {"alpha": alpha, "groups": len(factors), "linears": smoothed, "not_smoothed": left,
                   "factor_range": [min(s.min().item() for s in factors), max(s.max().item() for s in factors)]
                   if factors else []}
        return PassResult(len(factors), bool(factors), details)


@register_pass
class QuantizeW8A8(Pass):
    name = "quantize_w8a8"
    description = ("w8a8: int8 per-channel weights, int8 per-token activations at run time, for the linears "
                   "smoothquant smoothed (all_linears=true: every linear)")
    stage = Stage.QUANTIZE
    lossy = True
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        all_linears: bool = option(False, "quantise every linear, not only those smoothquant smoothed")
        include_lm_head: bool = option(False, "quantise the LM head too")
        skip: list[str] = option([], "names of linears (or their weights) to keep in float")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        every = self.options.all_linears

        def check(node: Node) -> str | None:
            return None if every or node.attrs.get(SMOOTHED) else NOT_SMOOTHED
        nodes, skipped = select_linears(graph, self.options.include_lm_head, self.options.skip, check)
        if not nodes and NOT_SMOOTHED in skipped:
            raise PassError(f"pass {self.name!r} found no linear smoothed by smoothquant; run smoothquant "
                            f"before it (--quant w8a8 does) or set quantize_w8a8.all_linears=true")
        fmt = WeightFormat("w8a8", "smoothquant", 8)
        return quantize_linears(self, graph, ctx, fmt, nodes, skipped, rtn_int8)


__all__ = ["SmoothQuant", "QuantizeW8A8", "smoothing_factors", "norm_fed_groups", "smooth_group"]
