"""The calibrated int4 methods of `quantize_int4`: observe each chosen linear's inputs on the
calibration sequences with the reference interpreter, then quantise by GPTQ (passes/gptq.py,
from each input's Hessian) or AWQ (passes/awq.py, activation-aware channel scales whose
inverse is folded into the op that produces the linear's input)."""

from __future__ import annotations

import importlib
from collections import ChainMap
from typing import Callable

import torch

from llmc.compiler.interpreter import interpret_many
from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import TORCH_DTYPES
from llmc.compiler.quant import dequantize_int4_codes, pack_int4, unpack_int4
from llmc.compiler.weight_store import LazyTensor, WeightStore
from llmc.errors import PassError
from llmc.passes.base import PassContext
from llmc.passes.calibration_stats import StagedRun, calibration_tokens, prefill_inputs

# AWQ searches scales on a sample of each input's rows; this bounds its memory.
AWQ_SAMPLE_ROWS = 512


def observe_linear_inputs(graph: Graph, ctx: PassContext, nodes: list[Node], method: str,
                          make_observer: Callable[[int], object]) -> dict[str, object]:
    """Stream every calibration sequence through the graph; each distinct input value of
    `nodes` gets one observer (make_observer(in_features)) whose add(x) sees x [tokens, K]."""
    inputs = {n.name: n.inputs[0] for n in nodes}
    observers = {x: make_observer(graph.type_of(x).shape[-1]) for x in inputs.values()}

    def hook(node, args, outs):
        if node.name in inputs:
            x = args[0]
            observers[inputs[node.name]].add(x.reshape(-1, x.shape[-1]))
    where = f"quantize_int4 method={method}"
    envs = [prefill_inputs(graph, ids, where) for ids in calibration_tokens(ctx, where)]
    with ctx.calibration_walk(method, graph) as bar:
        interpret_many(graph, envs, hook=hook, progress=bar.update)
    return observers


def import_method(module: str, names: list[str], method: str) -> list:
    """`names` from llmc.passes.<module>, imported only when the method is asked for."""
    try:
        mod = importlib.import_module(f"llmc.passes.{module}")
    except ModuleNotFoundError as e:
        if e.name != f"llmc.passes.{module}":
            raise
        raise PassError(f"quantize_int4 method={method} is not built yet (no llmc.passes.{module}); "
                        f"use --quant int4-rtn") from None
    return [getattr(mod, name) for name in names]


# -- GPTQ -------------------------------------------------------------------------------------
class StoredCodes:
    """The int4 weights a calibrated method made ahead of the quantise loop, packed two codes a
    byte so a model's worth of them takes half its int4 storage per weight, not a byte."""

    def __init__(self):
        self._parts: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __contains__(self, weight: str) -> bool:
        return weight in self._parts

    def put(self, weight: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        self._parts[weight] = (pack_int4(codes), scales, zeros)

    def get(self, weight: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        packed, scales, zeros = self._parts[weight]
        return unpack_int4(packed), scales, zeros

    def dequantized(self, weight: str, dtype: torch.dtype) -> LazyTensor:
        """The weight as its codes give it back, made when read (GPTQ's later layers run on it)."""
        packed, scales, _ = self._parts[weight]
        shape = (packed.shape[0], packed.shape[1] * 2)
        return LazyTensor(shape, dtype, lambda: dequantize_int4_codes(*self.get(weight)).to(dtype))

    # the quantise loop calls the codes' maker with the float weight, which these codes no longer need
    reads_weight = False

    def __call__(self, weight: None, ctx: PassContext, node: Node):
        """The node's codes, handed over once: the graph keeps them as its params from here on."""
        parts = self.get(node.inputs[1])
        del self._parts[node.inputs[1]]
        return parts


def gptq_method(graph: Graph, ctx: PassContext, nodes: list[Node], group_of: Callable[[Node], int],
                *, act_order: bool, damp: float, clip: bool):
    """GPTQ layer by layer, as in the paper: the linears are taken in graph order, grouped by
    the input they share (q/k/v, gate/up), and each group's Hessian comes from the calibration
    text run up to it with every earlier linear already quantised, so later layers see (and
    compensate for) the error the earlier ones made. One forward pass in all, node by node:
    memory holds one group's weights and Hessian, the live activations and the codes made so far
    (each source weight is read when the walk reaches it). On SmolLM2-135M (int4, group 128)
    Hessians of the float model's activations, gathered in one run, gave a held-out perplexity
    above RTN's."""
    accumulator, quantize = import_method("gptq", ["HessianAccumulator", "gptq_quantize_weight"], "gptq")
    stored, dequantized = StoredCodes(), WeightStore()
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    with ctx.calibration_walk("gptq", graph) as bar:
        run = StagedRun(graph, ctx, "quantize_int4 method=gptq", ChainMap(dequantized, graph.weights), bar.update)
        for x, group in linears_by_input(nodes, position).items():
            todo = [n for n in group if n.inputs[1] not in stored]
            if not todo:
                continue
            hessian = accumulator(graph.type_of(x).shape[-1])
            for env in run.run_until(min(position[id(n)] for n in group)):
                hessian.add(env[x].reshape(-1, env[x].shape[-1]))
            weights = [graph.weights[n.inputs[1]] for n in todo]
            # GPTQ treats rows independently: the linears sharing this Hessian go in one call
            parts = quantize(torch.cat([w.float() for w in weights]), hessian.hessian(), group_size=group_of(todo[0]),
                             act_order=act_order, damp=damp, tokens=hessian.tokens, clip=clip)
            rows = [w.shape[0] for w in weights]
            for n, w, c, s, z in zip(todo, weights, *(p.split(rows) for p in parts)):
                stored.put(n.inputs[1], c, s, z)
                dequantized[n.inputs[1]] = stored.dequantized(n.inputs[1], w.dtype)
    return stored


def linears_by_input(nodes: list[Node], position: dict[int, int]) -> dict[str, list[Node]]:
    """{input value: the linears reading it}, in the graph order of each input's first reader."""
    groups: dict[str, list[Node]] = {}
    for node in sorted(nodes, key=lambda n: position[id(n)]):
        groups.setdefault(node.inputs[0], []).append(node)
    return groups


# -- AWQ --------------------------------------------------------------------------------------
class ActivationStats:
    """Mean |x| per input channel and an evenly spread sample of rows, for AWQ's search."""

    def __init__(self, in_features: int, max_rows: int = AWQ_SAMPLE_ROWS, sequences: int = 1):
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.tokens = 0
        self.rows: list[torch.Tensor] = []
        self.rows_per_add = max(1, -(-max_rows // sequences))

    def add(self, x: torch.Tensor) -> None:
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        self.tokens += x.shape[0]
        pick = torch.linspace(0, x.shape[0] - 1, min(self.rows_per_add, x.shape[0])).round().long()
        self.rows.append(x[pick].float())

    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).float()

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


def awq_method(graph: Graph, ctx: PassContext, nodes: list[Node], group_of: Callable[[Node], int]):
    """AWQ: per group of linears sharing an input, one channel scale s searched on calibration
    activations; the weights are quantised as W·s and the input divided by s, folded into an
    rms_norm weight or a linear's output rows where the graph allows, else by an inserted mul.

    Layer by layer: the float model's calibration activations flow node by node and each group
    is searched as soon as the walk reaches it (its statistics then dropped); a linear is
    quantised once no later group can fold its scale into it (the up projection waits for the
    down projection's search), so memory holds a layer's weights and samples, not the model's.
    The folds are applied after the walk, which ran on the unscaled graph throughout."""
    search, quantize = import_method("awq", ["awq_search_shared", "awq_quantize_with_scales"], "awq")
    with ctx.calibration_walk("awq", graph) as bar:
        run = StagedRun(graph, ctx, "quantize_int4 method=awq", graph.weights, bar.update)
        scales, stored = awq_walk(graph, run, nodes, group_of, search, quantize)
    for x, group in linears_by_input(nodes, {id(n): i for i, n in enumerate(graph.nodes)}).items():
        fold_input_scale(graph, x, group, scales[x])
    return stored


def awq_walk(graph: Graph, run: StagedRun, nodes: list[Node], group_of, search, quantize):
    """({input: its searched scale}, the codes of every linear), from one walk of the float graph."""
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    groups = linears_by_input(nodes, position)
    folded_by = {lin.name: x for x, group in groups.items()
                 if (lin := gated_fold_target(graph, x, group)) is not None}
    scales: dict[str, torch.Tensor] = {}
    pending: dict[str, tuple[Node, torch.Tensor]] = {}   # linear -> (node, its group's sample)
    stored = StoredCodes()

    def quantize_ready() -> None:
        for name in [n for n in pending if folded_by.get(n) is None or folded_by[n] in scales]:
            node, sample = pending.pop(name)
            w = graph.weights[node.inputs[1]]
            if name in folded_by:     # the fold into this linear, applied as the graph will have it
                w = (w.float() / scales[folded_by[name]][:, None]).to(w.dtype)
            stored.put(node.inputs[1], *quantize(w.float(), scales[node.inputs[0]], sample,
                                                 group_size=group_of(node)))
    for x, group in groups.items():
        stats = ActivationStats(graph.type_of(x).shape[-1], sequences=len(run.envs))
        for env in run.run_until(min(position[id(n)] for n in group)):
            stats.add(env[x].reshape(-1, env[x].shape[-1]))
        weights = [graph.weights[n.inputs[1]].float() for n in group]
        # linears sharing an input share K, hence their group size
        scales[x] = search(weights, stats.mean_abs(), stats.sample(), group_size=group_of(group[0]))
        del weights
        pending.update({n.name: (n, stats.sample()) for n in group})
        quantize_ready()
    assert not pending, f"awq left {sorted(pending)} unquantised"
    return scales, stored


def fold_input_scale(graph: Graph, x: str, group: list[Node], s: torch.Tensor) -> str:
    """Make the linears of `group` read x / s instead of x; returns how ("rms_norm",
    "linear" or "mul")."""
    how, target = fold_site(graph, x, group)
    if how == "rms_norm":
        scale_weight(graph, target.inputs[1], lambda w: w / s)
    elif how == "linear":     # mul(a, linear(h, W, b)) / s == mul(a, linear(h, W / s[:, None], b / s))
        scale_weight(graph, target.inputs[1], lambda w: w / s[:, None])
        if len(target.inputs) > 2:
            scale_weight(graph, target.inputs[2], lambda b: b / s)
    else:
        insert_scale_mul(graph, x, group, s)
    return how


def fold_site(graph: Graph, x: str, group: list[Node]) -> tuple[str, Node | None]:
    """Where x's scale goes: ("rms_norm", the norm producing x) when rms_norm(h, w) / s ==
    rms_norm(h, w / s) can be used; ("linear", the up projection) when x = mul(a, linear(h, W, b))
    and that linear's output feeds only the mul; else ("mul", None): a mul is inserted."""
    users = graph.users()
    sole_readers = all(u in group for u in users.get(x, [])) and x not in graph.outputs
    producer = graph.producers().get(x)
    if not sole_readers or producer is None:
        return "mul", None
    if producer.op == "rms_norm" and own_weight(graph, producer.inputs[1], users):
        return "rms_norm", producer
    if producer.op == "mul":
        producers = graph.producers()
        for operand in producer.inputs:
            lin = producers.get(operand)
            if (lin is not None and lin.op == "linear" and len(users.get(operand, [])) == 1
                    and graph.type_of(operand).shape[-1] == graph.type_of(x).shape[-1]
                    and all(own_weight(graph, p, users) for p in lin.inputs[1:])):
                return "linear", lin
    return "mul", None


def gated_fold_target(graph: Graph, x: str, group: list[Node]) -> Node | None:
    """The linear whose weight x's scale will be folded into, if any."""
    how, target = fold_site(graph, x, group)
    return target if how == "linear" else None


def scale_weight(graph: Graph, name: str, scale: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """graph.weights[name] = scale(w in float32), kept in w's dtype (lazily for a lazy weight)."""
    entry = graph.weights.entry(name)
    graph.weights[name] = graph.weights.derive([name], lambda ws: scale(ws[0].float()).to(ws[0].dtype),
                                               tuple(entry.shape), entry.dtype)


def own_weight(graph: Graph, name: str, users: dict) -> bool:
    """A float param that exactly one node reads (changing it changes nothing else)."""
    return (name in graph.params and graph.params[name].quant is None and name in graph.weights
            and len(users.get(name, [])) == 1 and name not in graph.outputs)


def insert_scale_mul(graph: Graph, x: str, group: list[Node], s: torch.Tensor) -> None:
    """x_scaled = mul(x, 1/s) before the group's first linear, which all read it instead."""
    t = graph.type_of(x)
    inv = f"{x}.awq_inv_scale"
    graph.add_param(inv, TensorType((s.numel(),), t.dtype), (1.0 / s).to(TORCH_DTYPES[t.dtype]))
    mul = graph.make_node("mul", [x, inv], [t], name=graph.fresh(f"{x}_awq"))
    first = min(graph.nodes.index(n) for n in group)
    graph.insert_before(graph.nodes[first], mul)
    for n in group:
        n.inputs[0] = mul.out.name


__all__ = ["gptq_method", "awq_method", "observe_linear_inputs", "ActivationStats", "StoredCodes",
           "fold_input_scale", "fold_site", "own_weight", "scale_weight", "AWQ_SAMPLE_ROWS"]
