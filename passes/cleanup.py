"""Cleanup passes that every pipeline starts and ends with: drop aten no-ops left by
tracing, fold nodes computed from weights alone, and remove dead nodes and params."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import ATTENTION_OPS, DTYPE_NAMES, TORCH_DTYPES, run_reference
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.options import PassOptions, option

# torch uses INT64_MAX (or similar) as the end of an open slice.
_HUGE = 2**62

# Ops whose result is random or uninitialised: evaluating them once would freeze noise.
_NONDETERMINISTIC = {
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm",
    "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential", "geometric",
    "cauchy", "log_normal", "dropout", "native_dropout", "empty", "empty_like", "empty_strided",
}


def aten_op_name(node: Node) -> str:
    """`aten.view.default` -> `view`; empty for non-fallback nodes."""
    if node.op != "aten":
        return ""
    parts = str(node.attrs.get("target", "")).split(".")
    return parts[1] if len(parts) == 3 else ""


def has_side_effects(node: Node) -> bool:
    """Marked `side_effects` by lowering, or an in-place aten op (`add_`, `copy_`)."""
    name = aten_op_name(node)
    return bool(node.attrs.get("side_effects")) or (name.endswith("_") and not name.endswith("__"))


def param_nbytes(t: TensorType) -> int:
    return t.nbytes() if all(isinstance(d, int) for d in t.shape) else 0


@register_pass
class DeadCodeElimination(Pass):
    name = "dce"
    description = "remove nodes whose outputs nothing uses, then params no node reads"
    stage, stages = Stage.SIMPLIFY, (Stage.LOWER, Stage.SIMPLIFY, Stage.CLEANUP)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        live = set(graph.outputs)
        dead = []
        for node in reversed(graph.nodes):
            if has_side_effects(node) or any(v.name in live for v in node.outputs):
                live.update(node.inputs)
            else:
                dead.append(node)
        graph.remove_nodes(dead)
        types = {name: p.type for name, p in graph.params.items()}
        pruned = graph.prune_params()
        saved = sum(param_nbytes(types[name]) for name in pruned)
        details = {"removed_by_op": dict(sorted(Counter(n.op for n in dead).items())),
                   "pruned_params": len(pruned)}
        return PassResult(len(dead), bool(dead or pruned), details, bytes_saved=saved)


# -- remove_noops ---------------------------------------------------------------------
def _number(a: Any) -> float | None:
    if isinstance(a, bool):
        return None
    if isinstance(a, (int, float)):
        return float(a)
    if isinstance(a, dict) and "$float" in a:
        return float(a["$float"])
    return None


def _tensor_source(a: Any) -> int | None:
    return a["$in"] if isinstance(a, dict) and "$in" in a else None


def _first_arg(args: list, kwargs: dict) -> Any:
    return args[0] if args else kwargs.get("self", kwargs.get("input"))


def _always(args: list, kwargs: dict, in_types: list[TensorType]) -> int | None:
    return _tensor_source(_first_arg(args, kwargs))


def _full_slice(args: list, kwargs: dict, in_types: list[TensorType]) -> int | None:
    # aten.slice.Tensor(self, dim=0, start=None, end=None, step=1)
    names = ["self", "dim", "start", "end", "step"]
    a = {"dim": 0, "start": None, "end": None, "step": 1} | dict(zip(names, args)) | kwargs
    k = _tensor_source(a["self"])
    if k is None or k >= len(in_types) or not isinstance(a["dim"], int) or not in_types[k].rank:
        return None
    if a["start"] not in (None, 0) or a["step"] != 1:
        return None
    size, end = in_types[k].shape[a["dim"] % in_types[k].rank], a["end"]
    if end is None or (isinstance(end, int) and (end >= _HUGE or (isinstance(size, int) and end >= size))):
        return k
    return None


def _scalar_identity(identity: float, commutative: bool) -> Callable:
    """x op identity (or identity op x when commutative) is x: mul by 1, add by 0, ..."""
    def check(args: list, kwargs: dict, in_types: list[TensorType]) -> int | None:
        if len(args) != 2:
            return None
        pairs = [(args[0], args[1])] + ([(args[1], args[0])] if commutative else [])
        for tensor, scalar in pairs:
            if _tensor_source(tensor) is not None and _number(scalar) == identity:
                return _tensor_source(tensor)
        return None
    return check


NOOP_RULES: dict[str, Callable] = {
    **dict.fromkeys(["aten.alias.default", "aten.clone.default", "aten.contiguous.default",
                     "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device",
                     "aten._to_copy.default", "aten.view.default", "aten.reshape.default",
                     "aten._unsafe_view.default", "aten.expand.default", "aten.type_as.default",
                     "aten.dropout.default"], _always),
    "aten.slice.Tensor": _full_slice,
    "aten.mul.Tensor": _scalar_identity(1.0, commutative=True),
    "aten.mul.Scalar": _scalar_identity(1.0, commutative=True),
    "aten.div.Tensor": _scalar_identity(1.0, commutative=False),
    "aten.div.Scalar": _scalar_identity(1.0, commutative=False),
    "aten.add.Tensor": _scalar_identity(0.0, commutative=True),
    "aten.add.Scalar": _scalar_identity(0.0, commutative=True),
    "aten.sub.Tensor": _scalar_identity(0.0, commutative=False),
    "aten.sub.Scalar": _scalar_identity(0.0, commutative=False),
}


def is_assert(node: Node) -> bool:
    return aten_op_name(node).startswith("_assert")


def noop_source(node: Node, types: dict[str, TensorType]) -> str | None:
    """The value a no-op node's output equals, or None when the node does real work."""
    rule = NOOP_RULES.get(node.attrs.get("target")) if node.op == "aten" else None
    if rule is None or len(node.outputs) != 1:
        return None
    k = rule(list(node.attrs.get("args", [])), dict(node.attrs.get("kwargs", {})),
             [types[i] for i in node.inputs])
    if not isinstance(k, int) or not 0 <= k < len(node.inputs):
        return None
    # Same type in and out is what makes it an identity (no cast, reshape or broadcast).
    return node.inputs[k] if types[node.inputs[k]] == node.out.type else None


@register_pass
class RemoveNoops(Pass):
    name = "remove_noops"
    description = ("remove aten asserts, aliases, clones, same-dtype casts, same-shape views, "
                   "full slices, x*1, x+0 and dropout (inference only)")
    stage, stages = Stage.SIMPLIFY, (Stage.LOWER, Stage.SIMPLIFY, Stage.CLEANUP)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        types = graph.types()
        used = set(graph.users()) | set(graph.outputs)
        removed: list[Node] = []
        for node in graph.nodes:
            if is_assert(node) and not any(v.name in used for v in node.outputs):
                removed.append(node)
            elif (source := noop_source(node, types)) is not None:
                graph.replace_uses(node.out.name, source)
                removed.append(node)
        graph.remove_nodes(removed)
        by_target = Counter(n.attrs["target"] for n in removed)
        return PassResult(len(removed), bool(removed), {"by_target": dict(sorted(by_target.items()))})


# -- fold_constants --------------------------------------------------------------------
@register_pass
class FoldConstants(Pass):
    name = "fold_constants"
    description = "evaluate nodes whose inputs are all weights and store the results as params"
    stage, stages = Stage.SIMPLIFY, (Stage.SIMPLIFY, Stage.CLEANUP)

    @dataclass(frozen=True)
    class Options(PassOptions):
        max_growth: float = option(2.0, "largest allowed result bytes / input bytes of a folded node",
                                   low=0.0, strict=True)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        kept, folded, added = [], Counter(), 0
        for node in graph.nodes:
            if not self._foldable(graph, node):
                kept.append(node)
                continue
            for value, tensor in zip(node.outputs, self._folded(graph, node)):
                # The param takes the value's name, so every use stays as it is.
                graph.add_param(value.name, value.type, tensor)
                added += value.type.nbytes()
            folded[node.op if node.op != "aten" else node.attrs["target"]] += 1
        graph.nodes = kept
        types = {name: p.type for name, p in graph.params.items()}
        pruned = graph.prune_params()
        removed = sum(param_nbytes(types[name]) for name in pruned)
        details = {"folded_by_op": dict(sorted(folded.items())), "pruned_params": len(pruned),
                   "bytes_added": added}
        # Net bytes: negative when folding grew the weights (within max_growth).
        return PassResult(sum(folded.values()), bool(folded or pruned), details,
                          bytes_saved=removed - added)

    def _foldable(self, graph: Graph, node: Node) -> bool:
        if node.op in ATTENTION_OPS or not node.inputs or has_side_effects(node):
            return False
        if aten_op_name(node) in _NONDETERMINISTIC:
            return False
        for name in node.inputs:
            p = graph.params.get(name)
            if p is None or p.quant or p.shard or name not in graph.weights:
                return False
        out_types = [v.type for v in node.outputs]
        if any(t.dtype == "symint" or not all(isinstance(d, int) for d in t.shape) for t in out_types):
            return False
        in_bytes = sum(graph.params[name].type.nbytes() for name in set(node.inputs))
        return sum(t.nbytes() for t in out_types) <= self.options.max_growth * in_bytes

    def _folded(self, graph: Graph, node: Node) -> list:
        """The node's results: tensors now, or lazy ones where an input's values are not made yet."""
        if not any(graph.weights.is_lazy(name) for name in node.inputs):
            return self._evaluate(node, [graph.weights[name] for name in node.inputs])
        return [graph.weights.derive(node.inputs, lambda values, i=i: self._evaluate(node, values)[i],
                                     v.type.shape, TORCH_DTYPES[v.type.dtype]) for i, v in enumerate(node.outputs)]

    def _evaluate(self, node: Node, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            outs = run_reference(node, inputs)
        if len(outs) != len(node.outputs):
            raise PassError(f"fold_constants: node {node.name} ({node.op}) gave {len(outs)} results "
                            f"for {len(node.outputs)} outputs; its reference and IR disagree")
        for value, out in zip(node.outputs, outs):
            got = f"{DTYPE_NAMES.get(out.dtype, out.dtype)}{list(out.shape)}"
            if got != f"{value.type.dtype}{list(value.type.shape)}":
                raise PassError(f"fold_constants: node {node.name} ({node.op}) evaluated to {got} "
                                f"but its output {value.name} is typed {value.type}; fix the node's type")
        # Own contiguous storage: results may be views of the input weights.
        return [out.clone(memory_format=torch.contiguous_format) for out in outs]


__all__ = ["DeadCodeElimination", "RemoveNoops", "FoldConstants", "NOOP_RULES", "noop_source",
           "has_side_effects", "aten_op_name", "param_nbytes"]
