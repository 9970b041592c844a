"""The reference interpreter: runs an IR graph op by op with each op's reference
semantics. It is the correctness oracle for lowering, passes and codegen."""

from __future__ import annotations

import torch

from llmc.compiler.ir import Graph
from llmc.compiler.ops import run_reference


def interpret(graph: Graph, inputs: dict[str, torch.Tensor], want: list[str] | None = None,
              weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Evaluate `graph` on `inputs`; returns the graph outputs, or the values named in `want`."""
    env: dict[str, object] = dict(weights if weights is not None else graph.weights)
    env.update(inputs)
    with torch.no_grad():
        for node in graph.nodes:
            outs = run_reference(node, [env[i] for i in node.inputs])
            for value, out in zip(node.outputs, outs):
                env[value.name] = out
    return {name: env[name] for name in (want or graph.outputs)}
