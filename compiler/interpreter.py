"""The reference interpreter: runs an IR graph op by op with each op's reference
semantics. It is the correctness oracle for lowering, passes and codegen, and the way
calibration observes activations (`hook`)."""

from __future__ import annotations

from typing import Callable

import torch

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import run_reference

# hook(node, input_values, output_values) is called after each node runs.
Hook = Callable[[Node, list, list], None]


def interpret(graph: Graph, inputs: dict[str, torch.Tensor], want: list[str] | None = None,
              weights: dict[str, torch.Tensor] | None = None, hook: Hook | None = None) -> dict[str, torch.Tensor]:
    """Evaluate `graph` on `inputs`; returns the graph outputs, or the values named in `want`."""
    # weights are read as nodes need them: a store's lazy weights are made for their readers alone
    params = weights if weights is not None else graph.weights
    env: dict[str, object] = dict(inputs)
    with torch.no_grad():
        for node in graph.nodes:
            args = [env[i] if i in env else params[i] for i in node.inputs]
            outs = run_reference(node, args)
            for value, out in zip(node.outputs, outs):
                env[value.name] = out
            if hook is not None:
                hook(node, args, outs)
    return {name: env[name] if name in env else params[name] for name in (want or graph.outputs)}
