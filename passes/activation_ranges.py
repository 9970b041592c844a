"""Per-input-channel max |x| of linears' inputs over the calibration sequences: the activation
ranges that fp8's static activation scales and SmoothQuant's smoothing factors come from."""

from __future__ import annotations

import torch

from llmc.compiler.ir import Graph, Node
from llmc.errors import PassError
from llmc.passes.base import PassContext
from llmc.passes.quantize_calibrated import observe_linear_inputs


class ChannelAbsMax:
    """Running max |x| per input channel of the x [tokens, K] it is shown."""

    def __init__(self, in_features: int):
        self.amax = torch.zeros(in_features, dtype=torch.float32)

    def add(self, x: torch.Tensor) -> None:
        self.amax = torch.maximum(self.amax, x.detach().abs().amax(dim=0).float())


def require_calibration(ctx: PassContext, pass_name: str) -> None:
    if ctx.calibration is None or len(ctx.calibration) == 0:
        raise PassError(f"pass {pass_name!r} computes its scales from calibration activations, and the "
                        f"pipeline gave none; compile with calibration: `llmc compile` supplies it for "
                        f"lossy pipelines (--calib FILE, else text the model generates itself), or set "
                        f"PassContext.calibration to a list of 1-D token tensors")


def input_abs_max(graph: Graph, ctx: PassContext, nodes: list[Node], pass_name: str) -> dict[str, torch.Tensor]:
    """{input value of `nodes`: max |x| per channel, fp32 [K]} over every calibration token."""
    require_calibration(ctx, pass_name)
    observers = observe_linear_inputs(graph, ctx, nodes, pass_name, ChannelAbsMax)
    return {x: observer.amax for x, observer in observers.items()}


__all__ = ["ChannelAbsMax", "require_calibration", "input_abs_max"]
