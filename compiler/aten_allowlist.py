"""The aten ops an artifact may run as fallbacks: an explicit allow-list of pure tensor ops, and a
check of each call's JSON arguments against the op's schema. The compiler refuses to emit, and the
runtime refuses to load, anything else (files, storage, memory maps, random sources, in-place or out=
variants, ops outside the list); see docs/security.md."""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

import torch

from llmc.compiler.ir import TORCH_DTYPES

# Pure functional ops: their result depends only on their arguments, they write no tensor they are
# given, and they touch no file, storage, generator or process state.
_VIEWS = ("view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand",
          "expand_as", "slice", "select", "narrow", "cat", "stack", "split", "split_with_sizes", "chunk", "unbind",
          "flatten", "unflatten", "movedim", "contiguous", "clone", "alias", "detach", "flip", "roll", "repeat",
          "tril", "triu", "constant_pad_nd", "view_as", "reshape_as")
_POINTWISE = ("add", "sub", "rsub", "mul", "div", "neg", "abs", "pow", "sqrt", "rsqrt", "square", "exp", "exp2",
              "expm1", "log", "log1p", "log2", "reciprocal", "sign", "floor", "ceil", "round", "trunc", "frac",
              "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum", "fmod", "remainder", "floor_divide",
              "lerp", "addcmul", "addcdiv", "where", "masked_fill", "erf", "erfc", "sin", "cos", "tan", "tanh",
              "asin", "acos", "atan", "atan2", "sinh", "cosh", "sigmoid", "relu", "relu6", "gelu", "silu",
              "softplus", "mish", "elu", "selu", "celu", "leaky_relu", "hardtanh", "hardsigmoid", "hardswish",
              "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
              "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "__and__", "__or__", "__xor__",
              "isnan", "isinf", "isfinite", "zeros_like", "ones_like", "full_like")
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "linalg_vector_norm",
               "argmax", "argmin", "cumsum", "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax",
               "logsumexp", "all", "any")
_LINEAR_ALGEBRA = ("matmul", "mm", "bmm", "linear", "addmm", "baddbmm", "einsum", "layer_norm",
                   "native_layer_norm", "rms_norm")
_CASTS_AND_SIZES = ("to", "_to_copy", "type_as", "sym_size", "sym_numel")
ALLOWED_ATEN = frozenset(_VIEWS + _POINTWISE + _REDUCTIONS + _LINEAR_ALGEBRA + _CASTS_AND_SIZES)

# Python arithmetic on symbolic sizes, as torch.export records it (operator.add on two SymInts).
SYMBOLIC_OPERATORS: dict[str, Callable] = {
    "operator.add": operator.add, "operator.sub": operator.sub, "operator.mul": operator.mul,
    "operator.floordiv": operator.floordiv, "operator.neg": operator.neg}

# The JSON encodings of non-JSON aten arguments (compiler/trace.py writes them).
ENCODED_DEVICES = ("cpu", "cuda")
ENCODED_LAYOUTS = ("strided",)
ENCODED_MEMORY_FORMATS = ("contiguous_format", "preserve_format", "channels_last")
MAX_INT = 1 << 62          # literal ints beyond this are no size, dim or scalar a model needs
MAX_STRING = 256


def target_refusal(target: Any) -> str | None:
    """Why the runtime would not run aten fallback `target` ("aten.<op>.<overload>"), or None."""
    if not isinstance(target, str):
        return f"aten target {target!r} is not a string"
    if target in SYMBOLIC_OPERATORS:
        return None
    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return f"aten target {target!r} is not of the form aten.<op>.<overload>"
    if parts[1] not in ALLOWED_ATEN:
        return f"aten target {target!r} is not an allowed pure tensor op"
    overload = _overload(parts[1], parts[2])
    if overload is None:
        return f"aten target {target!r} does not exist in this torch"
    schema = overload._schema
    writes = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    out_variant = parts[2] == "out" or parts[2].endswith("_out") or any(a.name == "out" for a in schema.arguments)
    if schema.is_mutable or writes or out_variant:
        return f"aten target {target!r} writes its arguments (in-place or out= variant)"
    return None


def _overload(op: str, overload: str):
    packet = getattr(torch.ops.aten, op, None)
    fn = getattr(packet, overload, None) if isinstance(packet, torch._ops.OpOverloadPacket) else None
    return fn if isinstance(fn, torch._ops.OpOverload) else None


def allowed_op(target: str) -> Callable:
    """The function an allowed target names (call target_refusal first)."""
    if target in SYMBOLIC_OPERATORS:
        return SYMBOLIC_OPERATORS[target]
    _, op, overload = target.split(".")
    return _overload(op, overload)


def call_refusal(target: str, args: Any, kwargs: Any, input_kinds: Sequence[str]) -> str | None:
    """Why the JSON `args`/`kwargs` of an allowed `target` do not fit its schema, or None.
    input_kinds[k] is "tensor" or "size" (a symbolic int) for the step's k-th input, what {"$in": k}
    stands for."""
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return f"{target}: args must be a JSON list and kwargs a JSON object"
    if target in SYMBOLIC_OPERATORS:
        arity = 1 if target == "operator.neg" else 2
        if len(args) != arity or kwargs:
            return f"{target} takes {arity} positional size arguments"
        why = next((w for w in (_int(a, input_kinds) for a in args) if w), None)
        return None if why is None else f"{target}: {why}"
    schema = allowed_op(target)._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        return f"{target} takes {len(positional)} positional arguments, the plan gives {len(args)}"
    given = {a.name: v for a, v in zip(positional, args)}
    by_name = {a.name: a for a in schema.arguments}
    for name, value in kwargs.items():
        if name not in by_name or name in given:
            return f"{target}: keyword argument {name!r} is {'given twice' if name in given else 'unknown'}"
        given[name] = value
    for a in schema.arguments:
        if a.name not in given:
            if not a.has_default_value():
                return f"{target}: required argument {a.name!r} is missing"
            continue
        why = _value_refusal(given[a.name], a.real_type, input_kinds)
        if why:
            return f"{target}: argument {a.name!r} ({a.real_type}): {why}"
    return None


def _value_refusal(value: Any, typ, input_kinds: Sequence[str]) -> str | None:
    """Why the JSON `value` is not a valid encoding of schema type `typ`."""
    kind = typ.kind()
    if kind == "OptionalType":
        return None if value is None else _value_refusal(value, typ.getElementType(), input_kinds)
    if kind == "ListType":
        if not isinstance(value, list):
            return f"{_show(value)} is not a list"
        return next((w for w in (_value_refusal(v, typ.getElementType(), input_kinds) for v in value) if w), None)
    check = _SCALAR_CHECKS.get(kind)
    if check is None:
        return f"arguments of type {typ} cannot come from an artifact"
    return check(value, input_kinds)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _ref(value: Any, input_kinds: Sequence[str], want: str) -> str | None:
    """None when `value` is {"$in": k} naming a step input of kind `want`, else why not."""
    k = value.get("$in") if len(value) == 1 else None
    if type(k) is not int or not 0 <= k < len(input_kinds):
        return f"{_show(value)} is no reference to one of the step's {len(input_kinds)} inputs"
    return None if input_kinds[k] == want else f"input {k} is a {input_kinds[k]}, not a {want}"


def _tensor(value, kinds):
    """A tensor input, or a Python number (torch wraps it, as in add.Tensor(x, 1.0))."""
    if isinstance(value, dict) and "$in" in value:
        return _ref(value, kinds, "tensor")
    return None if _number(value, kinds) is None else f"{_show(value)} is no tensor input or number"


def _int(value, kinds):
    if isinstance(value, dict):
        return _ref(value, kinds, "size")
    if type(value) is not int or abs(value) > MAX_INT:
        return f"{_show(value)} is not an int"
    return None


def encoded_float(value: Any) -> float | None:
    """The float {"$float": "1.5"} (or "nan", "inf") stands for, or None if `value` is no such encoding."""
    text = value.get("$float") if isinstance(value, dict) and len(value) == 1 else None
    if not isinstance(text, str) or len(text) > 40:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _float(value, kinds):
    if isinstance(value, dict):
        return None if encoded_float(value) is not None else f"{_show(value)} is not a float"
    if type(value) is float and math.isfinite(value) or type(value) is int and abs(value) <= MAX_INT:
        return None
    return f"{_show(value)} is not a finite float"


def _number(value, kinds):
    return None if type(value) is bool else _float(value, kinds)


def _encoded(key: str, allowed: Sequence[str]):
    def check(value, kinds):
        if isinstance(value, dict) and len(value) == 1 and value.get(key) in allowed:
            return None
        return f"{_show(value)} is not {{{key!r}: one of {', '.join(allowed)}}}"
    return check


def _dtype(value, kinds):
    return _encoded("$dtype", tuple(TORCH_DTYPES))(value, kinds)


_SCALAR_CHECKS: dict[str, Callable[[Any, Sequence[str]], str | None]] = {
    "TensorType": _tensor,
    "IntType": _int,
    "SymIntType": _int,
    "FloatType": _float,
    "NumberType": _number,
    "BoolType": lambda v, kinds: None if type(v) is bool else f"{_show(v)} is not a bool",
    "StringType": lambda v, kinds: (None if isinstance(v, str) and len(v) <= MAX_STRING
                                    else f"{_show(v)} is not a short string"),
    "ScalarTypeType": _dtype,
    "DeviceObjType": _encoded("$device", ENCODED_DEVICES),
    "LayoutType": _encoded("$layout", ENCODED_LAYOUTS),
    "MemoryFormatType": _encoded("$memory_format", ENCODED_MEMORY_FORMATS),
}


def aten_refusal(target: Any, args: Any, kwargs: Any, input_kinds: Sequence[str]) -> str | None:
    """Why an aten fallback call may not run (target_refusal, then call_refusal), or None."""
    return target_refusal(target) or call_refusal(target, args, kwargs, input_kinds)


__all__ = ["ALLOWED_ATEN", "SYMBOLIC_OPERATORS", "target_refusal", "call_refusal", "aten_refusal", "allowed_op",
           "encoded_float"]
