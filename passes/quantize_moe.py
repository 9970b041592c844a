"""Expert weights of Mixtral-style `moe` ops under the weight-only int8 and int4 passes: each moe
becomes a qmoe over its experts' codes and scales (and int4 zero points), stored as qlinear stores one
weight, per expert; the router stays float. The CPU kernel and the Triton kernels dequantise only the
chosen experts' weights (codegen/torch_cpu/cpu_moe.py, codegen/triton/triton_moe.py). Experts are rounded to nearest
whatever the pass's method (GPTQ and AWQ calibrate linears one by one; an expert sees only the tokens
routed to it)."""

from __future__ import annotations

from typing import Callable

import torch

from llmc.compiler.ir import Graph, Node, QuantScheme, TensorType
from llmc.compiler.ops import DTYPE_NAMES
from llmc.compiler.quant import pack_int4, quantize_int4, quantize_int8
from llmc.compiler.schemes import NO_ZERO, SCHEMES
from llmc.errors import PassError


def quantize_experts(graph: Graph, scheme: str, group_of: Callable[[int], int | None]) -> tuple[int, int, int]:
    """Rewrite every moe into a qmoe over `scheme` ("int8", or "int4" in groups of group_of(K) along
    K, None: no usable group size) experts. Returns (moe ops, float bytes, quantised bytes)."""
    nodes = [n for n in graph.nodes if n.op == "moe"]
    if not nodes:
        return 0, 0, 0
    before = after = 0
    for node in nodes:
        x, router, gate_up, down = node.inputs
        hidden = graph.params[router].type.shape[1]
        inter = graph.params[down].type.shape[2]
        group = _group(node, group_of, hidden, inter) if SCHEMES[scheme].grouped else -1
        params = []
        for weight in (gate_up, down):
            before += graph.params[weight].type.nbytes()
            names, added = _store_experts(graph, weight, scheme, group)
            params += names
            after += added
        node.op = "qmoe"
        node.inputs = [x, router, *params]
        node.attrs = {"top_k": node.attrs["top_k"], "scheme": scheme, "intermediate": inter} | (
            {"group_size": group} if SCHEMES[scheme].grouped else {})
    graph.prune_params()
    return len(nodes), before, after


def _group(node: Node, group_of: Callable[[int], int | None], hidden: int, inter: int) -> int:
    sizes = {group_of(hidden), group_of(inter)}
    if None in sizes or len(sizes) > 1:
        raise PassError(f"node {node.name} (moe): no int4 group size serves both its hidden size {hidden} and "
                        f"its expert width {inter}; pick another --group-size")
    return sizes.pop()


def _store_experts(graph: Graph, weight: str, scheme: str, group: int) -> tuple[list[str], int]:
    """Add `<weight>.qweight/.scales[/.zeros]` for the [E, N, K] expert weights; their names and bytes."""
    if weight not in graph.weights or graph.params[weight].quant:
        raise PassError(f"moe weight {weight} is not a stored float param; weight quantisation cannot read it")
    experts = graph.weights[weight].float()
    parts = [_quantize_expert(w, scheme, group) for w in experts]
    tensors = {"qweight": torch.stack([p[0] for p in parts]), "scales": torch.stack([p[1] for p in parts])}
    if SCHEMES[scheme].zeros_required:
        tensors["zeros"] = torch.stack([p[2] for p in parts])
    names = {k: f"{weight}.{k}" for k in tensors}
    row = SCHEMES[scheme]
    quant = QuantScheme("rtn", row.bits, group, row.zero_point == NO_ZERO, names["scales"],
                        names.get("zeros", ""), graph.params[weight].type.dtype)
    for key, tensor in tensors.items():
        tensor = tensor.contiguous()
        graph.add_param(names[key], TensorType(tuple(tensor.shape), DTYPE_NAMES[tensor.dtype]), tensor,
                        quant=quant if key == "qweight" else None)
    return list(names.values()), sum(t.numel() * t.element_size() for t in tensors.values())


def _quantize_expert(weight: torch.Tensor, scheme: str, group: int) -> tuple:
    if not SCHEMES[scheme].grouped:
        return quantize_int8(weight)
    codes, scales, zeros = quantize_int4(weight, group)
    return pack_int4(codes), scales, zeros


__all__ = ["quantize_experts"]
