"""The calibrated int4 methods of `quantize_int4`: observe each chosen linear's inputs on the
calibration sequences with the reference interpreter, then quantise by GPTQ (passes/gptq.py,
from each input's Hessian) or AWQ (passes/awq.py, activation-aware channel scales whose
inverse is folded into the op that produces the linear's input)."""

from __future__ import annotations

import importlib
from collections import ChainMap
from typing import Callable

import torch

from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import TORCH_DTYPES
from llmc.compiler.quant import dequantize_int4_codes
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
    for ids in calibration_tokens(ctx, f"quantize_int4 method={method}"):
        interpret(graph, prefill_inputs(graph, ids, f"quantize_int4 method={method}"), hook=hook)
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
def gptq_method(graph: Graph, ctx: PassContext, nodes: list[Node], group_of: Callable[[Node], int],
                *, act_order: bool, damp: float, clip: bool):
    """GPTQ layer by layer, as in the paper: the linears are taken in graph order, grouped by
    the input they share (q/k/v, gate/up), and each group's Hessian comes from the calibration
    text run up to it with every earlier linear already quantised, so later layers see (and
    compensate for) the error the earlier ones made. One forward pass in all. On SmolLM2-135M
    (int4, group 128) Hessians of the float model's activations, gathered in one run, gave a
    held-out perplexity above RTN's."""
    accumulator, quantize = import_method("gptq", ["HessianAccumulator", "gptq_quantize_weight"], "gptq")
    stored: dict[str, tuple] = {}
    dequantized: dict[str, torch.Tensor] = {}
    run = StagedRun(graph, ctx, "quantize_int4 method=gptq", ChainMap(dequantized, graph.weights))
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    for x, group in linears_by_input(nodes, position).items():
        todo = [n for n in group if n.inputs[1] not in stored]
        if not todo:
            continue
        hessian = accumulator(graph.type_of(x).shape[-1])
        for env in run.run_until(min(position[id(n)] for n in group)):
            hessian.add(env[x].reshape(-1, env[x].shape[-1]))
        weights = [graph.weights[n.inputs[1]] for n in todo]
        # GPTQ treats rows independently: the linears sharing this Hessian go in one call
        codes, scales, zeros = quantize(torch.cat([w.float() for w in weights]), hessian.hessian(),
                                        group_size=group_of(todo[0]), act_order=act_order, damp=damp,
                                        tokens=hessian.tokens, clip=clip)
        rows = [w.shape[0] for w in weights]
        for n, w, c, s, z in zip(todo, weights, codes.split(rows), scales.split(rows), zeros.split(rows)):
            stored[n.inputs[1]] = (c, s, z)
            dequantized[n.inputs[1]] = dequantize_int4_codes(c, s, z).to(w.dtype)

    def method(weight: torch.Tensor, ctx: PassContext, node: Node):
        return stored[node.inputs[1]]
    return method


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
    rms_norm weight or a linear's output rows where the graph allows, else by an inserted mul."""
    search, quantize = import_method("awq", ["awq_search_shared", "awq_quantize_with_scales"], "awq")
    n_seqs = len(calibration_tokens(ctx, "quantize_int4 method=awq"))
    stats = observe_linear_inputs(graph, ctx, nodes, "awq", lambda k: ActivationStats(k, sequences=n_seqs))
    by_input: dict[str, list[Node]] = {}
    for node in nodes:
        by_input.setdefault(node.inputs[0], []).append(node)
    scales, samples = {}, {}
    for x, group in by_input.items():
        weights = [graph.weights[n.inputs[1]].float() for n in group]
        # linears sharing an input share K, hence their group size
        s = search(weights, stats[x].mean_abs(), stats[x].sample(), group_size=group_of(group[0]))
        for n in group:
            scales[n.name], samples[n.name] = s, stats[x].sample()
    for x, group in by_input.items():
        fold_input_scale(graph, x, group, scales[group[0].name])

    def method(weight: torch.Tensor, ctx: PassContext, node: Node):
        return quantize(weight, scales[node.name], samples[node.name], group_size=group_of(node))
    return method


def fold_input_scale(graph: Graph, x: str, group: list[Node], s: torch.Tensor) -> str:
    """Make the linears of `group` read x / s instead of x; returns how ("rms_norm",
    "linear" or "mul")."""
    users = graph.users()
    sole_readers = all(u in group for u in users.get(x, [])) and x not in graph.outputs
    producer = graph.producers().get(x)
    if sole_readers and producer is not None and fold_into_rms_norm(graph, producer, s, users):
        return "rms_norm"
    if sole_readers and producer is not None and fold_into_gated_linear(graph, producer, s, users):
        return "linear"
    insert_scale_mul(graph, x, group, s)
    return "mul"


def _own_weight(graph: Graph, name: str, users: dict) -> bool:
    """A float param that exactly one node reads (changing it changes nothing else)."""
    return (name in graph.params and graph.params[name].quant is None and name in graph.weights
            and len(users.get(name, [])) == 1 and name not in graph.outputs)


def fold_into_rms_norm(graph: Graph, norm: Node, s: torch.Tensor, users: dict) -> bool:
    """rms_norm(h, w) / s == rms_norm(h, w / s)."""
    if norm.op != "rms_norm" or not _own_weight(graph, norm.inputs[1], users):
        return False
    w = graph.weights[norm.inputs[1]]
    graph.weights[norm.inputs[1]] = (w.float() / s).to(w.dtype)
    return True


def fold_into_gated_linear(graph: Graph, mul: Node, s: torch.Tensor, users: dict) -> bool:
    """mul(a, linear(h, W, b)) / s == mul(a, linear(h, W / s[:, None], b / s)) when that
    linear's output feeds only the mul (the up projection of a gated MLP)."""
    if mul.op != "mul":
        return False
    producers = graph.producers()
    for operand in mul.inputs:
        lin = producers.get(operand)
        if (lin is None or lin.op != "linear" or len(users.get(operand, [])) != 1
                or graph.type_of(operand).shape[-1] != s.numel()
                or not all(_own_weight(graph, p, users) for p in lin.inputs[1:])):
            continue
        w = graph.weights[lin.inputs[1]]
        graph.weights[lin.inputs[1]] = (w.float() / s[:, None]).to(w.dtype)
        if len(lin.inputs) > 2:
            b = graph.weights[lin.inputs[2]]
            graph.weights[lin.inputs[2]] = (b.float() / s).to(b.dtype)
        return True
    return False


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


__all__ = ["gptq_method", "awq_method", "observe_linear_inputs", "ActivationStats",
           "fold_input_scale", "AWQ_SAMPLE_ROWS"]
