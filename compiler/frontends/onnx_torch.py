"""An ONNX decoder graph as a torch module: each ONNX node runs as the torch call that computes it,
so torch.export records an aten graph and the ONNX model goes through the same tracing, lowering
and fail-closed `refuse_unlowered` checks as a Hugging Face checkpoint.

Why not import ONNX straight into the IR: lowering's patterns, its evaluated mask classification and
its refusals are written against aten graphs; raising ONNX into aten keeps one set of them. Shape
arithmetic (Shape -> Gather -> Concat -> Reshape) runs in Python on torch's symbolic sizes (`Sym`),
so the token dim stays dynamic and no shape tensor reaches the graph. A few rewrites turn what the
exporter decomposed back into the forms lowering raises (`plan_steps`): MatMul by a weight -> linear,
1/sqrt -> rsqrt, the SDPA decomposition's split scale and [B*H, T, D] key transpose -> one scale and
transpose(-2, -1), where(isnan(softmax), 0, softmax) -> _safe_softmax, x * sigmoid(x) -> silu. Each rewrite is exact
algebra (for scores without NaN; the key transpose checks its shapes when it runs and otherwise
computes the original nodes).
Weights stored as float16 are widened, and the graph computes in float32."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch.fx.experimental.symbolic_shapes import statically_known_true

from llmc.compiler.frontends.onnx_contrib import (
    CONTRIB_DOMAIN,
    CONTRIB_OPS,
    PREPARE,
    fold_head_norms,
    fold_rotary,
    split_packed_qkv,
)
from llmc.errors import UnsupportedModelError

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
ONNX_DTYPES = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float32,
               onnx.TensorProto.BFLOAT16: torch.float32, onnx.TensorProto.DOUBLE: torch.float32,
               onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32,
               onnx.TensorProto.INT8: torch.int8, onnx.TensorProto.UINT8: torch.uint8,
               onnx.TensorProto.BOOL: torch.bool}
SMALL_CONST = 64  # int initializers up to this many elements are shape data, kept in Python


@dataclass
class Sym:
    """A small constant or shape value held in Python: ints (maybe symbolic), floats or bools."""
    values: list
    scalar: bool
    dtype: torch.dtype

    def item(self):
        return self.values[0]


@dataclass
class Step:
    op: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    fallback: list = field(default_factory=list)  # original steps, run when a rewrite's check fails


def sym_of(array: np.ndarray) -> Sym:
    dtype = torch.from_numpy(np.zeros(0, array.dtype)).dtype
    return Sym([v.item() for v in array.reshape(-1)], array.ndim == 0, ONNX_WIDE.get(dtype, dtype))


def small_const(array: np.ndarray) -> bool:
    """Shape data and scalars, kept in Python: ints of rank <= 1, and float or bool scalars."""
    return array.ndim <= 1 and array.size <= SMALL_CONST and (array.dtype.kind in "iu" or array.size == 1)


ONNX_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float64: torch.float32}


def _attr(a: onnx.AttributeProto):
    if a.type == onnx.AttributeProto.TENSOR:
        return numpy_helper.to_array(a.t)
    return onnx.helper.get_attribute_value(a)


def _steps(graph: onnx.GraphProto, module) -> list[Step]:
    steps = []
    for i, n in enumerate(graph.node):
        step = Step(n.op_type, n.name or f"node_{i}", list(n.input), list(n.output),
                    {a.name: _attr(a) for a in n.attribute})
        contrib = n.domain == CONTRIB_DOMAIN
        if n.domain not in ("", "ai.onnx") and not (contrib and n.op_type in PREPARE):
            raise UnsupportedModelError(f"ONNX node '{step.name}' is op {n.domain}::{n.op_type}, which llmc "
                                        f"cannot read; export with standard ONNX ops (torch.onnx.export) or the "
                                        f"contrib ops of ONNX Runtime GenAI's model builder that llmc reads")
        if n.op_type not in OPS and not contrib:
            raise UnsupportedModelError(f"ONNX node '{step.name}' is op {n.op_type}, which llmc cannot read; "
                                        f"export the model without it")
        steps.append(PREPARE[n.op_type](step, module) if contrib or n.op_type in PREPARE else step)
    return fold_rotary(steps, module)


class OnnxGraphModule(torch.nn.Module):
    """Runs an ONNX graph on named torch inputs; its float initializers are this module's params,
    named from the initializer names."""

    def __init__(self, graph: onnx.GraphProto):
        super().__init__()
        self.consts: dict[str, Sym] = {}
        self.tensors: dict[str, np.ndarray] = {}
        for init in graph.initializer:
            array = numpy_helper.to_array(init)
            if small_const(array):
                self.consts[init.name] = sym_of(array)
            else:
                self.tensors[init.name] = array
        # the present KV outputs of a model-builder graph are its attention's, which llmc never reads
        self.outputs = [o.name for o in graph.output if not o.name.startswith("present")]
        self.elem_types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input)}
        self.graph_inputs = {i.name for i in graph.input}
        self.stored: dict[str, object] = {}      # tensor name -> its quantised form (onnx_contrib's MatMulNBits)
        self.rope_scaling: dict[str, float] = {}  # inv_freq tensor name -> its cos/sin scaling
        self.steps = plan_steps(_steps(graph, self), self)
        self.reads = {i for s in self.steps for i in (*s.inputs, *(i for f in s.fallback for i in f.inputs))}
        self._names: dict[tuple[str, bool], str] = {}
        self._used: set[str] = set()
        self._register_live()

    # -- params ---------------------------------------------------------------------------
    def _register_live(self):
        for step in self.steps:
            if step.op == "Linear":
                self.param(step.attrs["weight"], True)
            for i in [i for s in (step, *step.fallback) for i in s.inputs]:
                if i in self.tensors:
                    self.param(i, False)

    def param(self, name: str, transposed: bool) -> str:
        """The attribute path of initializer `name` (transposed: stored as its transpose)."""
        key = (name, transposed)
        if key not in self._names:
            array = self.tensors[name]
            tensor = torch.from_numpy(np.array(array.T if transposed else array))  # a writable copy
            tensor = tensor.float() if tensor.is_floating_point() else tensor
            path = self._free_path(name + (".T" if transposed and (name, False) in self._names else ""))
            *parents, leaf = path.split(".")
            owner = self
            for part in parents:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            if tensor.is_floating_point():
                owner.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
            else:
                owner.register_buffer(leaf, tensor)
            self._names[key] = path
        return self._names[key]

    def _free_path(self, name: str) -> str:
        parts = [re.sub(r"\W", "_", p) or "_" for p in name.split(".")]
        path = ".".join(parts)
        if any(path.startswith(u + ".") or u.startswith(path + ".") or u == path for u in self._used) \
                or parts[0] in ("steps", "consts", "tensors", "outputs", "training"):
            path = f"onnx_initializer_{len(self._used)}"
        self._used.add(path)
        return path

    def stored_quant(self, prefix: str) -> dict[str, object]:
        """The quantised forms of the weights kept as params, by param name (under `prefix`)."""
        return {prefix + self._names[(name, True)]: q for name, q in self.stored.items() if (name, True) in self._names}

    def tensor(self, name: str, transposed: bool = False) -> torch.Tensor:
        return operator.attrgetter(self._names[(name, transposed)])(self)

    # -- running ---------------------------------------------------------------------------
    def forward(self, feeds: dict[str, torch.Tensor], positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        env: dict[str, object] = dict(self.consts)
        env.update(feeds)
        env[""] = None
        ctx = RunContext(self, positions, env)
        for step in self.steps:
            run_step(ctx, env, step)
        return [as_tensor(env[o]) for o in self.outputs]


@dataclass
class RunContext:
    module: OnnxGraphModule
    positions: torch.Tensor | None   # the runtime's token positions, for a graph that counts them itself
    env: dict                        # value name -> torch tensor or Sym


def value(ctx: RunContext, env: dict, name: str):
    if name in env:
        return env[name]
    return ctx.module.tensor(name)


def run_step(ctx: RunContext, env: dict, step: Step) -> None:
    args = [value(ctx, env, i) if i else None for i in step.inputs]
    try:
        out = OPS[step.op](ctx, step, *args)
    except UnsupportedModelError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise UnsupportedModelError(f"ONNX node '{step.name}' (op {step.op}) failed: "
                                    f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                                    ) from e
    outs = out if isinstance(out, tuple) else (out,)
    for name, v in zip(step.outputs, outs):
        env[name] = v


# -- values -----------------------------------------------------------------------------
def as_tensor(v) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if v.scalar:  # aten.full: torch.tensor would leave a lifted constant and its copy in the graph
        return torch.full((), v.item(), dtype=v.dtype)
    if all(isinstance(x, (int, float, bool)) for x in v.values):
        t = torch.tensor(v.values, dtype=v.dtype)
    else:
        t = torch.stack([torch.scalar_tensor(x, dtype=v.dtype) for x in v.values])
    return t.reshape(()) if v.scalar else t


def ints(v) -> list:
    if isinstance(v, Sym):
        return list(v.values)
    if v is None:
        return []
    return [int(x) for x in v.reshape(-1).tolist()]


def scalar_like(v) -> bool:
    return isinstance(v, Sym) and len(v.values) == 1


def _elementwise(fn, a: Sym, b: Sym, dtype: torch.dtype) -> Sym:
    n = max(len(a.values), len(b.values))
    av = a.values * n if len(a.values) == 1 else a.values
    bv = b.values * n if len(b.values) == 1 else b.values
    return Sym([fn(x, y) for x, y in zip(av, bv)], a.scalar and b.scalar, dtype)


def _int_div(x, y):
    return x // y if (x >= 0) == (y > 0) or x % y == 0 else -(-x // y)


BINARY = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y,
          "Pow": lambda x, y: x ** y, "Equal": lambda x, y: x == y, "Less": lambda x, y: x < y,
          "LessOrEqual": lambda x, y: x <= y, "Greater": lambda x, y: x > y,
          "GreaterOrEqual": lambda x, y: x >= y, "And": lambda x, y: x & y, "Or": lambda x, y: x | y,
          "Max": lambda x, y: torch.maximum(x, y) if isinstance(x, torch.Tensor) else max(x, y),
          "Min": lambda x, y: torch.minimum(x, y) if isinstance(x, torch.Tensor) else min(x, y)}
COMPARISONS = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or"}
SCALAR_OK = {"Add", "Sub", "Mul", "Div", "Pow", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"}


def binary(ctx, step, a, b):
    op = step.op
    if isinstance(a, Sym) and isinstance(b, Sym):
        dtype = torch.bool if op in COMPARISONS else a.dtype
        if op == "Div":
            fn = _int_div if not a.dtype.is_floating_point else (lambda x, y: x / y)
            return _elementwise(fn, a, b, dtype)
        return _elementwise(BINARY[op], a, b, dtype)
    if op in ("And", "Or") and (scalar_like(a) or scalar_like(b)):
        flag, t = (a.item(), b) if scalar_like(a) else (b.item(), a)
        t = as_tensor(t)
        return t if bool(flag) == (op == "And") else (torch.ones_like if op == "Or" else torch.zeros_like)(t)
    if op in SCALAR_OK and (scalar_like(a) or scalar_like(b)) and not (op == "Pow" and scalar_like(a)):
        ta = a if isinstance(a, torch.Tensor) else a.item()
        tb = b if isinstance(b, torch.Tensor) else b.item()
        tensor = ta if isinstance(ta, torch.Tensor) else tb
        out = _tensor_binary(op, ta, tb, tensor.dtype)
        wider = isinstance(a, Sym) and not a.scalar or isinstance(b, Sym) and not b.scalar
        return out.reshape(1) if wider and out.dim() == 0 else out
    return _tensor_binary(op, as_tensor(a), as_tensor(b), None)


def _tensor_binary(op, a, b, dtype):
    if op == "Div":
        t = a if isinstance(a, torch.Tensor) else b
        if not t.is_floating_point():
            return torch.div(as_tensor_of(a, t), as_tensor_of(b, t), rounding_mode="trunc")
        return a / b
    if op in ("And", "Or"):
        return torch.logical_and(a, b) if op == "And" else torch.logical_or(a, b)
    return BINARY[op](a, b)


def as_tensor_of(x, like: torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=like.dtype)


def variadic(ctx, step, *args):
    out = args[0]
    for a in args[1:]:
        out = binary(ctx, step, out, a)
    return out


UNARY = {"Neg": torch.neg, "Abs": torch.abs, "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal,
         "Exp": torch.exp, "Log": torch.log, "Tanh": torch.tanh, "Sigmoid": torch.sigmoid, "Relu": torch.relu,
         "Erf": torch.erf, "Cos": torch.cos, "Sin": torch.sin, "Floor": torch.floor, "Ceil": torch.ceil,
         "IsNaN": torch.isnan, "Silu": F.silu, "IsInf": torch.isinf, "Not": torch.logical_not, "Rsqrt": torch.rsqrt}


def unary(ctx, step, x):
    if isinstance(x, Sym) and all(isinstance(v, (int, float, bool)) for v in x.values):
        out = UNARY[step.op](torch.tensor(x.values, dtype=x.dtype))
        return Sym(out.tolist(), x.scalar, out.dtype)
    if isinstance(x, Sym) and step.op == "Neg":
        return Sym([-v for v in x.values], x.scalar, x.dtype)
    return UNARY[step.op](as_tensor(x))


def cast(ctx, step, x):
    dtype = ONNX_DTYPES.get(step.attrs["to"])
    if dtype is None:
        raise UnsupportedModelError(f"ONNX node '{step.name}' (op Cast) casts to ONNX type {step.attrs['to']}, "
                                    f"which llmc does not compute in")
    return _cast_to(x, dtype)


def _cast_to(x, dtype):
    if isinstance(x, Sym):
        conv = bool if dtype == torch.bool else float if dtype.is_floating_point else int
        concrete = all(isinstance(v, (int, float, bool)) for v in x.values)
        return Sym([conv(v) if concrete or conv is not int else v for v in x.values], x.scalar, dtype)
    return x if x.dtype == dtype else x.to(dtype)


def cast_like(ctx, step, x, like):
    return _cast_to(x, like.dtype)


# -- shape ops ----------------------------------------------------------------------------
def shape(ctx, step, x):
    dims = list(x.shape)
    start, end = step.attrs.get("start", 0), step.attrs.get("end", len(dims))
    return Sym(dims[start:end], False, torch.int64)


def size(ctx, step, x):
    return Sym([x.numel()], True, torch.int64)


def constant(ctx, step):
    a = step.attrs
    if "value" in a:
        array = a["value"]
        if small_const(array):
            return sym_of(array)
        return torch.from_numpy(np.array(array)).float() if array.dtype.kind == "f" else \
            torch.from_numpy(np.array(array))
    for key, dtype, scalar in (("value_int", torch.int64, True), ("value_ints", torch.int64, False),
                               ("value_float", torch.float32, True), ("value_floats", torch.float32, False)):
        if key in a:
            return Sym([a[key]] if scalar else list(a[key]), scalar, dtype)
    raise UnsupportedModelError(f"ONNX node '{step.name}' (op Constant) has no value llmc reads")


def gather(ctx, step, data, indices):
    axis = step.attrs.get("axis", 0)
    if isinstance(data, Sym):
        picked = [data.values[i] for i in ints(indices)]
        return Sym(picked, isinstance(indices, Sym) and indices.scalar, data.dtype)
    if isinstance(indices, Sym):
        if indices.scalar:
            return data.select(axis, indices.item())
        return torch.index_select(data, axis, as_tensor(indices))
    if axis == 0 and data.dim() == 2 and data.is_floating_point():
        return F.embedding(indices, data)
    return data[(slice(None),) * (axis % data.dim()) + (indices,)]


def gather_nd(ctx, step, data, indices):
    if step.attrs.get("batch_dims", 0):
        raise UnsupportedModelError(f"ONNX node '{step.name}' (op GatherND) has batch_dims, which llmc cannot read")
    indices = as_tensor(indices)
    return data[tuple(indices.select(-1, i) for i in range(indices.shape[-1]))]


def _axes(step, given) -> list[int]:
    return ints(given) if given is not None else list(step.attrs.get("axes", []))


def unsqueeze(ctx, step, x, axes=None):
    axes = _axes(step, axes)
    if isinstance(x, Sym):
        if x.scalar and axes in ([0], [-1]):
            return Sym(x.values, False, x.dtype)
        x = as_tensor(x)
    rank = x.dim() + len(axes)
    for a in sorted(a % rank for a in axes):
        x = x.unsqueeze(a)
    return x


def squeeze(ctx, step, x, axes=None):
    axes = _axes(step, axes)
    if isinstance(x, Sym):
        if not x.scalar and len(x.values) == 1:
            return Sym(x.values, True, x.dtype)
        x = as_tensor(x)
    if not axes:
        return x.squeeze()
    for a in sorted((a % x.dim() for a in axes), reverse=True):
        x = x.squeeze(a)
    return x


def reshape(ctx, step, x, target):
    dims = ints(target)
    if isinstance(x, Sym):
        if len(dims) <= 1 and len(x.values) == 1:
            return Sym(x.values, not dims, x.dtype)
        x = as_tensor(x)
    if not step.attrs.get("allowzero", 0):
        dims = [x.shape[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def flatten(ctx, step, x):
    axis = step.attrs.get("axis", 1) % max(x.dim(), 1)
    return x.reshape(int(np.prod(x.shape[:axis])) if axis else 1, -1)


def transpose(ctx, step, x):
    perm = list(step.attrs.get("perm", reversed(range(x.dim()))))
    moved = [i for i, p in enumerate(perm) if p != i]
    if len(moved) == 2:  # a single swap, as model code writes it (lowering matches transpose.int)
        return x.transpose(*moved)
    return x.permute(perm)


def concat(ctx, step, *xs):
    xs = [x for x in xs if x is not None]
    if all(isinstance(x, Sym) for x in xs):
        return Sym([v for x in xs for v in x.values], False, xs[0].dtype)
    return torch.cat([as_tensor(x) for x in xs], dim=step.attrs["axis"])


def slice_(ctx, step, data, starts, ends, axes=None, steps=None):
    starts, ends = ints(starts), ints(ends)
    axes = ints(axes) if axes is not None else list(range(len(starts)))
    steps = ints(steps) if steps is not None else [1] * len(starts)
    if isinstance(data, Sym):
        (s, e, k), = zip(starts, ends, steps)
        return Sym(data.values[slice(s, e, k)], False, data.dtype)
    index = [slice(None)] * data.dim()
    for s, e, a, k in zip(starts, ends, axes, steps):
        if k <= 0:
            raise UnsupportedModelError(f"ONNX node '{step.name}' (op Slice) steps by {k}, which llmc cannot read")
        index[a % data.dim()] = slice(s, e, k)
    return data[tuple(index)]


def split(ctx, step, x, sizes=None):
    axis = step.attrs.get("axis", 0)
    sizes = ints(sizes) or list(step.attrs.get("split", []))
    if not sizes:
        n = step.attrs.get("num_outputs", len(step.outputs))
        return tuple(torch.tensor_split(x, n, dim=axis))
    return tuple(torch.split(x, sizes, dim=axis))


def expand(ctx, step, x, target):
    dims = ints(target)
    if isinstance(x, Sym):
        x = as_tensor(x)
    rank = max(x.dim(), len(dims))
    have = [1] * (rank - x.dim()) + list(x.shape)
    want = [1] * (rank - len(dims)) + dims
    out = [h if isinstance(w, int) and w == 1 else w for h, w in zip(have, want)]
    return (x if x.dim() == rank else x.reshape(have)).expand(out)


def range_(ctx, step, start, limit, delta):
    start, limit, delta = start.item(), limit.item(), delta.item()
    pos = ctx.positions
    tokens = ctx.env["input_ids"].shape[-1] if "input_ids" in ctx.env else None
    if pos is not None and start == 0 and delta == 1 and _same_size(limit, tokens):
        return pos  # a graph without position inputs counts positions itself; the runtime supplies them
    return torch.arange(start, limit, delta, dtype=torch.int64 if isinstance(start, int) else torch.float32)


def _same_size(a, b) -> bool:
    try:
        return statically_known_true(a == b) if isinstance(a == b, torch.SymBool) else bool(a == b)
    except ImportError:
        return bool(a == b)


def constant_of_shape(ctx, step, dims):
    value = step.attrs.get("value")
    fill = value.reshape(-1)[0].item() if value is not None else 0.0
    dtype = torch.from_numpy(np.zeros(0, value.dtype)).dtype if value is not None else torch.float32
    return torch.full(ints(dims), fill, dtype=ONNX_WIDE.get(dtype, dtype))


def where(ctx, step, cond, a, b):
    if all(isinstance(v, Sym) for v in (cond, a, b)):
        return _elementwise(lambda c, xy: xy[0] if c else xy[1], cond,
                            _elementwise(lambda x, y: (x, y), a, b, a.dtype), a.dtype)
    cond = as_tensor(cond)
    if scalar_like(a) and scalar_like(b):
        return torch.where(cond, a.item(), b.item()).to(a.dtype)
    return torch.where(cond, a.item() if scalar_like(a) else as_tensor(a),
                       b.item() if scalar_like(b) else as_tensor(b))


def cumsum(ctx, step, x, axis):
    if step.attrs.get("exclusive", 0) or step.attrs.get("reverse", 0):
        raise UnsupportedModelError(f"ONNX node '{step.name}' (op CumSum) is exclusive or reversed, "
                                    f"which llmc cannot read")
    return torch.cumsum(x, dim=axis.item())


def trilu(ctx, step, x, k=None):
    k = k.item() if k is not None else 0
    return torch.triu(x, k) if step.attrs.get("upper", 1) else torch.tril(x, k)


# -- compute ------------------------------------------------------------------------------
def matmul(ctx, step, a, b):
    return torch.matmul(as_tensor(a), as_tensor(b))


def linear(ctx, step, x, bias=None):
    return F.linear(x, ctx.module.tensor(step.attrs["weight"], True), None if bias is None else as_tensor(bias))


def linear_t(ctx, step, x, w):
    return F.linear(x, w)


def gemm(ctx, step, a, b, c=None):
    at = step.attrs
    if at.get("alpha", 1.0) != 1.0 or at.get("beta", 1.0) != 1.0:
        raise UnsupportedModelError(f"ONNX node '{step.name}' (op Gemm) scales by alpha or beta, "
                                    f"which llmc cannot read")
    a = a.T if at.get("transA", 0) else a
    w = b if at.get("transB", 0) else b.T
    return F.linear(a, w, None if c is None else as_tensor(c))


def scaled_matmul(ctx, step, a, b):
    return torch.matmul(a, b) * step.attrs["scale"]


def swap_last_two(ctx, step, x, target):
    """The SDPA decomposition's key transpose, reshape(transpose(reshape(k, [-1, T, D]), 1, 2), [B, H, D, T]):
    k.transpose(-2, -1) when the shapes say so, else the original three nodes."""
    merged, want = ints(value(ctx, ctx.env, step.fallback[0].inputs[1])), ints(target)
    if x.dim() == 4 and len(merged) == 3 and len(want) == 4 and all(
            _same_size(w, d) for w, d in zip(merged[1:] + want, [*x.shape[2:], *x.shape[:2], *x.shape[:1:-1]])):
        return x.transpose(-2, -1)
    for sub in step.fallback:
        run_step(ctx, ctx.env, sub)
    return ctx.env[step.outputs[0]]


def reduce(ctx, step, x, axes=None):
    axes = _axes(step, axes)
    keep = bool(step.attrs.get("keepdims", 1))
    if not axes:
        if step.attrs.get("noop_with_empty_axes", 0):
            return x
        axes = list(range(x.dim()))
    axes = [-1 if a % x.dim() == x.dim() - 1 else a % x.dim() for a in axes]
    if step.op == "ReduceMean":
        return torch.mean(x, dim=axes, keepdim=keep)
    if step.op == "ReduceSum":
        return torch.sum(x, dim=axes, keepdim=keep)
    fn = torch.amax if step.op == "ReduceMax" else torch.amin
    return fn(x, dim=axes, keepdim=keep)


def softmax(ctx, step, x):
    axis = step.attrs.get("axis", -1)
    axis = -1 if axis % x.dim() == x.dim() - 1 else axis
    if step.op == "SafeSoftmax":
        return torch.ops.aten._safe_softmax.default(x, axis)
    if step.op == "LogSoftmax":
        return torch.log_softmax(x, axis)
    return torch.softmax(x, axis)


def layer_norm(ctx, step, x, scale, bias=None):
    axis = step.attrs.get("axis", -1) % x.dim()
    return F.layer_norm(x, tuple(x.shape[axis:]), scale, None if bias is None else as_tensor(bias),
                        step.attrs.get("epsilon", 1e-5))


def gelu(ctx, step, x):
    return F.gelu(x, approximate=step.attrs.get("approximate", "none"))


def identity(ctx, step, x, *rest):
    return x


OPS = {**dict.fromkeys(("Add", "Sub", "Mul", "Div", "Pow", "Equal", "Less", "LessOrEqual", "Greater",
                        "GreaterOrEqual", "And", "Or"), binary),
       **dict.fromkeys(("Max", "Min"), variadic), **dict.fromkeys(UNARY, unary),
       **dict.fromkeys(("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"), reduce),
       **dict.fromkeys(("Softmax", "LogSoftmax", "SafeSoftmax"), softmax),
       "Cast": cast, "CastLike": cast_like, "Shape": shape, "Size": size, "Constant": constant, "Gather": gather,
       "GatherND": gather_nd, "Unsqueeze": unsqueeze, "Squeeze": squeeze, "Reshape": reshape, "Flatten": flatten,
       "Transpose": transpose, "Concat": concat, "Slice": slice_, "Split": split, "Expand": expand,
       "Range": range_, "ConstantOfShape": constant_of_shape, "Where": where, "CumSum": cumsum, "Trilu": trilu,
       "MatMul": matmul, "Gemm": gemm, "Linear": linear, "LinearT": linear_t, "ScaledMatMul": scaled_matmul,
       "SwapLastTwo": swap_last_two, "LayerNormalization": layer_norm, "Gelu": gelu,
       "Identity": identity, "Dropout": identity, **CONTRIB_OPS}


# -- rewrites -----------------------------------------------------------------------------
def plan_steps(steps: list[Step], module: OnnxGraphModule) -> list[Step]:
    """The rewrites of the module docstring (and onnx_contrib's folds of per-head norms into attention
    and split of a packed qkv projection), then only the steps the graph outputs need."""
    steps = fold_constants(steps, module)
    prod = {o: s for s in steps for o in s.outputs}
    const = module.consts

    def made_by(name, op):
        s = prod.get(name)
        return s if s is not None and s.op == op else None

    def scalar_const(name):
        c = const.get(name)
        return c.item() if c is not None and len(c.values) == 1 and isinstance(c.item(), float) else None

    def weight(name):
        return name in module.tensors and module.tensors[name].ndim == 2 and module.tensors[name].dtype.kind == "f"

    out = []
    for s in steps:
        new = s
        if s.op == "MatMul" and weight(s.inputs[1]):
            new = Step("Linear", s.name, s.inputs[:1], s.outputs, {"weight": s.inputs[1]})
        elif s.op == "MatMul" and (t := made_by(s.inputs[1], "Transpose")) and weight(t.inputs[0]) \
                and list(t.attrs.get("perm", [1, 0])) == [1, 0]:
            new = Step("LinearT", s.name, [s.inputs[0], t.inputs[0]], s.outputs)
        elif s.op == "MatMul":
            ma, mb = made_by(s.inputs[0], "Mul"), made_by(s.inputs[1], "Mul")
            sa = _scaled(ma, scalar_const)
            sb = _scaled(mb, scalar_const)
            if sa and sb:
                new = Step("ScaledMatMul", s.name, [sa[0], sb[0]], s.outputs, {"scale": sa[1] * sb[1]})
        elif s.op == "Mul" and (sig := made_by(s.inputs[1], "Sigmoid") or made_by(s.inputs[0], "Sigmoid")) \
                and sig.inputs[0] in s.inputs and sig.outputs[0] != sig.inputs[0]:
            new = Step("Silu", s.name, sig.inputs, s.outputs)
        elif s.op in ("Add", "Sub") and (zero := _plus_zero(s, const)) is not None:
            new = Step("Identity", s.name, [zero], s.outputs)  # cache_position = arange + 0 past tokens
        elif s.op == "Reciprocal" and (sq := made_by(s.inputs[0], "Sqrt")):
            new = Step("Rsqrt", s.name, sq.inputs, s.outputs)
        elif s.op == "Where" and (nan := made_by(s.inputs[0], "IsNaN")) and s.inputs[2] == nan.inputs[0] \
                and (sm := made_by(s.inputs[2], "Softmax")) and scalar_const(s.inputs[1]) == 0.0:
            new = Step("SafeSoftmax", s.name, sm.inputs, s.outputs, sm.attrs)
        elif s.op == "Reshape" and (tr := made_by(s.inputs[0], "Transpose")) \
                and list(tr.attrs.get("perm", [])) == [0, 2, 1] and (rs := made_by(tr.inputs[0], "Reshape")):
            new = Step("SwapLastTwo", s.name, [rs.inputs[0], s.inputs[1]], s.outputs, fallback=[rs, tr, s])
        out.append(new)
    return live(split_packed_qkv(fold_head_norms(out, module), module), module)


def _plus_zero(add: Step, const: dict) -> str | None:
    """x + 0, 0 + x or x - 0, with the zero an integer scalar (exact in every dtype) -> x."""
    for x, c in ((0, 1), (1, 0)) if add.op == "Add" else ((0, 1),):
        z = const.get(add.inputs[c])
        if z is not None and z.scalar and not z.dtype.is_floating_point and z.item() == 0 \
                and add.inputs[x] not in const:
            return add.inputs[x]
    return None


def fold_constants(steps: list[Step], module) -> list[Step]:
    """Compute the steps whose inputs are all Python constants (Constant nodes, shape data, scalar
    arithmetic) now, into module.consts, so the rewrites see scalars the exporter spelled as nodes."""
    consts, kept = module.consts, []
    ctx = RunContext(module, None, consts)
    for s in steps:
        x = consts.get(s.inputs[0]) if s.inputs else None
        like = module.elem_types.get(s.inputs[1]) if s.op == "CastLike" else None
        if x is not None and like in ONNX_DTYPES and s.inputs[1] not in consts:  # the exporter's value_info
            consts[s.outputs[0]] = _cast_to(x, ONNX_DTYPES[like])
            continue
        if s.op != "Range" and all(i in consts for i in s.inputs if i):
            out = OPS[s.op](ctx, s, *[consts.get(i) if i else None for i in s.inputs])
            if len(s.outputs) == 1 and isinstance(out, Sym):
                consts[s.outputs[0]] = out
                continue
        kept.append(s)
    return kept


def _scaled(mul: Step | None, scalar_const):
    if mul is None:
        return None
    for x, c in ((0, 1), (1, 0)):
        s = scalar_const(mul.inputs[c])
        if s is not None:
            return mul.inputs[x], s
    return None


def live(steps: list[Step], module) -> list[Step]:
    """The steps the graph outputs depend on, in order."""
    wanted = set(module.outputs)
    keep = set()
    for s in reversed(steps):
        if any(o in wanted for o in s.outputs):
            keep.add(id(s))
            wanted.update(s.inputs)
            for sub in s.fallback:
                wanted.update(sub.inputs)
    return [s for s in steps if id(s) in keep]
