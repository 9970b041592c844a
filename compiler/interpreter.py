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
    """Evaluate `graph` on `inputs`; returns the graph outputs, or the values named in `want`.
    Weights are read as nodes need them (a store's lazy weights are made for their readers alone)
    and values are dropped after their last reader: interpret_many with one input set."""
    return interpret_many(graph, [inputs], want, weights, hook)[0]


def interpret_many(graph: Graph, inputs: list[dict[str, torch.Tensor]], want: list[str] | None = None,
                   weights=None, hook: Hook | None = None,
                   progress: Callable[[int], None] | None = None) -> list[dict[str, torch.Tensor]]:
    """`interpret` over several input sets (calibration sequences) node by node: each weight is
    read once per node for all of them, not once per sequence (a lazily stored weight is made
    from its source file once per pass over the model), and a value is dropped after its last
    reader, so the memory held is one node's weights plus the live activations of every set.
    Per input set the arithmetic and the hook's calls are those of `interpret`, in the same order.
    progress(n) is told of each n nodes run."""
    params = weights if weights is not None else graph.weights
    wanted = list(want or graph.outputs)
    run = SequentialRun(graph, [dict(i) for i in inputs], params, keep=set(wanted), progress=progress)
    envs = run.run_until(len(graph.nodes), hook)
    return [{name: env[name] if name in env else params[name] for name in wanted} for env in envs]


class SequentialRun:
    """Input sets run through the graph a stretch of nodes at a time, node-major (see
    interpret_many), so a caller can act between stretches: GPTQ quantises the linears of a
    layer before the calibration text reaches the next one. `weights` (name -> tensor) is read
    when a node runs, so the caller's changes to it count for the nodes not yet run."""

    def __init__(self, graph: Graph, envs: list[dict[str, torch.Tensor]], weights, keep: set[str] = frozenset(),
                 progress: Callable[[int], None] | None = None):
        self.graph, self.envs, self.weights, self.done, self.progress = graph, envs, weights, 0, progress
        self.last_use = {name: i for i, node in enumerate(graph.nodes) for name in node.inputs}
        self.last_use.update({name: len(graph.nodes) for name in (*graph.outputs, *keep)})

    def run_until(self, stop: int, hook: Hook | None = None) -> list[dict[str, torch.Tensor]]:
        """Run nodes [done, stop) on every input set; returns each set's live values."""
        with torch.no_grad():
            for i in range(self.done, stop):
                self._run_node(i, hook)
                if self.progress is not None:
                    self.progress(1)
        self.done = max(self.done, stop)
        return self.envs

    def _run_node(self, i: int, hook: Hook | None) -> None:
        node = self.graph.nodes[i]
        read = {x: self.weights[x] for x in node.inputs if x not in self.envs[0]} if self.envs else {}
        for env in self.envs:
            args = [env[x] if x in env else read[x] for x in node.inputs]
            outs = run_reference(node, args)
            for value, out in zip(node.outputs, outs):
                env[value.name] = out
            if hook is not None:
                hook(node, args, outs)
            for name in node.inputs:
                if self.last_use.get(name) == i:
                    env.pop(name, None)
