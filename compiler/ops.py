"""The LLM-level op set: for each op, its type rule and a plain-torch reference
implementation that defines its meaning (the interpreter and constant folding use it).

Layouts are token-major: activations are `[tokens, features]`, optionally with a
leading unit batch dim before lowering drops it. Attention-side tensors keep heads
flattened into the feature dim: q is `[tokens, num_heads * head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from llmc.compiler.aten_allowlist import (
    ENCODED_DEVICES,
    ENCODED_LAYOUTS,
    ENCODED_MEMORY_FORMATS,
    SYMBOLIC_OPERATORS,
    aten_refusal,
    encoded_float,
    target_refusal,
)
from llmc.compiler.ir import TORCH_DTYPES, Node, TensorType
from llmc.compiler.op_attrs import (
    BOOL,
    COUNT,
    EPS,
    INDEX,
    INT,
    LIST,
    OBJECT,
    SCALE,
    STRING,
    AttrSpec,
    list_of,
    object_of,
    one_of,
    optional,
)
from llmc.compiler.quant import (
    K_SUPER,
    KV_QMAX,
    fake_quant_fp8,
    fake_quant_int8_per_token,
    fake_quant_kv,
    fake_quant_kv_int4,
    kv_int4_group,
)
from llmc.compiler.schemes import (
    FLOAT_OFFSET,
    FP8_STATIC,
    INT8_PER_TOKEN,
    SCHEMES,
    dequantize_weight,
    kv_format,
    schemes_where,
)
from llmc.errors import IRError

DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Callable[[list[TensorType], dict], list[TensorType]] | None
    reference: Callable[..., list[torch.Tensor]]
    elementwise: bool = False
    attrs: AttrSpec = AttrSpec()
    inputs: tuple[int, int] = (1, 1)      # fewest and most inputs a node of the op takes


OPS: dict[str, OpDef] = {}


def op(name: str, infer=None, elementwise: bool = False, attrs: AttrSpec = AttrSpec(),
       inputs: int | tuple[int, int] = 1):
    """Register `fn` as the reference of op `name`, with its type rule, attr spec and input count."""
    def register(fn):
        counts = (inputs, inputs) if isinstance(inputs, int) else inputs
        OPS[name] = OpDef(name, infer, fn, elementwise, attrs, counts)
        return fn
    return register


def infer_types(node: Node, in_types: list[TensorType]) -> list[TensorType] | None:
    """Output types the op's rule gives, or None for ops without a rule (aten fallbacks)."""
    d = OPS.get(node.op)
    if d is None:
        raise IRError(f"node {node.name}: unknown op {node.op!r}; known ops: {sorted(OPS)}")
    return None if d.infer is None else d.infer(in_types, node.attrs)


def runtime_refusal(op: str, attrs: dict, in_types: list[TensorType]) -> str | None:
    """Why the runtime would refuse a node of `op` with these attrs and input types (an unknown op, a
    wrong number of inputs, an attr outside the op's spec, an aten fallback off the allow-list or with
    arguments that do not fit its schema), or None."""
    d = OPS.get(op)
    if d is None:
        return f"unknown op {op!r}"
    lo, hi = d.inputs
    if not lo <= len(in_types) <= hi:
        return f"{len(in_types)} inputs, where {op} takes {lo if lo == hi else f'{lo} to {hi}'}"
    why = d.attrs.refusal(attrs)
    if why or op != "aten":
        return why
    kinds = ["size" if t.dtype == "symint" else "tensor" for t in in_types]
    return aten_refusal(attrs["target"], attrs["args"], attrs["kwargs"], kinds)


# -- type rules ----------------------------------------------------------------------
# The rules check every input a kernel relies on, so a graph or plan that type-checks also runs.
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
INDEX_DTYPES = ("int64", "int32")
GROUP_PARAM_DTYPES = FLOAT_DTYPES + ("uint8",)   # a GGUF's K-quant params, packed (compiler/quant.py)
DTYPE = one_of(*TORCH_DTYPES)


def _want(t: TensorType, what: str, dtypes: tuple[str, ...] = FLOAT_DTYPES, rank: int | None = None,
          shape: tuple | None = None, min_rank: int = 0) -> None:
    """Raise IRError unless `t` has one of `dtypes` and the given rank or shape."""
    if (t.dtype not in dtypes or (rank is not None and t.rank != rank) or t.rank < min_rank
            or (shape is not None and tuple(t.shape) != tuple(shape))):
        want = f"[{', '.join(map(str, shape))}]" if shape is not None else f"rank {rank}" if rank is not None else (
            f"rank >= {min_rank}" if min_rank else "any shape")
        raise IRError(f"{what} is {t}, expected {' or '.join(dtypes)} of {want}")


def _float_same(ts, attrs):
    _want(ts[0], "input")
    return [ts[0]]


def _rms_norm_type(ts, attrs):
    x, weight = ts
    _want(x, "rms_norm input", min_rank=1)
    _want(weight, "rms_norm weight", shape=(x.shape[-1],))
    return [x]


def _broadcast(ts, attrs):
    a, b = ts[0].shape, ts[1].shape
    out = []
    for i in range(max(len(a), len(b))):
        da = a[len(a) - 1 - i] if i < len(a) else 1
        db = b[len(b) - 1 - i] if i < len(b) else 1
        if da != db and da != 1 and db != 1:
            raise IRError(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(db if da == 1 else da)
    dtype = ts[0].dtype if ts[0].rank >= ts[1].rank else ts[1].dtype
    return [TensorType(tuple(reversed(out)), dtype)]


def _embedding_type(ts, attrs):
    ids, w = ts
    _want(ids, "embedding ids", INDEX_DTYPES)
    _want(w, "embedding table", FLOAT_DTYPES, rank=2)
    return [TensorType(ids.shape + (w.shape[1],), w.dtype if not attrs.get("out_dtype") else attrs["out_dtype"])]


def _linear_type(ts, attrs):
    x, w = ts[0], ts[1]
    _want(x, "linear input", min_rank=1)
    _want(w, "linear weight", (x.dtype,), rank=2)
    if x.shape[-1] != w.shape[-1]:
        raise IRError(f"linear: input features {x.shape[-1]} differ from weight {list(w.shape)}")
    if attrs.get("out_features", w.shape[0]) != w.shape[0]:
        raise IRError(f"linear: out_features {attrs['out_features']} differs from weight {list(w.shape)}")
    if len(ts) == 3:
        _want(ts[2], "linear bias", (x.dtype,), shape=(w.shape[0],))
    return [TensorType(x.shape[:-1] + (w.shape[0],), x.dtype)]


def _rope_inputs(x, positions, inv_freq, head_dim: int, what: str) -> None:
    """x [..., tokens, heads * head_dim] rotated by the positions [tokens] and inv_freq [head_dim / 2]."""
    _want(x, f"{what} input", min_rank=2)
    if head_dim % 2 or x.shape[-1] % head_dim:
        raise IRError(f"{what}: head_dim {head_dim} must be even and divide the input's last dim ({x})")
    _want(positions, f"{what} positions", INDEX_DTYPES, shape=(x.shape[-2],))
    _want(inv_freq, f"{what} inv_freq", shape=(head_dim // 2,))


def _rope_type(ts, attrs):
    _rope_inputs(*ts, attrs["head_dim"], "rope")
    return [ts[0]]


def _kv_scales_type(ts, attrs, op: str) -> list:
    ts, scales = split_kv_scales(ts, attrs)
    if attrs.get("kv_cache") is not None and kv_format(attrs["kv_cache"]).grouped and attrs["head_dim"] % 2:
        raise IRError(f"{op}: an {attrs['kv_cache']} KV cache packs two channels a byte, and head_dim "
                      f"{attrs['head_dim']} is odd; compile with --kv-cache int8 or fp8")
    if scales is not None and (scales.shape != (2, attrs["num_kv_heads"]) or scales.dtype != "float32"):
        raise IRError(f"{op}: KV scales are {scales}, expected float32[2, {attrs['num_kv_heads']}] "
                      f"(keys, values per KV head)")
    return ts


def _attention_op_type(ts, attrs):
    ts = _kv_scales_type(ts, attrs, "attention")
    if len(ts) != 3:
        raise IRError(f"attention: {len(ts)} inputs besides KV scales, expected 3 (q, k, v)")
    return _attention_type(ts, attrs)


def _attention_type(ts, attrs):
    window = attrs.get("window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1
                               or attrs.get("causal", True) is not True):
        raise IRError(f"attention: window={window!r} must be None or a positive int, on causal attention")
    heads, kv_heads, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    if heads % kv_heads:
        raise IRError(f"attention: num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    q = ts[0]
    for name, t, n in zip("qkv", ts[:3], (heads, kv_heads, kv_heads)):
        _want(t, f"attention {name}", (q.dtype,), min_rank=2)
        if t.shape[-1] != n * hd or t.shape[:-1] != q.shape[:-1] or any(d != 1 for d in t.shape[:-2]):
            raise IRError(f"attention: {name} is {t}, expected [{', '.join(map(str, q.shape[:-1]))}, {n * hd}] "
                          f"({n} heads x {hd}, after unit leading dims)")
    return [TensorType(q.shape[:-1] + (heads * hd,), q.dtype)]


def _flash_attention_type(ts, attrs):
    ts = _kv_scales_type(ts, attrs, "flash_attention")
    rope = attrs.get("rope")
    if rope is not None and not (isinstance(rope, dict) and set(rope) == {"scaling"}):
        raise IRError(f"flash_attention: rope={rope!r} must be None or {{\"scaling\": float}}")
    names = ["q", "k", "v"] + (["positions", "inv_freq"] if rope is not None else [])
    if len(ts) != len(names):
        raise IRError(f"flash_attention: {len(ts)} inputs, expected {len(names)} ({', '.join(names)})")
    heads, kv_heads, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    if heads % kv_heads:
        raise IRError(f"flash_attention: num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    for name, t, n in zip(names, ts, (heads, kv_heads, kv_heads)):
        if t.shape[-1] != n * hd:
            raise IRError(f"flash_attention: {name} is {t}, expected last dim {n} heads x {hd}")
    if rope is not None:
        _rope_inputs(ts[0], ts[3], ts[4], hd, "flash_attention rope")
    return _attention_type(ts, attrs)


# -- reference semantics --------------------------------------------------------------
@op("embedding", _embedding_type, attrs=AttrSpec(optional={"out_dtype": DTYPE}), inputs=2)
def embedding_ref(ids, weight, **attrs):
    return [F.embedding(ids, weight)]


@op("rms_norm", _rms_norm_type, attrs=AttrSpec({"eps": EPS}), inputs=2)
def rms_norm_ref(x, weight, *, eps, **attrs):
    # Normalise in fp32 then cast back before the weight, as HF Llama does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return [weight * h.to(x.dtype)]


@op("linear", _linear_type, inputs=(2, 3),
    attrs=AttrSpec(optional={"out_features": COUNT, "packed": one_of(False), "smoothed": BOOL}))
def linear_ref(x, weight, bias=None, **attrs):
    return [F.linear(x, weight, bias)]


# -- qlinear: a linear over quantised weights (layouts in docs/quantization.md) --------------
# qweight's dtype and how many K columns one stored element holds, per scheme.
# affine4/affine8 (GGUF block formats kept as they are): w = q * s + m in groups of group_size
# along K, `zeros` holding the float minimum m; without it (has_zeros=false) w = q * s, and affine4
# codes are centred: w = (q - 8) * s. scales and zeros are float16 or float32 [N, K/g]
# (compiler/quant.py).
# The schemes themselves are compiler/schemes.py's rows.
QLINEAR_STORAGE = {s.name: (s.code_dtype, s.codes_per_element) for s in SCHEMES.values()}


class QLinearInputs(NamedTuple):
    x: Any
    qweight: Any
    scales: Any
    zeros: Any
    act_scale: Any
    bias: Any


def qlinear_inputs(inputs: list, attrs: dict) -> QLinearInputs:
    """Name qlinear's inputs `x, qweight, scales[, zeros][, act_scale][, bias]` (tensors or
    types) by its has_zeros / has_act_scale / has_bias attrs."""
    flags = [bool(attrs.get(k)) for k in ("has_zeros", "has_act_scale", "has_bias")]
    if len(inputs) != 3 + sum(flags):
        raise IRError(f"qlinear: {len(inputs)} inputs, but its has_zeros/has_act_scale/has_bias "
                      f"attrs {flags} call for {3 + sum(flags)}")
    rest = iter(inputs[3:])
    optional = [next(rest) if flag else None for flag in flags]
    return QLinearInputs(inputs[0], inputs[1], inputs[2], *optional)


def _qlinear_type(ts, attrs):
    scheme = attrs.get("scheme")
    if scheme not in QLINEAR_STORAGE:
        raise IRError(f"qlinear: unknown scheme {scheme!r}; known: {', '.join(QLINEAR_STORAGE)}")
    x, qweight = qlinear_inputs(ts, attrs)[:2]
    k, n = attrs["in_features"], attrs["out_features"]
    dtype, per_element = QLINEAR_STORAGE[scheme]
    if isinstance(x.shape[-1], int) and x.shape[-1] != k:
        raise IRError(f"qlinear: input features {x.shape[-1]} differ from in_features {k}")
    if qweight.dtype != dtype or tuple(qweight.shape) != (n, k // per_element):
        raise IRError(f"qlinear ({scheme}): qweight is {qweight}, expected {dtype}[{n}, {k // per_element}]")
    if SCHEMES[scheme].zeros_required and not attrs.get("has_zeros"):
        raise IRError(f"qlinear ({scheme}): {scheme} weights need zero points (has_zeros=true)")
    _want(x, "qlinear input", min_rank=1)
    _quant_params(ts, attrs, "qlinear", scheme, n, k, attrs.get("group_size", -1))
    return [TensorType(x.shape[:-1] + (n,), x.dtype)]


def _group_params_shape(t, scheme: str, rows: int, k: int, group_size: int) -> tuple[int, int]:
    """[rows, K/g] group params, or K-quant packed ones (uint8, affine schemes): [rows, 2 K/256 + K/g]."""
    if t is None or t.dtype != "uint8":
        return rows, k // group_size
    if SCHEMES[scheme].zero_point != FLOAT_OFFSET or k % K_SUPER or K_SUPER % group_size:
        raise IRError(f"packed (uint8) group params need an affine scheme, K a multiple of {K_SUPER} and groups "
                      f"dividing it; got {scheme} with K={k}, group_size={group_size}")
    return rows, 2 * (k // K_SUPER) + k // group_size


def _quant_params(ts, attrs, what: str, scheme: str, rows: int, k: int, group_size) -> None:
    """scales (and zeros, act_scale, bias) as docs/quantization.md lays them out for `rows` output
    channels over `k` inputs: one scale a row, or one a group of `group_size` along k for int4."""
    _, _, scales, zeros, act_scale, bias = qlinear_inputs(ts, attrs) if what == "qlinear" else (
        ts + [None] * (6 - len(ts)))
    if SCHEMES[scheme].grouped:
        if type(group_size) is not int or group_size <= 0 or k % group_size:
            raise IRError(f"{what} ({scheme}): group_size {group_size!r} must be a positive divisor of {k}")
        for name, t in (("scales", scales), ("zeros", zeros)):
            if t is not None or SCHEMES[scheme].zeros_required:
                _want(t, f"{what} ({scheme}) {name}", GROUP_PARAM_DTYPES if SCHEMES[scheme].gguf else FLOAT_DTYPES,
                      shape=_group_params_shape(t, scheme, rows, k, group_size))
    elif SCHEMES[scheme].per_tensor and scales.shape == (1,):
        _want(scales, f"{what} ({scheme}) scales", shape=(1,))
    else:
        _want(scales, f"{what} ({scheme}) scales", shape=(rows,))
    if act_scale is not None:
        _want(act_scale, f"{what} act_scale", shape=(1,))
    if bias is not None:
        _want(bias, f"{what} bias", shape=(rows,))


@op("qlinear", _qlinear_type, inputs=(3, 6), attrs=AttrSpec(
    {"scheme": one_of(*QLINEAR_STORAGE), "in_features": COUNT, "out_features": COUNT},
    {"group_size": INT, "has_zeros": BOOL, "has_act_scale": BOOL, "has_bias": BOOL, "smoothed": BOOL}))
def qlinear_ref(*inputs, scheme, **attrs):
    """Dequantise the weight and run F.linear in fp32, with fp8 (static scale) or per-token
    int8 (w8a8) fake quantisation of the activations."""
    x, qweight, scales, zeros, act_scale, bias = qlinear_inputs(list(inputs), attrs)
    weight = dequantize_weight(scheme, qweight, scales, zeros)
    h = x.float()
    activations = SCHEMES[scheme].activations
    if activations == FP8_STATIC and act_scale is not None:
        h = fake_quant_fp8(h, act_scale.float())
    elif activations == INT8_PER_TOKEN:
        h = fake_quant_int8_per_token(h)
    return [F.linear(h, weight, None if bias is None else bias.float()).to(x.dtype)]


# -- qembedding: a lookup in a quantised table, stored as qlinear stores its weight (rows are
# the output channels): int8 per-row scales, int4 packed nibbles with groups along the hidden dim.
QEMBEDDING_SCHEMES = schemes_where(qembedding=True)


def _qembedding_type(ts, attrs):
    scheme, dim = attrs.get("scheme"), attrs["embedding_dim"]
    if scheme not in QEMBEDDING_SCHEMES:
        raise IRError(f"qembedding: unknown scheme {scheme!r}; known: {', '.join(QEMBEDDING_SCHEMES)}")
    zeros_required = SCHEMES[scheme].zeros_required
    want_inputs = 4 if zeros_required or attrs.get("has_zeros") else 3
    if len(ts) != want_inputs:
        raise IRError(f"qembedding ({scheme}): {len(ts)} inputs, expected {want_inputs} "
                      f"(ids, qweight, scales{', zeros' if zeros_required else ''})")
    ids, qweight = ts[0], ts[1]
    dtype, per_element = QLINEAR_STORAGE[scheme]
    if qweight.dtype != dtype or qweight.rank != 2 or qweight.shape[1] != dim // per_element or dim % per_element:
        raise IRError(f"qembedding ({scheme}): qweight is {qweight}, expected {dtype}[vocab, {dim // per_element}]")
    _want(ids, "qembedding ids", INDEX_DTYPES)
    _quant_params(list(ts), attrs, "qembedding", scheme, qweight.shape[0], dim, attrs.get("group_size", -1))
    return [TensorType(ids.shape + (dim,), "float32")]


@op("qembedding", _qembedding_type, inputs=(3, 4), attrs=AttrSpec(
    {"scheme": one_of(*QEMBEDDING_SCHEMES), "embedding_dim": COUNT}, {"group_size": INT, "has_zeros": BOOL}))
def qembedding_ref(ids, qweight, scales, zeros=None, *, scheme, embedding_dim, **attrs):
    """Gather the rows of the codes, scales and zeros the ids select, then dequantise them (fp32)."""
    rows = ids.reshape(-1)
    pick = (lambda t: None if t is None else t.index_select(0, rows))
    out = dequantize_weight(scheme, pick(qweight), pick(scales), pick(zeros))
    return [out.reshape(*ids.shape, embedding_dim)]


@op("silu", _float_same, elementwise=True)
def silu_ref(x, **attrs):
    return [F.silu(x)]


@op("mul", _broadcast, elementwise=True, inputs=2)
def mul_ref(a, b, **attrs):
    return [a * b]


@op("add", _broadcast, elementwise=True, inputs=2)
def add_ref(a, b, **attrs):
    return [a + b]


# -- fused ops the fusion passes (passes/fuse_projections.py, fuse_elementwise.py) make ----------
def _split_type(ts, attrs):
    x, sizes = ts[0], attrs.get("sizes")
    if not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise IRError(f"split: sizes {sizes!r} must be a non-empty list of positive ints")
    if x.rank < 1 or sum(sizes) != x.shape[-1]:
        raise IRError(f"split: sizes {sizes} add up to {sum(sizes)}, the input is {x}")
    return [TensorType(x.shape[:-1] + (s,), x.dtype) for s in sizes]


@op("split", _split_type, attrs=AttrSpec({"sizes": list_of(COUNT)}))
def split_ref(x, *, sizes, **attrs):
    """Consecutive column blocks of x's last dim (a fused projection's q/k/v or gate/up)."""
    return list(torch.split(x, list(sizes), dim=-1))


def _add_rms_norm_type(ts, attrs):
    x, residual, weight = ts
    if x != residual:
        raise IRError(f"add_rms_norm: x is {x} and residual is {residual}; they must have one type")
    return _rms_norm_type([x, weight], attrs) * 2


@op("add_rms_norm", _add_rms_norm_type, attrs=AttrSpec({"eps": EPS}), inputs=3)
def add_rms_norm_ref(x, residual, weight, *, eps, **attrs):
    """[rms_norm(x + residual), x + residual]: the residual stream's add and the next norm."""
    summed = x + residual
    return [rms_norm_ref(summed, weight, eps=eps)[0], summed]


def _swiglu_type(ts, attrs):
    _want(ts[0], "swiglu input", min_rank=1)
    if len(ts) == 2:
        if ts[0] != ts[1]:
            raise IRError(f"swiglu: gate is {ts[0]} and up is {ts[1]}; they must have one type")
        return [ts[0]]
    if len(ts) != 1:
        raise IRError(f"swiglu: {len(ts)} inputs; it takes [gate_up] or [gate, up]")
    x = ts[0]
    if not isinstance(x.shape[-1], int) or x.shape[-1] % 2:
        raise IRError(f"swiglu: packed gate_up is {x}; its last dim must be an even number (2 * I)")
    return [TensorType(x.shape[:-1] + (x.shape[-1] // 2,), x.dtype)]


@op("swiglu", _swiglu_type, inputs=(1, 2))
def swiglu_ref(*inputs, **attrs):
    """silu(gate) * up; one packed input [..., 2I] holds gate in its first I columns, up in the last."""
    gate, up = inputs if len(inputs) == 2 else inputs[0].chunk(2, dim=-1)
    return [F.silu(gate) * up]


def _select_rows_type(ts, attrs):
    x, idx = ts
    _want(x, "select_rows input", tuple(TORCH_DTYPES), min_rank=1)
    _want(idx, "select_rows indices", INDEX_DTYPES, rank=1)
    return [TensorType(idx.shape[:1] + x.shape[1:], x.dtype)]


@op("select_rows", _select_rows_type, inputs=2)
def select_rows_ref(x, indices, **attrs):
    """x[indices]: keeps the rows (tokens) whose logits are needed."""
    return [x.index_select(0, indices)]


def _cast_type(ts, attrs):
    if attrs.get("dtype") not in tuple(TORCH_DTYPES):
        raise IRError(f"cast: dtype {attrs.get('dtype')!r} is not one of {', '.join(TORCH_DTYPES)}")
    return [TensorType(ts[0].shape, attrs["dtype"])]


@op("cast", _cast_type, attrs=AttrSpec({"dtype": DTYPE}))
def cast_ref(x, *, dtype, **attrs):
    """x converted to `dtype` (cast_bf16 puts these where a value changes precision)."""
    return [x.to(TORCH_DTYPES[dtype])]


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype):
    """cos/sin tables [tokens, head_dim] for the rotate-half (GPT-NeoX) convention."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x: [..., tokens, heads * head_dim]; cos/sin: [tokens, head_dim]."""
    shape = x.shape
    x = x.reshape(*shape[:-1], -1, head_dim)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    out = x * cos[:, None, :] + rotated * sin[:, None, :]
    return out.reshape(shape)


@op("rope", _rope_type, attrs=AttrSpec({"head_dim": COUNT}, {"scaling": SCALE}), inputs=3)
def rope_ref(x, positions, inv_freq, *, head_dim, scaling=1.0, **attrs):
    cos, sin = rope_cos_sin(positions.reshape(-1), inv_freq, scaling, x.dtype)
    return [apply_rope(x, cos, sin, head_dim)]


def _layer_norm_type(ts, attrs):
    x = ts[0]
    _want(x, "layer_norm input", min_rank=1)
    for name, t in zip(("weight", "bias"), ts[1:]):
        _want(t, f"layer_norm {name}", (x.dtype,), shape=(x.shape[-1],))
    return [x]


@op("layer_norm", _layer_norm_type, attrs=AttrSpec({"eps": EPS}), inputs=(1, 3))
def layer_norm_ref(x, weight=None, bias=None, *, eps, **attrs):
    """LayerNorm over the last dim, with an optional gain and bias (GPT-2, GPT-NeoX, OPT, OLMo)."""
    return [F.layer_norm(x, x.shape[-1:], weight, bias, eps)]


@op("gelu", _float_same, elementwise=True, attrs=AttrSpec(optional={"approximate": one_of("none", "tanh")}))
def gelu_ref(x, *, approximate="none", **attrs):
    """GELU, exact (erf) or its tanh approximation (GPT-2's gelu_new, Gemma's gelu_pytorch_tanh)."""
    return [F.gelu(x, approximate=approximate)]


def _qk_norm_type(ts, attrs):
    x, weight = ts
    _want(x, "qk_norm input", min_rank=1)
    if not isinstance(x.shape[-1], int) or x.shape[-1] % attrs["head_dim"]:
        raise IRError(f"qk_norm: head_dim {attrs['head_dim']} does not divide the input's last dim ({x})")
    _want(weight, "qk_norm weight", shape=(attrs["head_dim"],))
    return [x]


@op("qk_norm", _qk_norm_type, attrs=AttrSpec({"head_dim": COUNT, "eps": EPS}), inputs=2)
def qk_norm_ref(x, weight, *, head_dim, eps, **attrs):
    """RMS norm of each head of x [..., heads * head_dim] by one weight [head_dim] (Qwen3's q_norm
    and k_norm, applied after the head split and before rotary)."""
    heads = x.reshape(*x.shape[:-1], -1, head_dim)
    return [rms_norm_ref(heads, weight, eps=eps)[0].reshape(x.shape)]


def _partial_rope_type(ts, attrs):
    x, positions, inv_freq = ts
    head_dim, rotary_dim = attrs["head_dim"], attrs["rotary_dim"]
    if rotary_dim % 2 or not 0 < rotary_dim < head_dim:
        raise IRError(f"partial_rope: rotary_dim {rotary_dim} must be even and below head_dim {head_dim}")
    _rope_inputs(x, positions, TensorType((head_dim // 2,), inv_freq.dtype), head_dim, "partial_rope")
    _want(inv_freq, "partial_rope inv_freq", shape=(rotary_dim // 2,))
    return [x]


@op("partial_rope", _partial_rope_type, attrs=AttrSpec({"head_dim": COUNT, "rotary_dim": COUNT}, {"scaling": SCALE}),
    inputs=3)
def partial_rope_ref(x, positions, inv_freq, *, head_dim, rotary_dim, scaling=1.0, **attrs):
    """Rotary on the first rotary_dim features of each head (inv_freq [rotary_dim / 2]); the rest
    pass unchanged (GPT-NeoX's rotary_pct, Phi's partial_rotary_factor)."""
    heads = x.reshape(*x.shape[:-1], -1, head_dim)
    turned, kept = heads[..., :rotary_dim], heads[..., rotary_dim:]
    cos, sin = rope_cos_sin(positions.reshape(-1), inv_freq, scaling, x.dtype)
    turned = apply_rope(turned.reshape(*x.shape[:-1], -1), cos, sin, rotary_dim)
    return [torch.cat([turned.reshape(turned.shape[:-1] + (-1, rotary_dim)), kept], dim=-1).reshape(x.shape)]


def _moe_type(ts, attrs):
    x, router, gate_up, down = ts
    _want(x, "moe input", rank=2)
    experts, hidden = router.shape if router.rank == 2 else (None, None)
    _want(router, "moe router weight", (x.dtype,), shape=(experts, x.shape[-1]))
    if not isinstance(experts, int) or not 0 < attrs["top_k"] <= experts:
        raise IRError(f"moe: top_k {attrs['top_k']} must be in 1..{experts} (the router's experts)")
    _want(gate_up, "moe gate_up weight", (x.dtype,), rank=3)
    inter = gate_up.shape[1] // 2
    _want(gate_up, "moe gate_up weight", (x.dtype,), shape=(experts, 2 * inter, hidden))
    _want(down, "moe down weight", (x.dtype,), shape=(experts, hidden, inter))
    return [x]


def moe_routing(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in fp32, expert ids [tokens, top_k]): softmax over the router's
    logits in fp32, the top_k experts, their probabilities renormalised to sum to 1 (Mixtral)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), experts


@op("moe", _moe_type, attrs=AttrSpec({"top_k": COUNT}), inputs=4)
def moe_ref(x, router, gate_up, down, *, top_k, **attrs):
    """Sparse mixture of SwiGLU experts: each token's output is the routing-weighted sum, over its
    top_k experts e, of down[e] @ (silu(gate[e] @ x) * (up[e] @ x)), with gate_up[e] = [gate; up].
    Written densely here (every expert on every token, weighted by a mostly-zero routing matrix)."""
    weights, experts = moe_routing(x, router, top_k)
    dense = torch.zeros(x.shape[0], router.shape[0], dtype=torch.float32, device=x.device)
    dense.scatter_(1, experts, weights)
    gate, up = torch.einsum("th,eih->tei", x, gate_up).chunk(2, dim=-1)
    outs = torch.einsum("tei,ehi->teh", F.silu(gate) * up, down)
    return [(outs.float() * dense[..., None]).sum(1).to(x.dtype)]


# -- qmoe: a moe whose experts' weights are stored as qlinear stores a weight, one per expert --------
# int8: codes int8 [E, N, K], scales [E, N]; int4: codes uint8 [E, N, K/2] (two a byte), scales and
# zeros [E, N, K/g]. The router stays float. Inputs: x, router, then gate_up's and down's params.
QMOE_SCHEMES = schemes_where(qmoe=True)


class ExpertWeights(NamedTuple):
    qweight: Any
    scales: Any
    zeros: Any


def qmoe_inputs(inputs: list, scheme: str) -> tuple[Any, Any, ExpertWeights, ExpertWeights]:
    """(x, router, gate_up, down) of a qmoe's inputs; zeros only for int4."""
    per = 3 if SCHEMES[scheme].zeros_required else 2
    if len(inputs) != 2 + 2 * per:
        raise IRError(f"qmoe ({scheme}): {len(inputs)} inputs, expected {2 + 2 * per} (x, router, then "
                      f"{'qweight, scales, zeros' if per == 3 else 'qweight, scales'} of gate_up and of down)")
    gate_up, down = (ExpertWeights(*(list(part) + [None])[:3]) for part in (inputs[2:2 + per], inputs[2 + per:]))
    return inputs[0], inputs[1], gate_up, down


def _qmoe_type(ts, attrs):
    scheme, group_size, inter = attrs["scheme"], attrs.get("group_size", -1), attrs["intermediate"]
    x, router, gate_up, down = qmoe_inputs(ts, scheme)
    _want(x, "qmoe input", rank=2)
    experts, hidden = router.shape if router.rank == 2 else (None, None)
    _want(router, "qmoe router weight", (x.dtype,), shape=(experts, x.shape[-1]))
    if not isinstance(experts, int) or not 0 < attrs["top_k"] <= experts:
        raise IRError(f"qmoe: top_k {attrs['top_k']} must be in 1..{experts} (the router's experts)")
    dtype, per_element = QLINEAR_STORAGE[scheme]
    for name, w, rows, k in (("gate_up", gate_up, 2 * inter, hidden), ("down", down, hidden, inter)):
        _want(w.qweight, f"qmoe {name} qweight", (dtype,), shape=(experts, rows, k // per_element))
        if not SCHEMES[scheme].grouped:
            _want(w.scales, f"qmoe {name} scales", shape=(experts, rows))
            continue
        if type(group_size) is not int or group_size <= 0 or k % group_size:
            raise IRError(f"qmoe ({scheme}): group_size {group_size!r} must be a positive divisor of {name}'s K={k}")
        for part in ("scales", "zeros"):
            _want(getattr(w, part), f"qmoe {name} {part}", shape=(experts, rows, k // group_size))
    return [x]


def expert_weights(scheme: str, w: ExpertWeights, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expert `expert`'s [N, K] weight from a qmoe's stored params."""
    return dequantize_weight(scheme, w.qweight[expert], w.scales[expert],
                             None if w.zeros is None else w.zeros[expert], dtype)


@op("qmoe", _qmoe_type, inputs=(6, 8), attrs=AttrSpec(
    {"top_k": COUNT, "scheme": one_of(*QMOE_SCHEMES), "intermediate": COUNT}, {"group_size": INT}))
def qmoe_ref(*inputs, top_k, scheme, **attrs):
    """moe over the dequantised expert weights."""
    x, router, gate_up, down = qmoe_inputs(list(inputs), scheme)
    experts = range(router.shape[0])
    dense_gate_up = torch.stack([expert_weights(scheme, gate_up, e, x.dtype) for e in experts])
    dense_down = torch.stack([expert_weights(scheme, down, e, x.dtype) for e in experts])
    return moe_ref(x, router, dense_gate_up, dense_down, top_k=top_k)


# `kv_cache`: the dtype a quantised KV cache stores; the op then takes the layer's static scales
# (fp32 [2, kv_heads]: keys, values) as its last input and reads keys and values through them.
ATTENTION_ATTRS = AttrSpec({"layer": INDEX, "num_heads": COUNT, "num_kv_heads": COUNT, "head_dim": COUNT,
                            "scale": SCALE}, {"causal": BOOL, "window": optional(COUNT), "softcap": optional(SCALE),
                                              "kv_cache": optional(one_of(*KV_QMAX))})


def split_kv_scales(inputs: list, attrs: dict) -> tuple[list, object]:
    """(an attention op's other inputs, its KV scales input or None without a statically scaled cache)."""
    if attrs.get("kv_cache") is None or not kv_format(attrs["kv_cache"]).static:
        return list(inputs), None
    return list(inputs[:-1]), inputs[-1]


def through_kv_cache(k, v, kv_scales, attrs: dict):
    """k and v as a quantised cache (`kv_cache` attr) gives them back (unchanged without one)."""
    storage = attrs.get("kv_cache")
    if storage is None:
        return k, v
    kv, hd = attrs["num_kv_heads"], attrs["head_dim"]
    if not kv_format(storage).static:
        return tuple(fake_quant_kv_int4(x.reshape(*x.shape[:-1], kv, hd), kv_int4_group(hd)).reshape(x.shape)
                     for x in (k, v))
    return tuple(fake_quant_kv(x.reshape(*x.shape[:-1], kv, hd), kv_scales[row].float(), storage)
                 .reshape(x.shape) for row, x in enumerate((k, v)))


def causal_attention(q, k, v, *, num_heads, num_kv_heads, head_dim, scale, causal=True, window=None, softcap=None):
    """q: [tokens, heads*hd], k/v: [ctx, kv_heads*hd]; the last tokens of ctx are the queries.
    With a sliding `window`, the query at position p sees only the keys in (p - window, p]."""
    t, c = q.shape[0], k.shape[0]
    qh = q.reshape(t, num_heads, head_dim).transpose(0, 1)
    kh = k.reshape(c, num_kv_heads, head_dim).transpose(0, 1)
    vh = v.reshape(c, num_kv_heads, head_dim).transpose(0, 1)
    mask = None
    if causal and (t > 1 or window is not None):
        # query i sits at context position c - t + i and sees keys 0..c - t + i
        mask = torch.ones(t, c, dtype=torch.bool, device=q.device).tril(diagonal=c - t)
        if window is not None:
            mask = mask.triu(diagonal=c - t - window + 1)
    out = scaled_dot_product(qh, kh, vh, mask, scale, softcap)
    return out.transpose(0, 1).reshape(t, num_heads * head_dim)


def scaled_dot_product(qh, kh, vh, mask, scale: float, softcap: float | None = None):
    """SDPA over heads-first q [.., heads, t, hd] and k/v [.., kv_heads, ctx, hd] (GQA by broadcast),
    `mask` boolean (True: visible) or additive; with `softcap`, scores s become softcap * tanh(s /
    softcap) before the mask (Gemma 2's attention logit soft-capping)."""
    gqa = qh.shape[-3] != kh.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        kh, vh = (x.repeat_interleave(qh.shape[-3] // x.shape[-3], dim=-3) for x in (kh, vh))
    scores = softcap * torch.tanh((qh @ kh.transpose(-2, -1)) * (scale / softcap))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1) @ vh


@op("attention", _attention_op_type, attrs=ATTENTION_ATTRS, inputs=(3, 4))
def attention_ref(q, k, v, kv_scales=None, *, num_heads, num_kv_heads, head_dim, scale, causal=True, window=None,
                  kv_cache=None, softcap=None, **attrs):
    k, v = through_kv_cache(k, v, kv_scales, {"num_kv_heads": num_kv_heads, "head_dim": head_dim,
                                              "kv_cache": kv_cache})
    lead = q.shape[:-2]
    q2, k2, v2 = (t.reshape(t.shape[-2], t.shape[-1]) for t in (q, k, v))
    out = causal_attention(q2, k2, v2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, scale=scale, causal=causal, window=window, softcap=softcap)
    return [out.reshape(*lead, *out.shape)]


# Ops that read and write the KV cache, one node per layer (`layer` attr: the cache index).
ATTENTION_OPS = ("attention", "flash_attention")


def attention_prologue(inputs: list, attrs: dict) -> tuple:
    """The q, k, v an attention op's core sees: flash_attention with a `rope` attr takes q/k
    before rotary (inputs q, k, v, positions, inv_freq) and rotates them first. A quantised cache's
    scales input (the last) is not part of it."""
    inputs, _ = split_kv_scales(inputs, attrs)
    q, k, v = inputs[:3]
    if attrs.get("rope") is None:
        return q, k, v
    positions, inv_freq = inputs[3:5]
    cos, sin = rope_cos_sin(positions.reshape(-1), inv_freq, attrs["rope"]["scaling"], q.dtype)
    return apply_rope(q, cos, sin, attrs["head_dim"]), apply_rope(k, cos, sin, attrs["head_dim"]), v


@op("flash_attention", _flash_attention_type, inputs=(3, 6), attrs=AttrSpec(
    ATTENTION_ATTRS.required, {**ATTENTION_ATTRS.optional, "rope": optional(object_of(scaling=SCALE))}))
def flash_attention_ref(*inputs, **attrs):
    """Attention fused with its rotary prologue (fuse_attention's output); same result as
    rope, rope, attention."""
    _, kv_scales = split_kv_scales(inputs, attrs)
    return attention_ref(*attention_prologue(list(inputs), attrs), kv_scales, **attrs)


# -- collectives across tensor-parallel ranks (passes/shard_tensor_parallel.py puts them in) -----
# Their meaning spans the ranks of one process group: all_reduce sums x over the ranks, all_gather
# joins the ranks' x along the last dim in rank order. One process holds one rank's x only, so the
# reference evaluates a world of one; the CPU kernels (codegen/torch_cpu/cpu_collectives.py) communicate.
COLLECTIVE_OPS = ("all_reduce", "all_gather")


def _all_gather_type(ts, attrs):
    x = ts[0]
    _want(x, "all_gather input", min_rank=1)
    if not isinstance(x.shape[-1], int):
        raise IRError(f"all_gather: the gathered last dim of {x} must be a whole number")
    return [TensorType(x.shape[:-1] + (x.shape[-1] * attrs["world_size"],), x.dtype)]


def _single_rank(op: str, world_size: int) -> None:
    if world_size != 1:
        raise IRError(f"{op} over {world_size} ranks needs their process group: a single process cannot "
                      f"evaluate a sharded graph (run its artifact, whose ranks the runtime starts)")


@op("all_reduce", _float_same, attrs=AttrSpec({"world_size": COUNT}))
def all_reduce_ref(x, *, world_size, **attrs):
    _single_rank("all_reduce", world_size)
    return [x]


@op("all_gather", _all_gather_type, attrs=AttrSpec({"world_size": COUNT}))
def all_gather_ref(x, *, world_size, **attrs):
    _single_rank("all_gather", world_size)
    return [x]


@op("vocab_embedding", _embedding_type, attrs=AttrSpec({"vocab_start": INDEX}), inputs=2)
def vocab_embedding_ref(ids, weight, *, vocab_start, **attrs):
    """The rows of one rank's slice of a vocabulary-split table, which holds ids vocab_start ..
    vocab_start + rows - 1; other ids give zeros (the all_reduce after it adds their rank's rows)."""
    local = ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    return [F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0.0)]


# -- point-to-point between pipeline stages (passes/shard_pipeline.py puts them in) ---------------
# send hands x to rank `peer` and passes it on unchanged (so a stage's plan has an output); recv
# takes the previous stage's hidden states [tokens, hidden], its `tokens` those of `positions`.
# A single process has no peer: the reference refuses, the CPU kernels (codegen/torch_cpu/cpu_point_to_point.py)
# communicate.
POINT_TO_POINT_OPS = ("send", "recv")


def _recv_type(ts, attrs):
    _want(ts[0], "recv positions", dtypes=("int64",), rank=1)
    return [TensorType((ts[0].shape[0], attrs["hidden"]), attrs["dtype"])]


@op("send", _float_same, attrs=AttrSpec({"peer": INDEX}))
def send_ref(x, *, peer, **attrs):
    raise IRError(f"send to rank {peer} needs the pipeline's process group: run the artifact, whose ranks the "
                  f"runtime starts")


@op("recv", _recv_type, attrs=AttrSpec({"peer": INDEX, "hidden": COUNT, "dtype": STRING}))
def recv_ref(positions, *, peer, **attrs):
    raise IRError(f"recv from rank {peer} needs the pipeline's process group: run the artifact, whose ranks the "
                  f"runtime starts")


# -- aten fallback ----------------------------------------------------------------------
_VIEWS_AS_RESHAPE = {"aten.view.default": "aten.reshape.default",
                     "aten._unsafe_view.default": "aten.reshape.default"}


def resolve_aten(target: str):
    """`aten.view.default` -> torch.ops.aten.view.default; only the aten namespace and
    symbolic-size arithmetic. The compiler evaluates any traced op with it (folding, lowering);
    what a plan runs goes through resolve_allowed_aten."""
    if target in SYMBOLIC_OPERATORS:
        return SYMBOLIC_OPERATORS[target]
    # IR values never alias, so a view may copy: remove_noops drops `contiguous` calls, after
    # which a strict view of a transposed input would fail where reshape copies.
    target = _VIEWS_AS_RESHAPE.get(target, target)
    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        raise IRError(f"aten fallback target {target!r} is not of the form aten.<op>.<overload>")
    try:
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except AttributeError as e:
        raise IRError(f"aten fallback target {target!r} does not exist in this torch") from e


def resolve_allowed_aten(target: str):
    """resolve_aten for targets on the allow-list of pure tensor ops (compiler/aten_allowlist.py)
    only: the runtime runs nothing else, so an artifact can name no other code to run."""
    refusal = target_refusal(target)
    if refusal:
        raise IRError(f"aten fallback: {refusal}")
    return resolve_aten(target)


_ENCODED = {"$layout": ENCODED_LAYOUTS, "$memory_format": ENCODED_MEMORY_FORMATS}


def decode_arg(a: Any, inputs: list, device=None) -> Any:
    """Rebuild an aten argument from its JSON form; {"$in": k} is the node's k-th input."""
    if isinstance(a, list):
        return [decode_arg(x, inputs, device) for x in a]
    if not isinstance(a, dict):
        return a
    key, value = next(iter(a.items())) if len(a) == 1 else (None, None)
    if key == "$in" and type(value) is int and 0 <= value < len(inputs):
        return inputs[value]
    if key == "$dtype" and isinstance(value, str) and value in TORCH_DTYPES:
        return TORCH_DTYPES[value]
    if key == "$device" and value in tuple(ENCODED_DEVICES):
        return device if device is not None else torch.device(value)
    if key in _ENCODED and value in _ENCODED[key]:
        return getattr(torch, value)
    if key == "$float" and encoded_float(a) is not None:
        return encoded_float(a)
    raise IRError(f"unknown encoded aten argument {a}")


@op("aten", inputs=(0, 1 << 16), attrs=AttrSpec({"target": STRING, "args": LIST, "kwargs": OBJECT},
                                           {"side_effects": BOOL}))
def aten_ref(*inputs, target, args, kwargs, **attrs):
    device = next((i.device for i in inputs if isinstance(i, torch.Tensor)), None)
    fn = resolve_aten(target)
    out = fn(*decode_arg(args, list(inputs), device),
             **{k: decode_arg(v, list(inputs), device) for k, v in kwargs.items()})
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run_reference(node: Node, inputs: list) -> list:
    return OPS[node.op].reference(*inputs, **node.attrs)
