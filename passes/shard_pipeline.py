"""`shard_pipeline`: GPipe-style pipeline parallelism as an IR rewrite, giving stage `stage` of `pp`
its run of consecutive decoder layers. Stage 0 keeps the embedding, the last stage the final norm
and LM head. Between two stages the residual stream is one value, found from the dataflow (the
last point between two attentions where a single value crosses); a stage ends with `send` of it to
the next stage and the next begins with `recv` of it, and the last stage sends its logits back to
rank 0, which schedules and samples. Each stage's graph holds only its own params, and its
attention layers are numbered from 0, so its KV cache holds its own layers alone.

The balanced split minimises the costliest stage, a layer costing its projections' multiply-adds per
token (in x out features) and the LM head's joining the last stage (one row per sequence: a decode
step's cost); the embedding is a lookup and costs nothing. `split` ("15,15") overrides it."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import ATTENTION_OPS
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.decoder_structure import param_count
from llmc.passes.options import PassOptions, option
from llmc.passes.quantize import param_bytes
from llmc.passes.shard_structure import PROJECTIONS
from llmc.passes.shard_weights import in_features, out_features


@dataclass
class Cut:
    """Where layer `layer` begins: graph.nodes[index:] are it and what follows; `value` is the
    residual stream entering it, the one value that crosses."""
    layer: int
    index: int
    value: str


def layer_cuts(graph: Graph, pass_name: str) -> tuple[list[Cut], list[int]]:
    """(the cut before each layer 1 .. L-1, the index of each layer's attention node)."""
    attentions = [i for i, n in enumerate(graph.nodes) if n.op in ATTENTION_OPS]
    crossing = _crossing_counts(graph)
    cuts = []
    for layer, (prev, this) in enumerate(zip(attentions, attentions[1:]), 1):
        singles = [p for p in range(prev + 1, this + 1) if crossing[p] == 1]
        if not singles:
            raise PassError(f"{pass_name}: no single hidden-state value flows from decoder layer {layer - 1} "
                            f"into layer {layer} (attention nodes {graph.nodes[prev].name}, "
                            f"{graph.nodes[this].name}); pipeline stages cut Llama-style residual streams only")
        index = singles[-1]
        cuts.append(Cut(layer, index, _crossing_value(graph, index)))
    return cuts, attentions


def _crossing_counts(graph: Graph) -> list[int]:
    """For each position p (0 .. len(nodes)), how many node values made before p are read at or after
    p (graph outputs are read at the end); graph inputs and params are on every stage."""
    made = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    last_use = {}
    for i, n in enumerate(graph.nodes):
        for name in n.inputs:
            if name in made:
                last_use[name] = i
    for name in graph.outputs:
        last_use[name] = len(graph.nodes)
    delta = [0] * (len(graph.nodes) + 2)
    for name, use in last_use.items():
        delta[made[name] + 1] += 1
        delta[use + 1] -= 1
    counts, running = [], 0
    for p in range(len(graph.nodes) + 1):
        running += delta[p]
        counts.append(running)
    return counts


def _crossing_value(graph: Graph, index: int) -> str:
    before = {v.name for n in graph.nodes[:index] for v in n.outputs}
    return next(i for n in graph.nodes[index:] for i in n.inputs if i in before)


def layer_costs(graph: Graph, cuts: list[Cut], attentions: list[int]) -> tuple[list[int], int]:
    """(multiply-adds per token of each layer's projections, of the projections after the last
    layer: the LM head)."""
    starts = [0] + [c.index for c in cuts]
    tail = max(i for i, n in enumerate(graph.nodes) if n.op in ATTENTION_OPS)
    # the head begins after the last layer's final projection (down_proj)
    after_last = [i for i, n in enumerate(graph.nodes) if n.op in PROJECTIONS and i > tail]
    head_nodes = _head_projections(graph, after_last)
    costs = [0] * len(attentions)
    for i, n in enumerate(graph.nodes):
        if n.op in PROJECTIONS and n.name not in head_nodes:
            layer = max(k for k, s in enumerate(starts) if s <= i)
            costs[layer] += in_features(graph, n) * out_features(graph, n)
    head = sum(in_features(graph, graph.nodes[i]) * out_features(graph, graph.nodes[i])
               for i in after_last if graph.nodes[i].name in head_nodes)
    return costs, head


def _head_projections(graph: Graph, after_last: list[int]) -> set[str]:
    """The projections that make graph outputs (the LM head), not the last layer's MLP."""
    producers = graph.producers()
    heads = set()
    for name in graph.outputs:
        node = producers.get(name)
        if node is not None and node.op in PROJECTIONS:
            heads.add(node.name)
    return heads & {graph.nodes[i].name for i in after_last}


def balanced_split(costs: list[int], head: int, pp: int) -> list[int]:
    """Layers per stage (each at least one) that make the costliest stage cheapest; the last
    stage also runs the head. Ties keep earlier stages longer."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least max-stage cost of layers [0, i) over s stages, with the cut used
    best = [[(inf, 0)] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = (0, 0)
    for s in range(1, pp + 1):
        for i in range(s, n + 1):
            extra = head if (s == pp and i == n) else 0
            for j in range(s - 1, i):
                cost = max(best[s - 1][j][0], prefix[i] - prefix[j] + extra)
                if cost <= best[s][i][0]:
                    best[s][i] = (cost, j)
    split, i = [], n
    for s in range(pp, 0, -1):
        j = best[s][i][1]
        split.append(i - j)
        i = j
    return split[::-1]


def parse_split(text: str, pp: int, layers: int) -> list[int]:
    try:
        split = [int(part) for part in text.split(",")]
    except ValueError:
        split = []
    if len(split) != pp or min(split, default=0) < 1 or sum(split) != layers:
        raise PassError(f"--pp-split {text}: give {pp} layer counts of at least 1 adding up to this model's "
                        f"{layers} decoder layers (e.g. {','.join(map(str, even_split(layers, pp)))})")
    return split


def even_split(layers: int, pp: int) -> list[int]:
    return [layers // pp + (s < layers % pp) for s in range(pp)]


@register_pass
class ShardPipeline(Pass):
    name = "shard_pipeline"
    description = ("pipeline parallelism: split the decoder layers into pp balanced stages (embedding on the first, "
                   "LM head on the last), with send/recv of the hidden states between them (one stage's graph)")
    stage = Stage.SHARD

    @dataclass(frozen=True)
    class Options(PassOptions):
        pp: int = option(2, "pipeline stages (ranks)", low=1)
        stage: int = option(0, "which stage's layers this run keeps (the compile driver runs one per stage)", low=0)
        split: str = option("", "layers per stage, e.g. 15,15 (empty: balanced by estimated cost)")
        tp: int = option(1, "tensor-parallel ranks per stage (--tp with --pp): rank = stage * tp + tp_rank", low=1)
        tp_rank: int = option(0, "this run's tensor-parallel rank within its stage", low=0)

        def validate(self) -> None:
            if self.stage >= self.pp:
                raise self.invalid(f"stage {self.stage} is not below pp {self.pp}")
            if self.tp_rank >= self.tp:
                raise self.invalid(f"tp_rank {self.tp_rank} is not below tp {self.tp}")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        pp, stage = self.options.pp, self.options.stage
        split = self.plan(graph)
        if pp == 1:
            return PassResult(0, False, {"pp": 1, "stage": 0, "split": split})
        cuts, _ = layer_cuts(graph, self.name)
        before = {"params": param_count(graph), "bytes": param_bytes(graph)}
        first = sum(split[:stage])
        start = cuts[first - 1].index if stage > 0 else 0
        stop = cuts[first + split[stage] - 1].index if stage < pp - 1 else len(graph.nodes)
        leaving = cuts[first + split[stage] - 1].value if stage < pp - 1 else None
        entering = cuts[first - 1].value if stage > 0 else None
        entering_type = graph.type_of(entering) if entering else None
        graph.nodes = graph.nodes[start:stop]
        tp, tp_rank = self.options.tp, self.options.tp_rank
        if entering is not None:
            self._receive(graph, entering, entering_type, peer=(stage - 1) * tp + tp_rank)
        if leaving is not None:
            graph.outputs = [self._send(graph, leaving, (stage + 1) * tp + tp_rank, "hidden")]
        elif tp_rank == 0:  # the last stage's tp ranks all hold the whole logits: one sends them to rank 0
            self._send(graph, graph.outputs[0], 0, graph.outputs[0])
        for n in graph.nodes:
            if n.op in ATTENTION_OPS:
                n.attrs["layer"] -= first
        graph.prune_params()
        graph.verify()
        details = {"pp": pp, "stage": stage, "split": split, "layers": [first, first + split[stage]],
                   "params_before": before["params"], "params_after": param_count(graph),
                   "bytes_before": before["bytes"], "bytes_after": param_bytes(graph)}
        return PassResult(split[stage], True, details)

    def plan(self, graph: Graph) -> list[int]:
        """Layers per stage: --pp-split's, or the balanced split; a pp above the layer count is refused."""
        pp = self.options.pp
        cuts, attentions = layer_cuts(graph, self.name)
        layers = len(attentions)
        if pp > layers:
            raise PassError(f"--pp {pp}: this model has {layers} decoder layers and a pipeline stage needs at "
                            f"least one; give --pp {layers} or fewer")
        if self.options.split:
            return parse_split(self.options.split, pp, layers)
        return balanced_split(*layer_costs(graph, cuts, attentions), pp)

    def _receive(self, graph: Graph, value: str, kind: TensorType, peer: int) -> None:
        if "positions" not in {v.name for v in graph.inputs}:
            raise PassError(f"{self.name}: the graph has no `positions` input to size the hidden states it "
                            f"receives; pipeline stages need the runtime's standard inputs")
        tokens = graph.type_of("positions").shape[0]
        node = graph.make_node("recv", ["positions"], [TensorType((tokens, kind.shape[-1]), kind.dtype)],
                               {"peer": peer, "hidden": kind.shape[-1], "dtype": kind.dtype})
        node.outputs[0].name = value
        graph.nodes.insert(0, node)

    def _send(self, graph: Graph, value: str, peer: int, out_name: str) -> str:
        """Append send(value) to `peer`; its output (value passed through) is named `out_name`,
        taking the name over from `value` when they are the same (the logits stay `logits`)."""
        node: Node = graph.make_node("send", [value], [graph.type_of(value)], {"peer": peer})
        if out_name == value:
            producer = graph.producers()[value]
            partial = graph.fresh(f"{value}.stage")
            for v in producer.outputs:
                if v.name == value:
                    v.name = partial
            graph.replace_uses(value, partial)
            node.inputs = [partial]
            graph.outputs = [value if o == partial else o for o in graph.outputs]
        node.outputs[0].name = graph.fresh(out_name) if out_name != value else value
        graph.nodes.append(node)
        return node.outputs[0].name


__all__ = ["ShardPipeline", "Cut", "layer_cuts", "layer_costs", "balanced_split", "parse_split", "even_split"]
