"""`quantize_fp8`: FP8 E4M3 weights with per-output-channel (or per-tensor) scales and a static
per-tensor activation scale per linear, max |x| over the calibration inputs / 448
(docs/quantization.md, scheme fp8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.quant import FP8_E4M3_MAX, quantize_fp8
from llmc.passes.activation_ranges import input_abs_max, require_calibration
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.options import PassOptions, option
from llmc.passes.quantize import WeightFormat, quant_param_names, quantize_linears, select_linears


@register_pass
class QuantizeFp8(Pass):
    name = "quantize_fp8"
    description = ("fp8 e4m3 weights (per-channel scales, per_channel=false: one per tensor) and static "
                   "per-tensor activation scales from calibration")
    stage = Stage.QUANTIZE
    lossy = True
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        per_channel: bool = option(True, "one weight scale per output channel (false: one per tensor)")
        include_lm_head: bool = option(False, "quantise the LM head too")
        skip: list[str] = option([], "names of linears (or their weights) to keep in float")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        require_calibration(ctx, self.name)
        per_channel = self.options.per_channel
        nodes, skipped = select_linears(graph, self.options.include_lm_head, self.options.skip)
        act_scales = activation_scales(nodes, input_abs_max(graph, ctx, nodes, self.name))
        for weight, a in act_scales.items():
            # quantize_linear_weights wires a present `<weight>.act_scale` into the qlinear
            graph.add_param(quant_param_names(weight)["act_scale"], TensorType((1,), "float32"), a)

        def method(w: torch.Tensor, ctx: PassContext, node: Node) -> tuple:
            return (*quantize_fp8(w, per_channel), None)
        result = quantize_linears(self, graph, ctx, WeightFormat("fp8", "fp8", 8), nodes, skipped, method)
        figures = result.details["quant"]["fp8"]
        figures["weight_scales"] = "per_channel" if per_channel else "per_tensor"
        figures["act_scale_range"] = ([min(a.item() for a in act_scales.values()),
                                       max(a.item() for a in act_scales.values())] if act_scales else [])
        return result


def activation_scales(nodes: list[Node], ranges: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{weight: a fp32 [1]} with a = max |x| / 448 over the inputs of the linears reading it, so
    the largest calibration activation lands on e4m3's largest finite value."""
    scales: dict[str, torch.Tensor] = {}
    for node in nodes:
        a = ranges[node.inputs[0]].max().reshape(1) / FP8_E4M3_MAX
        weight = node.inputs[1]
        scales[weight] = torch.maximum(scales[weight], a) if weight in scales else a
    # an input that stayed 0 on calibration text: any positive scale represents it exactly
    return {w: torch.where(a > 0, a, torch.ones_like(a)).float() for w, a in scales.items()}


__all__ = ["QuantizeFp8", "activation_scales"]
