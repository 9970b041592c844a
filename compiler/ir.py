"""The llmc graph IR: typed SSA values, LLM-level ops, params with quantisation and
sharding metadata, a verifier, a text printer and a deterministic JSON form."""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

from llmc.compiler.weight_store import WeightStore
from llmc.errors import IRError

# A dim is a concrete int or a symbolic name such as "tokens".
Dim = int | str

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "symint": 8,
}
# the torch dtype of each dtype name (all but symint)
TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise IRError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}")
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self, dims: dict[str, int] | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= d if isinstance(d, int) else eval_dim(d, dims or {})
        return n

    def nbytes(self, dims: dict[str, int] | None = None) -> int:
        return self.numel(dims) * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


def eval_dim(dim: Dim, dims: dict[str, int]) -> int:
    """Evaluate a symbolic dim ("tokens", "2*tokens", "tokens + 1") under a binding.
    Walks the expression's syntax tree (names, integers, + - * //) instead of calling eval,
    since dims can come from a graph.json on disk."""
    if isinstance(dim, int):
        return dim
    try:
        return _eval_dim_node(ast.parse(dim, mode="eval").body, dims)
    except (SyntaxError, KeyError, TypeError, ZeroDivisionError, RecursionError, MemoryError) as e:
        raise IRError(f"cannot evaluate dim {dim!r} with {dims}") from e


_DIM_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _eval_dim_node(node: ast.AST, dims: dict[str, int]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return int(dims[node.id])
    if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPS:
        return _DIM_OPS[type(node.op)](_eval_dim_node(node.left, dims), _eval_dim_node(node.right, dims))
    raise TypeError(f"unsupported dim expression {ast.dump(node)}")


@dataclass(frozen=True)
class QuantScheme:
    """How a quantised param is stored: `bits`-bit codes in groups of `group_size` along
    the input dim (-1: per output channel), with scales (and zero points) in sibling params."""
    method: str                 # "rtn", "gptq", "awq", "smoothquant", "fp8"
    bits: int
    group_size: int = -1
    symmetric: bool = True
    scales: str = ""            # param name of the scales
    zeros: str = ""             # param name of the zero points (asymmetric only)
    orig_dtype: str = "float32"


@dataclass(frozen=True)
class Sharding:
    """Tensor-parallel placement of a param: split along `dim` over `world_size` ranks."""
    kind: str                   # "column", "row", "replicated"
    dim: int | None = None
    world_size: int = 1


@dataclass
class Param:
    name: str
    type: TensorType
    quant: QuantScheme | None = None
    shard: Sharding | None = None


@dataclass
class Value:
    name: str
    type: TensorType


@dataclass
class Node:
    name: str
    op: str
    inputs: list[str]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def out(self) -> Value:
        assert len(self.outputs) == 1, f"{self.name} has {len(self.outputs)} outputs"
        return self.outputs[0]


class Graph:
    """Nodes in topological order over named values; params name weights held in `weights`
    (tensors are not part of the graph's JSON form; the artifact stores them)."""

    def __init__(self, name: str = "model"):
        self.name = name
        self.inputs: list[Value] = []
        self.params: dict[str, Param] = {}
        self.nodes: list[Node] = []
        self.outputs: list[str] = []
        self.meta: dict[str, Any] = {}
        self.weights = WeightStore()
        self._counter = 0

    @property
    def weights(self) -> WeightStore:
        return self._weights

    @weights.setter
    def weights(self, weights) -> None:
        """A plain dict of tensors is taken as a store of them."""
        self._weights = weights if isinstance(weights, WeightStore) else WeightStore(weights)

    # -- building -----------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        taken = self.value_names() | {n.name for n in self.nodes}
        while True:
            self._counter += 1
            name = f"{prefix}_{self._counter}"
            if name not in taken:
                return name

    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(name, type)
        self.inputs.append(v)
        return v

    def add_param(self, name: str, type: TensorType, tensor=None, **meta) -> Param:
        p = Param(name, type, **meta)
        self.params[name] = p
        if tensor is not None:
            self.weights[name] = tensor
        return p

    def make_node(self, op: str, inputs: list[str], out_types: list[TensorType],
                  attrs: dict | None = None, name: str | None = None) -> Node:
        name = name or self.fresh(op)
        outs = [Value(name if i == 0 else f"{name}.{i}", t) for i, t in enumerate(out_types)]
        return Node(name, op, list(inputs), outs, dict(attrs or {}))

    def insert_before(self, anchor: Node, node: Node) -> Node:
        self.nodes.insert(self.nodes.index(anchor), node)
        return node

    # -- queries ------------------------------------------------------------------
    def value_names(self) -> set[str]:
        names = {v.name for v in self.inputs} | set(self.params)
        for n in self.nodes:
            names.update(v.name for v in n.outputs)
        return names

    def producers(self) -> dict[str, Node]:
        return {v.name: n for n in self.nodes for v in n.outputs}

    def users(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                users.setdefault(i, []).append(n)
        return users

    def type_of(self, name: str) -> TensorType:
        for v in self.inputs:
            if v.name == name:
                return v.type
        if name in self.params:
            return self.params[name].type
        for n in self.nodes:
            for v in n.outputs:
                if v.name == name:
                    return v.type
        raise IRError(f"graph {self.name}: no value named {name!r}")

    def types(self) -> dict[str, TensorType]:
        t = {v.name: v.type for v in self.inputs}
        t.update({p.name: p.type for p in self.params.values()})
        for n in self.nodes:
            t.update({v.name: v.type for v in n.outputs})
        return t

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    def to_networkx(self):
        """Dataflow graph (networkx.DiGraph) over node names (graph inputs and params are not
        nodes); networkx is imported here, so the runtime, which reads graphs, never loads it."""
        import networkx as nx  # networkx: ~0.1-0.3 s; `llmc --help` and the engine import this module

        g = nx.DiGraph()
        prod = self.producers()
        for n in self.nodes:
            g.add_node(n.name)
            for i in n.inputs:
                if i in prod:
                    g.add_edge(prod[i].name, n.name)
        return g

    # -- editing ------------------------------------------------------------------
    def replace_uses(self, old: str, new: str) -> int:
        count = 0
        for n in self.nodes:
            for k, i in enumerate(n.inputs):
                if i == old:
                    n.inputs[k] = new
                    count += 1
        self.outputs = [new if o == old else o for o in self.outputs]
        return count

    def remove_nodes(self, dead: Iterable[Node]) -> None:
        dead_names = {n.name for n in dead}
        self.nodes = [n for n in self.nodes if n.name not in dead_names]

    def prune_params(self) -> list[str]:
        """Drop params no node reads; returns their names."""
        used = {i for n in self.nodes for i in n.inputs} | set(self.outputs)
        unused = [p for p in self.params if p not in used]
        for p in unused:
            del self.params[p]
            self.weights.pop(p, None)
        return unused

    def copy(self) -> "Graph":
        g = Graph.from_json(self.to_json())
        g.weights = self.weights.copy()
        return g

    # -- verification -------------------------------------------------------------
    def verify(self, for_runtime: bool = False) -> None:
        """Check SSA form, topological order, dangling values, and op types. With `for_runtime` (before
        codegen), also refuse every node the runtime would refuse to load (ops.runtime_refusal: attrs
        outside the op's spec, aten fallbacks off the allow-list of pure tensor ops)."""
        from llmc.compiler.ops import infer_types, runtime_refusal  # compiler.ops imports this module: a cycle

        defined = {v.name for v in self.inputs} | set(self.params)
        if len(defined) != len(self.inputs) + len(self.params):
            raise IRError(f"graph {self.name}: an input and a param share a name")
        types = {v.name: v.type for v in self.inputs} | {p.name: p.type for p in self.params.values()}
        node_names = set()
        for n in self.nodes:
            if n.name in node_names:
                raise IRError(f"node {n.name}: name defined twice")
            node_names.add(n.name)
            for i in n.inputs:
                if i not in defined:
                    raise IRError(f"node {n.name} ({n.op}): input {i!r} is not defined before use")
            if for_runtime:
                _refuse_for_runtime(n, runtime_refusal(n.op, n.attrs, [types[i] for i in n.inputs]))
            expected = infer_types(n, [types[i] for i in n.inputs])
            if expected is not None:
                got = [v.type for v in n.outputs]
                if list(expected) != got:
                    raise IRError(f"node {n.name} ({n.op}): output types {[str(t) for t in got]} "
                                  f"differ from inferred {[str(t) for t in expected]}")
            for v in n.outputs:
                if v.name in defined:
                    raise IRError(f"node {n.name}: value {v.name!r} defined twice (not SSA)")
                defined.add(v.name)
                types[v.name] = v.type
        for o in self.outputs:
            if o not in defined:
                raise IRError(f"graph {self.name}: output {o!r} is not defined")
        for name, p in self.params.items():
            if p.quant and p.quant.scales and p.quant.scales not in self.params:
                raise IRError(f"param {name}: scales param {p.quant.scales!r} is missing")

    # -- text and JSON ------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"graph {self.name}("]
        lines += [f"    %{v.name}: {v.type}," for v in self.inputs]
        lines.append(") {")
        for p in self.params.values():
            q = f" quant={p.quant.method}/int{p.quant.bits}/g{p.quant.group_size}" if p.quant else ""
            s = f" shard={p.shard.kind}" if p.shard else ""
            lines.append(f"  param @{p.name}: {p.type}{q}{s}")
        prod = set(self.params)
        for n in self.nodes:
            outs = ", ".join(f"%{v.name}: {v.type}" for v in n.outputs)
            ins = ", ".join(("@" if i in prod else "%") + i for i in n.inputs)
            attrs = "".join(f" {k}={_short(v)}" for k, v in sorted(n.attrs.items()))
            lines.append(f"  {outs} = {n.op}({ins}){attrs}")
        lines.append(f"  return {', '.join('%' + o for o in self.outputs)}")
        lines.append("}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "inputs": [_value_dict(v) for v in self.inputs],
            "params": [_param_dict(p) for p in self.params.values()],
            "nodes": [{"name": n.name, "op": n.op, "inputs": n.inputs,
                       "outputs": [_value_dict(v) for v in n.outputs], "attrs": n.attrs}
                      for n in self.nodes],
            "outputs": self.outputs,
            "meta": self.meta,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        g = cls(d["name"])
        g.inputs = [_value_from(v) for v in d["inputs"]]
        for p in d["params"]:
            g.params[p["name"]] = Param(
                p["name"], _type_from(p["type"]),
                QuantScheme(**p["quant"]) if p.get("quant") else None,
                Sharding(**p["shard"]) if p.get("shard") else None)
        g.nodes = [Node(n["name"], n["op"], list(n["inputs"]),
                        [_value_from(v) for v in n["outputs"]], dict(n["attrs"]))
                   for n in d["nodes"]]
        g.outputs = list(d["outputs"])
        g.meta = dict(d.get("meta", {}))
        return g

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        return cls.from_dict(json.loads(text))


def _refuse_for_runtime(node: Node, why: str | None) -> None:
    if why:
        target = f" {node.attrs.get('target')}" if node.op == "aten" else ""
        raise IRError(f"node {node.name} ({node.op}{target}): {why}; the llmc runtime would refuse to run it, so it "
                      f"is not compiled (aten fallbacks must be pure tensor ops: compiler/aten_allowlist.py)")


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= 60 else s[:57] + "..."


def _type_dict(t: TensorType) -> dict:
    return {"shape": list(t.shape), "dtype": t.dtype}


def _type_from(d: dict) -> TensorType:
    return TensorType(tuple(d["shape"]), d["dtype"])


def _value_dict(v: Value) -> dict:
    return {"name": v.name, "type": _type_dict(v.type)}


def _value_from(d: dict) -> Value:
    return Value(d["name"], _type_from(d["type"]))


def _param_dict(p: Param) -> dict:
    return {"name": p.name, "type": _type_dict(p.type),
            "quant": asdict(p.quant) if p.quant else None,
            "shard": asdict(p.shard) if p.shard else None}


__all__ = ["Dim", "DTYPE_BYTES", "TensorType", "QuantScheme", "Sharding", "Param", "Value",
           "Node", "Graph", "eval_dim"]
