"""Load-time verification of an untrusted plan: every step names an op of this llmc with attrs its
spec allows (aten fallbacks: allow-listed pure tensor ops whose arguments fit the op's schema), and
the plan's declared types hold: params match the weights, each step's outputs are what its inputs
give (type rules for LLM ops, a run on meta tensors for aten fallbacks), and no value is larger than
MAX_VALUE_BYTES at the plan's max_tokens. A failure is an ArtifactError naming the step."""

from __future__ import annotations

import re
from typing import Any

import torch

from llmc.codegen.ort.onnx_weights import TRANSFORMS
from llmc.codegen.plan import ORT_SEGMENT, RECOMPILE, Plan, PlanStep
from llmc.compiler.ir import DTYPE_BYTES, TensorType, eval_dim
from llmc.compiler.ops import (
    ATTENTION_OPS,
    DTYPE_NAMES,
    OPS,
    TORCH_DTYPES,
    decode_arg,
    resolve_allowed_aten,
    runtime_refusal,
)
from llmc.errors import ArtifactError, IRError

MAX_VALUE_BYTES = 1 << 40     # one activation at max_tokens; far above any model's, far below a runaway shape


def check_plan(plan: Plan, weights: dict[str, torch.Tensor]) -> None:
    """Raise ArtifactError naming the first step (or param, or value) of `plan` that this runtime
    must not run; see the module docstring for what is checked."""
    _check_meta(plan.meta)
    types = declared_types(plan)
    _check_params(plan, types, weights)
    for index, step in enumerate(plan.steps):
        if step.kernel == ORT_SEGMENT:
            _check_segment(index, step, plan)
        for inner in step.inner_steps() or [step]:
            _check_step(index, inner, types)
    _check_sizes(plan, types)
    for binding in _bindings(types):
        _check_types(plan, types, binding)
    _check_layers(plan)


def _fail(what: str, why: str) -> ArtifactError:
    return ArtifactError(f"{what}: {why}; {RECOMPILE}")


_SCALE_PARAMS = re.compile(r"[\w.]*\{layer\}[\w.]*")


def _check_meta(meta: dict) -> None:
    """The plan.meta fields the runtime reads: the KV cache's dtype and where its scales are."""
    kv = meta.get("kv_cache")
    if kv is not None and not (isinstance(kv, dict) and kv.get("dtype") in tuple(TORCH_DTYPES)
                               and _SCALE_PARAMS.fullmatch(str(kv.get("scale_params", "{layer}")))):
        raise _fail("plan.json meta.kv_cache", f"{kv!r:.80} is not {{dtype: a dtype name, scale_params: "
                                               f"a param name with {{layer}}}}")
    if meta.get("kv_dtype") not in (None, *TORCH_DTYPES):
        raise _fail("plan.json meta.kv_dtype", f"{meta.get('kv_dtype')!r:.60} is no dtype name")


def declared_types(plan: Plan) -> dict[str, TensorType]:
    """The type plan.json declares for every value, checked to cover every value a step touches."""
    types = {name: TensorType(tuple(t["shape"]), t["dtype"]) for name, t in plan.types.items()}
    for name in [*plan.params, *plan.inputs, *plan.outputs]:
        if name not in types:
            raise _fail("plan.json", f"value {name!r} has no declared type")
    for index, step in enumerate(plan.steps):
        for s in [step, *step.inner_steps()]:
            missing = [v for v in s.inputs + s.outputs if v not in types]
            if missing:
                raise _fail(step.where(index), f"value {missing[0]!r} has no declared type")
    return types


def _check_params(plan: Plan, types: dict[str, TensorType], weights: dict[str, torch.Tensor]) -> None:
    for name in plan.params:
        w = weights.get(name)
        if w is None:
            continue  # the executor names every missing weight at once
        actual = TensorType(tuple(w.shape), DTYPE_NAMES.get(w.dtype, "symint"))
        if actual != types[name]:
            raise _fail(f"plan.json param {name!r}", f"declared {types[name]}, the weights file holds {actual}")


def _check_segment(index: int, step: PlanStep, plan: Plan) -> None:
    """An ONNX Runtime segment reads and gives exactly what the cpu steps it stands for read from
    and give to the rest of the plan, holds no attention, and makes its initializers from params
    those steps read by transforms this llmc has."""
    where, inner = step.where(index), step.inner_steps()
    defined = [o for s in inner for o in s.outputs]
    reads = list(dict.fromkeys(i for s in inner for i in s.inputs if i not in defined and i not in plan.params))
    if reads != step.inputs or not set(step.outputs) <= set(defined) or len(set(defined)) != len(defined):
        raise _fail(where, f"reads {step.inputs} and gives {step.outputs}, but its steps read {reads} and "
                           f"define {defined}")
    attention = [s.node for s in inner if s.kernel.partition(".")[2] in ATTENTION_OPS]
    if attention:
        raise _fail(where, f"holds attention step {attention[0]!r}, which runs in torch over the KV cache")
    params = {i for s in inner for i in s.inputs if i in plan.params}
    for name, (param, transform) in step.attrs["initializers"].items():
        if param not in params or transform not in TRANSFORMS:
            raise _fail(where, f"initializer {name!r} is made from {param!r} by {transform!r}: not a param its "
                               f"steps read, or no transform of this llmc ({', '.join(TRANSFORMS)})")


def _check_step(index: int, step: PlanStep, types: dict[str, TensorType]) -> None:
    ns, _, op = step.kernel.partition(".")
    attrs = {k: v for k, v in step.attrs.items() if k != "kernels"}
    why = runtime_refusal(op, attrs, [types[i] for i in step.inputs])
    if why:
        raise _fail(step.where(index), why)


def _symbols(types: dict[str, TensorType]) -> list[str]:
    return sorted({s for t in types.values() for d in t.shape if isinstance(d, str)
                   for s in re.findall(r"[A-Za-z_]\w*", d)})


def _bindings(types: dict[str, TensorType]) -> list[dict[str, int]]:
    """Two bindings of the symbolic dims with distinct values each, so a step whose declared types
    hold for one batch size only is caught."""
    symbols = _symbols(types)
    return [{s: 2 + i for i, s in enumerate(symbols)}, {s: 5 + 2 * i for i, s in enumerate(symbols)}]


def concrete(t: TensorType, binding: dict[str, int], what: str) -> TensorType:
    """`t` with its symbolic dims evaluated under `binding`."""
    try:
        shape = tuple(eval_dim(d, binding) for d in t.shape)
    except (IRError, RecursionError, ValueError) as e:
        raise _fail(what, f"type {t} has a dim that is no expression over the batch sizes ({e})") from None
    if any(d < 0 for d in shape):
        raise _fail(what, f"type {t} has a negative dim for batch sizes {binding}")
    return TensorType(shape, t.dtype)


def _check_types(plan: Plan, types: dict[str, TensorType], binding: dict[str, int]) -> None:
    """Walk the plan at one binding: each step's outputs must have the types it declares."""
    known = {n: concrete(types[n], binding, f"plan.json value {n!r}") for n in [*plan.params, *plan.inputs]}
    sizes: dict[str, int] = {}     # symbolic ints the aten fallbacks compute (sym_size), by value name
    for index, step in enumerate(plan.steps):
        for inner in step.inner_steps() or [step]:   # a segment's values are its steps'
            _walk_step(inner, step.where(index), types, binding, known, sizes)
    undefined = [o for o in plan.outputs if o not in known]
    if undefined:
        raise _fail("plan.json outputs", f"{undefined[0]!r} is defined by no step")


def _walk_step(step: PlanStep, where: str, types: dict[str, TensorType], binding: dict[str, int],
               known: dict[str, TensorType], sizes: dict[str, int]) -> None:
    """Infer one step's output types from the known types of its inputs, check them against the
    declared ones and make them known."""
    undefined = [i for i in step.inputs if i not in known]
    if undefined:
        raise _fail(where, f"reads {undefined[0]!r} before any step defines it")
    ins = [known[i] for i in step.inputs]
    op = step.kernel.partition(".")[2]
    got = _meta_outputs(step, ins, sizes, where) if op == "aten" else _inferred(op, step, ins, where)
    declared = [concrete(types[o], binding, where) for o in step.outputs]
    if got != declared:
        raise _fail(where, f"declares outputs {[str(t) for t in declared]}, its inputs give "
                           f"{[str(t) for t in got]} (at batch sizes {binding})")
    for name, t in zip(step.outputs, declared):
        if name in known:
            raise _fail(where, f"defines {name!r} a second time")
        known[name] = t


def _inferred(op: str, step: PlanStep, ins: list[TensorType], where: str) -> list[TensorType]:
    try:
        return OPS[op].infer(ins, step.attrs)
    except IRError as e:
        raise _fail(where, str(e)) from None


def _meta_outputs(step: PlanStep, ins: list[TensorType], sizes: dict[str, int], where: str) -> list[TensorType]:
    """Run the aten fallback on meta tensors of its input types (no memory is touched) and return
    the types of what it gives; symbolic ints it computes are kept in `sizes` for later steps."""
    values = [sizes.get(name) if t.dtype == "symint" else
              torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device="meta")
              for name, t in zip(step.inputs, ins)]
    if any(v is None for v in values):
        raise _fail(where, "reads a symbolic int that no aten fallback computed")
    target = step.attrs["target"]
    try:
        fn = resolve_allowed_aten(target)
        out = fn(*decode_arg(step.attrs["args"], values, torch.device("meta")),
                 **{k: decode_arg(a, values, torch.device("meta")) for k, a in step.attrs["kwargs"].items()})
    except Exception as e:  # noqa: BLE001 - any failure of an untrusted call on meta tensors refuses the plan
        message = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise _fail(where, f"{target} does not run on its declared inputs ({type(e).__name__}: {message})") from None
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    types = [_value_type(v, where) for v in outs]
    sizes.update({name: v for name, v in zip(step.outputs, outs) if type(v) is int})
    return types


def _value_type(value: Any, where: str) -> TensorType:
    if isinstance(value, torch.Tensor) and value.dtype in DTYPE_NAMES:
        return TensorType(tuple(value.shape), DTYPE_NAMES[value.dtype])
    if type(value) is int:
        return TensorType((), "symint")
    raise _fail(where, f"the aten fallback gives a {type(value).__name__} "
                       f"{getattr(value, 'dtype', '')}, which no plan value can hold")


def _check_sizes(plan: Plan, types: dict[str, TensorType]) -> None:
    binding = {s: plan.max_tokens for s in _symbols(types)}
    for name, t in types.items():
        nbytes = _numel(concrete(t, binding, f"plan.json value {name!r}")) * DTYPE_BYTES[t.dtype]
        if nbytes > MAX_VALUE_BYTES:
            raise _fail(f"plan.json value {name!r}", f"type {t} takes {nbytes:,} bytes at {plan.max_tokens} batched "
                                                     f"tokens, over the {MAX_VALUE_BYTES:,} a value may take")


def _numel(t: TensorType) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def _check_layers(plan: Plan) -> None:
    """Attention steps index the KV cache by their `layer` attr: 0, 1, ... once each."""
    layers = sorted(s.attrs["layer"] for s in plan.attention_steps())
    if layers != list(range(len(layers))):
        raise _fail("plan.json", f"attention steps use KV-cache layers {layers[:8]}{' ...' if len(layers) > 8 else ''}"
                                 f", not 0..{len(layers) - 1} once each")


__all__ = ["MAX_VALUE_BYTES", "check_plan", "declared_types", "concrete"]
