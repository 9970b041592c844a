"""Cutting one projection's weights for one tensor-parallel rank. A column cut keeps output
features [start, stop) of the weight and of everything stored per output feature (bias, scales,
zeros); a row cut keeps input features [start, stop): the weight's columns (int4: packed two to a
byte), int4 scales and zeros by whole groups (a group that straddles two ranks is refused),
per-output-channel scales whole, and the bias on rank 0 only (the all_reduce that follows adds
it once). A param other nodes also read (a tied LM head) is copied under a new name first. Each
rank's graph is whole in itself (its params hold its own part), so Param.shard stays unset and the
fusions that follow see plain params."""

from __future__ import annotations

import dataclasses

import torch

from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import DTYPE_NAMES
from llmc.compiler.quant import group_params
from llmc.compiler.schemes import INT8_PER_TOKEN, SCHEMES
from llmc.errors import PassError


def input_roles(node: Node) -> dict[str, int]:
    """Role of each param input of a linear or qlinear -> its index in node.inputs."""
    if node.op == "linear":
        return {"weight": 1} | ({"bias": 2} if len(node.inputs) == 3 else {})
    flags = [r for r, attr in (("zeros", "has_zeros"), ("act_scale", "has_act_scale"), ("bias", "has_bias"))
             if node.attrs.get(attr)]
    return {"weight": 1, "scales": 2} | {role: 3 + i for i, role in enumerate(flags)}


def out_features(graph: Graph, node: Node) -> int:
    return graph.type_of(node.out.name).shape[-1]


def in_features(graph: Graph, node: Node) -> int:
    return graph.type_of(node.inputs[0]).shape[-1]


def cut_column(graph: Graph, node: Node, start: int, stop: int) -> None:
    """Keep output features [start, stop) of projection `node`."""
    n = out_features(graph, node)
    cuts = {}
    for role, index in input_roles(node).items():
        tensor = graph.weights[node.inputs[index]]
        if role != "act_scale" and tensor.shape[0] == n:  # fp8 per-tensor scales [1] stay whole
            cuts[index] = tensor[start:stop]
    _store(graph, node, cuts)
    _set_features(node, "out_features", stop - start)


def cut_table(graph: Graph, node: Node, start: int, stop: int) -> None:
    """Keep rows (token ids) [start, stop) of an embedding's table."""
    _store(graph, node, {1: graph.weights[node.inputs[1]][start:stop]})


def cut_row(graph: Graph, node: Node, start: int, stop: int, rank: int, pass_name: str) -> None:
    """Keep input features [start, stop) of projection `node`; its output is a partial sum."""
    scheme = node.attrs.get("scheme")
    if scheme and SCHEMES[scheme].activations == INT8_PER_TOKEN:
        raise PassError(f"{pass_name}: {node.name} is a {scheme} qlinear, whose per-token activation scales "
                        f"would differ on a slice of its input features; it cannot be row-parallel "
                        f"(compile without --tp, or with another --quant)")
    per_byte = SCHEMES[scheme].codes_per_element if scheme else 1
    cuts = {}
    for role, index in input_roles(node).items():
        tensor = graph.weights[node.inputs[index]]
        if role == "weight":
            cuts[index] = tensor[:, start // per_byte: stop // per_byte]
        elif role in ("scales", "zeros") and tensor.dim() == 2:
            group = _whole_groups(graph, node, start, stop, pass_name)
            # K-quant packed params hold whole rows' super-blocks: cut their values (fp32, the same numbers)
            values = group_params(tensor, in_features(graph, node))
            cuts[index] = values[:, start // group: stop // group]
        elif role == "bias" and rank != 0:
            cuts[index] = torch.zeros_like(tensor)
    _store(graph, node, cuts)
    _set_features(node, "in_features", stop - start)


def _whole_groups(graph: Graph, node: Node, start: int, stop: int, pass_name: str) -> int:
    group = node.attrs["group_size"]
    if start % group or stop % group:
        k, tp = in_features(graph, node), in_features(graph, node) // (stop - start)
        raise PassError(f"{pass_name}: {node.name}'s int4 groups of {group} straddle the tensor-parallel cut at "
                        f"input feature {start if start % group else stop} ({k} features over {tp} ranks); "
                        f"give --group-size a divisor of {k // tp}, or another --tp")
    return group


def _set_features(node: Node, attr: str, count: int) -> None:
    if attr in node.attrs:
        node.attrs[attr] = count


def _store(graph: Graph, node: Node, cuts: dict[int, torch.Tensor]) -> None:
    """Put each cut tensor in the param node.inputs[index] names (a fresh param when other nodes
    read that one), keeping quantisation schemes pointed at their cut scales and zeros."""
    users = graph.users()
    renames = {}
    for index in cuts:
        name = node.inputs[index]
        shared = any(u is not node for u in users.get(name, []))
        renames[name] = graph.fresh(f"{name}.shard") if shared else name
    for index, tensor in cuts.items():
        old = node.inputs[index]
        param = graph.params[old]
        quant = param.quant and dataclasses.replace(
            param.quant, scales=renames.get(param.quant.scales, param.quant.scales),
            zeros=renames.get(param.quant.zeros, param.quant.zeros))
        # the tensor's own dtype: K-quant packed params are cut as their fp32 values (cut_row)
        graph.add_param(renames[old], TensorType(tuple(tensor.shape), DTYPE_NAMES[tensor.dtype]), tensor.clone(),
                        quant=quant)
        node.inputs[index] = renames[old]


__all__ = ["input_roles", "out_features", "in_features", "cut_column", "cut_table", "cut_row"]
