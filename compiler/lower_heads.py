"""Where attention's heads come from: the columns of a projection. Models split q, k and v out of
fused projections in many layouts (Phi-3's slices of one qkv output, GPT-NeoX's per-head interleaved
chunks, Falcon's multi-query index, GPT-2's Conv1D split); lowering follows a head tensor back
through such column selections to the projection, evaluates which output columns it holds, and
projects exactly those columns with a linear of its own (fuse_qkv joins them again later)."""

from __future__ import annotations

import torch

from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import DTYPE_NAMES
from llmc.compiler.trace import TOKENS

# Ops that only pick, reorder or regroup the features of one tensor input (never mix tokens).
SELECTIONS = {f"aten.{op}" for op in ("view.default", "reshape.default", "_unsafe_view.default", "transpose.int",
                                       "slice.Tensor", "chunk.default", "split.Tensor", "split_with_sizes.default",
                                       "index.Tensor", "alias.default", "clone.default", "contiguous.default",
                                       "narrow.default", "select.int", "flatten.using_ints", "unflatten.int",
                                       "broadcast_to.default", "expand.default", "permute.default")}
# Column splits and where their dim argument sits.
SPLITS = {"aten.chunk.default": 2, "aten.split.Tensor": 2, "aten.split_with_sizes.default": 2, "aten.slice.Tensor": 1}
MATMUL_TRANSPOSES = {"aten.t.default", "aten.numpy_T.default", "aten.transpose.int", "aten.permute.default"}


def raise_linear_forms(g: Graph) -> int:
    """Projections not written as aten.linear -> linear ops: x @ W.T with W a param (Falcon), and
    Conv1D's view(addmm(b, view(x, [-1, in]), W), [..., out]) (GPT-2, weight stored [in, out])."""
    prod, count = g.producers(), 0
    for i, n in enumerate(g.nodes):
        new = _matmul_linear(g, prod, n) or _conv1d_linear(g, prod, n)
        if new is not None:
            g.nodes[i] = new
            count += 1
    return count


def _aten(n: Node | None, *targets: str) -> bool:
    return n is not None and n.op == "aten" and n.attrs["target"] in targets


def _matmul_linear(g: Graph, prod: dict, n: Node) -> Node | None:
    if not _aten(n, "aten.matmul.default") or len(n.inputs) != 2:
        return None
    x, wt = n.inputs
    t = prod.get(wt)
    if not _aten(t, *MATMUL_TRANSPOSES) or t.inputs[0] not in g.params or g.params[t.inputs[0]].type.rank != 2:
        return None
    if g.type_of(wt).shape != tuple(reversed(g.params[t.inputs[0]].type.shape)):
        return None
    return Node(n.name, "linear", [x, t.inputs[0]], n.outputs)


def _conv1d_linear(g: Graph, prod: dict, n: Node) -> Node | None:
    if not _aten(n, "aten.view.default", "aten.reshape.default"):
        return None
    mm = prod.get(n.inputs[0])
    if not _aten(mm, "aten.addmm.default") or mm.attrs["kwargs"] or len(mm.inputs) != 3:
        return None
    bias, flat, weight = mm.inputs
    flatten = prod.get(flat)
    if not (_aten(flatten, "aten.view.default", "aten.reshape.default") and {bias, weight} <= set(g.params)):
        return None
    x = flatten.inputs[0]
    x_type, out_type = g.type_of(x), g.type_of(n.outputs[0].name)
    if x_type.shape[:-1] != out_type.shape[:-1] or g.params[weight].type.shape != (x_type.shape[-1],
                                                                                   out_type.shape[-1]):
        return None
    transposed = new_param(g, weight.removesuffix(".weight") + ".linear.weight",
                            g.weights[weight].t().contiguous())
    return Node(n.name, "linear", [x, transposed, bias], n.outputs)


def new_param(g: Graph, name: str, tensor: torch.Tensor) -> str:
    """A param holding `tensor`, named `name` (or `name` numbered, if that holds another tensor)."""
    stem, k = name, 1
    while name in g.params and not (g.weights[name].shape == tensor.shape and torch.equal(g.weights[name], tensor)):
        name, k = f"{stem}_{k}", k + 1
    if name not in g.params:
        g.add_param(name, TensorType(tuple(tensor.shape), DTYPE_NAMES[tensor.dtype]), tensor)
    return name


# -- the columns a head tensor holds ----------------------------------------------------------
def projection(g: Graph, prod: dict, value: str) -> tuple[str, str, str | None] | None:
    """(x, weight, bias) when `value` is a linear's output over param weights."""
    n = prod.get(value)
    if n is not None and n.op == "linear" and set(n.inputs[1:]) <= set(g.params):
        return n.inputs[0], n.inputs[1], n.inputs[2] if len(n.inputs) > 2 else None
    if not _aten(n, "aten.linear.default") or n.attrs["kwargs"]:
        return None
    x, weight, bias = (_resolve(a, n.inputs) for a in (n.attrs["args"] + [None])[:3])
    return (x, weight, bias) if {weight, bias} - {None} <= set(g.params) else None


def _resolve(a, inputs: list[str]):
    return inputs[a["$in"]] if isinstance(a, dict) and "$in" in a else a


def column_source(g: Graph, prod: dict, value: str) -> str | None:
    """The [1, tokens, F] tensor whose features `value` selects: walking back through selections
    that keep the token axis whole, up to a projection's output (or as far as they go)."""
    found, cur = None, value
    while _one_token_axis(g.type_of(cur)):
        t = g.type_of(cur)
        if t.rank == 3 and t.shape[0] == 1 and isinstance(t.shape[2], int):
            found = cur
            if projection(g, prod, cur) is not None:
                return cur
        n = prod.get(cur)
        if not _aten(n, *SELECTIONS) or not n.inputs or n.attrs["args"][:1] != [{"$in": 0}]:
            return found
        cur = n.inputs[0]
    return None


def _one_token_axis(t: TensorType) -> bool:
    """Exactly one dim counts the tokens, so a selection over the other dims acts per token."""
    return [d for d in t.shape if isinstance(d, str)] == [TOKENS]


def feature_columns(g: Graph, source: str, value: str) -> torch.Tensor | None:
    """The column of `source` behind each feature of `value` ([1, tokens, F], or a head tensor
    [1, heads, tokens, hd] or [1, tokens, heads, hd], heads-major); found by running the selection
    ops on column numbers for one token. None when the selection depends on the token or its
    position (two different ones give different columns): then it is no fixed column layout."""
    shape = g.type_of(value).shape
    if shape[:1] != (1,) or not all(isinstance(d, int) for d in shape if d != TOKENS):
        return None
    features = g.type_of(source).shape[-1]
    numbers = torch.arange(features, dtype=torch.float64).reshape(1, 1, features)
    sub = subgraph_for(g, {value}, frozenset({source}))
    columns = [interpret(sub, {"input_ids": torch.tensor([token]), "positions": torch.tensor([position]),
                               source: numbers}, want=[value])[value].reshape(-1)  # memory order: heads-major
               for token, position in ((0, 0), (1, 7))]
    return columns[0].round().long() if torch.equal(*columns) else None


def subgraph_for(g: Graph, values: set[str], given: frozenset[str] = frozenset()) -> Graph:
    """The nodes `values` depend on, not through the `given` values (which the caller supplies):
    evaluating a few values this way skips the model's real work."""
    prod = g.producers()
    needed, stack = set(), list(values)
    while stack:
        v = stack.pop()
        n = prod.get(v)
        if v not in given and n is not None and n.name not in needed:
            needed.add(n.name)
            stack.extend(n.inputs)
    sub = Graph(g.name)
    sub.inputs, sub.params, sub.weights = g.inputs, g.params, g.weights
    sub.nodes = [n for n in g.nodes if n.name in needed]
    return sub


def raise_column_splits(g: Graph) -> int:
    """Each output of a last-dim chunk, split or slice of a projection (Phi-3's gate_up chunk,
    GPT-2's qkv split) -> a linear projecting just its columns."""
    prod, count = g.producers(), 0
    for n in list(g.nodes):
        if not _aten(n, *SPLITS) or projection(g, prod, n.inputs[0]) is None:
            continue
        args, position = n.attrs["args"], SPLITS[n.attrs["target"]]
        if (args[position] if position < len(args) else n.attrs["kwargs"].get("dim", 0)) not in (-1, 2):
            continue
        for v in n.outputs:
            flat = flat_heads(g, prod, v.name)
            if flat is not None and flat[2]:
                g.insert_before(n, flat[2][0])
                g.replace_uses(v.name, flat[0])
                count += 1
    return count


def flat_heads(g: Graph, prod: dict, value: str, role: str | None = None) -> tuple[str, TensorType, list[Node]] | None:
    """A [1, tokens, heads * hd] value holding the head tensor `value`'s features in head-major
    order, its type, and the nodes (a column-picking linear) to insert for it; None when its
    features cannot be traced to a projection's columns."""
    source = column_source(g, prod, value)
    columns = None if source is None else feature_columns(g, source, value)
    if columns is None:
        return None
    features = g.type_of(source).shape[-1]
    if torch.equal(columns, torch.arange(features)):
        return source, g.type_of(source), []
    proj = projection(g, prod, source)
    if proj is None or int(columns.min()) < 0 or int(columns.max()) >= features:
        return None
    x, weight, bias = proj
    role = role or f"columns_{int(columns[0])}_{int(columns[-1]) + 1}"
    base = weight.removesuffix(".weight")
    inputs = [x, new_param(g, f"{base}.{role}.weight", g.weights[weight].index_select(0, columns))]
    if bias is not None:
        inputs.append(new_param(g, f"{base}.{role}.bias", g.weights[bias].index_select(0, columns)))
    t = g.type_of(source)
    out = TensorType(t.shape[:-1] + (len(columns),), t.dtype)
    node = g.make_node("linear", inputs, [out], name=g.fresh(f"{role}_proj"))
    return node.outputs[0].name, out, [node]
