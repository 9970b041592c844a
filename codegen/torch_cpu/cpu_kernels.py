"""CPU kernels: each plan op lowered onto torch operators, giving the results of the
references in compiler/ops.py. A kernel takes its inputs, the step's attrs, and the
per-forward context it names in `context` (attention backend, rope table cache)."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from llmc.codegen.native import cpu_native
from llmc.codegen.torch_cpu.cpu_qlinear import DenseWeights, pack_qlinear, run_qlinear
from llmc.codegen.torch_cpu.cpu_qlinear_a8 import MATMULS as A8_MATMULS
from llmc.codegen.torch_cpu.cpu_qlinear_a8 import pack_a8_qlinear, run_a8_qlinear
from llmc.codegen.torch_cpu.cpu_qlinear_dense import (
    DispatchedWeights,
    choose_dense_from,
    dense_source,
    rows_of,
    run_dense,
    run_dense_rows,
    shape_key,
)
from llmc.codegen.torch_cpu.cpu_qlinear_native import NativeGemm, native_gemm, native_gemv_weights, run_native_gemm
from llmc.compiler.ops import (
    OPS,
    TORCH_DTYPES,
    decode_arg,
    qlinear_inputs,
    qlinear_ref,
    resolve_allowed_aten,
    rope_cos_sin,
    split_kv_scales,
    through_kv_cache,
)
from llmc.compiler.quant import dequantize_affine, unpack_int4
from llmc.compiler.schemes import FLOAT_ACTS, SCHEMES, TORCH, schemes_where
from llmc.errors import ArtifactError

CPU_KERNELS: dict[str, Callable[..., list[torch.Tensor]]] = {}


def kernel(op: str, context: tuple[str, ...] = (), prepare: Callable | None = None):
    """Register `fn` as kernel cpu.<op>; `context` names the per-forward keyword args it takes.
    `prepare(inputs, attrs) -> dict`, when given, runs once per launch at load with the launch's
    param inputs (None for activations); the dict joins the launch's keyword args."""
    def register(fn):
        fn.context = context
        fn.prepare = prepare
        CPU_KERNELS[f"cpu.{op}"] = fn
        return fn
    return register


class RopeCache:
    """cos/sin tables of one forward, shared by every rope launch in it (all layers rotate
    by the same positions, so the tables are computed once instead of twice per layer), with the
    forms `rotate` takes them in, made once per forward too."""

    def __init__(self):
        self._tables: dict[tuple, list] = {}

    def _entry(self, positions, inv_freq, scaling: float, dtype) -> list:
        key = (id(positions), id(inv_freq), scaling, dtype)
        hit = self._tables.get(key)
        # Identity check: an id can be reused once its tensor is freed.
        if hit is None or hit[0] is not positions or hit[1] is not inv_freq:
            cos, sin = rope_cos_sin(positions.reshape(-1), inv_freq, scaling, dtype)
            hit = self._tables[key] = [positions, inv_freq, cos, sin, {}]
        return hit

    def cos_sin(self, positions, inv_freq, scaling: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._entry(positions, inv_freq, scaling, dtype)
        return entry[2], entry[3]

    def rotary(self, positions, inv_freq, scaling: float, dtype, head_dim: int, width: int) -> "Rotary":
        """The tables `rotate` takes for rows of `width` columns (heads of `head_dim`)."""
        _, _, cos, sin, forms = self._entry(positions, inv_freq, scaling, dtype)
        form = forms.get((head_dim, width))
        if form is None:
            form = forms[(head_dim, width)] = Rotary.of(cos, sin, head_dim, width)
        return form


TILED_ROPE_ROWS = 16   # up to this many rows `rotate` gathers the swapped halves with one index_select


class Rotary(NamedTuple):
    """compiler.ops.apply_rope's tables for x [tokens, width]: x * cos + [x2, x1] * [-sin1, sin2] per
    head. Few rows (decode) take cos and signed sin tiled to the width and the half swap as a column
    permutation: three ops, 4x faster than per-head views at one row; many rows (prefill) take the
    per-head form, where index_select over columns is the slower copy (1.5x at 512 rows)."""
    cos: torch.Tensor         # [tokens, 1, head_dim], or [tokens, width] tiled
    sin_signed: torch.Tensor  # likewise, with the rotate-half sign folded into the first half
    swap: torch.Tensor | None  # [width] the column each output column's swapped half reads; None: per head
    head_dim: int

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, width: int) -> "Rotary":
        half = head_dim // 2
        sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        if cos.shape[0] > TILED_ROPE_ROWS:
            return cls(cos[:, None, :], sin_signed[:, None, :], None, head_dim)
        heads = width // head_dim
        swap = torch.arange(width, device=cos.device).view(heads, 2, half).flip(1).reshape(-1)
        return cls(cos.repeat(1, heads), sin_signed.repeat(1, heads), swap, head_dim)


def rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """x [..., tokens, width] rotated by `rotary`: the same products and sums (bitwise) either way."""
    if rotary.swap is not None and x.dim() == 2:
        return (x * rotary.cos).addcmul_(x.index_select(1, rotary.swap), rotary.sin_signed)
    half = rotary.head_dim // 2
    xh = x.reshape(*x.shape[:-1], -1, rotary.head_dim)
    cos, sin_signed = rotary.cos, rotary.sin_signed
    if cos.dim() == 2:   # tiled tables on an input with leading dims: back to one head's
        cos, sin_signed = cos[:, None, :rotary.head_dim], sin_signed[:, None, :rotary.head_dim]
    swapped = torch.cat([xh[..., half:], xh[..., :half]], dim=-1)
    return (xh * cos).addcmul_(swapped, sin_signed).reshape(x.shape)


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The view covering a then b when b's columns follow a's in the same rows of one buffer
    (q and k split from one fused projection); None otherwise."""
    if (a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype or a.shape[0] != b.shape[0]
            or a.stride() != b.stride() or a.stride(-1) != 1
            or b.data_ptr() != a.data_ptr() + a.shape[1] * a.element_size()
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return None
    return a.as_strided((a.shape[0], a.shape[1] + b.shape[1]), a.stride())


@kernel("embedding")
def embedding(ids, weight, **attrs):
    return [F.embedding(ids, weight)]


@kernel("qembedding")
def qembedding(ids, qweight, scales, zeros=None, *, scheme, embedding_dim, **attrs):
    """Gather the selected rows of codes first, so only those rows are dequantised (fp32 out)."""
    rows = ids.reshape(-1)
    codes, s = qweight.index_select(0, rows), scales.index_select(0, rows)
    if SCHEMES[scheme].gguf:   # its params as stored (dequantize_affine widens them; K-quant ones are packed)
        out = dequantize_affine(scheme, codes, s, None if zeros is None else zeros.index_select(0, rows))
    elif scheme == "int8":
        out = codes.float() * s.float()[:, None]
    else:
        # codes [T, K/g, g] against scales and zeros [T, K/g, 1]
        q = unpack_int4(codes).float().reshape(len(rows), s.shape[1], -1)
        out = (q - zeros.index_select(0, rows).float()[..., None]) * s.float()[..., None]
    return [out.reshape(*ids.shape, embedding_dim)]


@kernel("rms_norm")
def rms_norm(x, weight, *, eps, feeds_qlinear=False, batch_invariant=False, **attrs):
    if feeds_qlinear or batch_invariant:   # see add_rms_norm
        done = cpu_native.add_rms_norm(x, None, weight, eps, any_rows=batch_invariant)
        if done is not None:
            return [done[0]]
    return [_rms_norm(x, weight, eps)]


# up to this many rows fp32 takes F.rms_norm itself: torch 2.13's fused CPU kernel, one dispatch
# (13 vs 16 us at 1 row, 34 vs 35 at 64); at 512 rows it measured 20x slower than the steps below
FUSED_RMS_NORM_ROWS = 64


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm's result (bitwise), from F.rms_norm for a few fp32 rows, else from its steps spelled
    out in place on fresh intermediates (F.rms_norm allocates a fresh activation per step there).
    Normalises in fp32 and casts back before the weight, as the reference (and HF Llama) do."""
    if x.dtype == weight.dtype == torch.float32 and rows_of(x) <= FUSED_RMS_NORM_ROWS:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    h = xf * xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if x.dtype == weight.dtype == torch.float32:
        return h.mul_(weight)
    return weight * h.to(x.dtype)


def prepare_linear(inputs, attrs, meta: dict | None = None) -> dict:
    """A bf16 weight is reordered once, at load, into oneDNN's blocked layout and runs from there at
    every row count: oneDNN's bf16 GEMM on a plain weight re-packs it on every call, which cost
    1.4x at one row and 1.2x at 64 over SmolLM2's layers (AVX512-BF16 host). fp32 weights get a
    blocked copy only when speculation asks (Executor.block_linear_weights)."""
    weight = inputs[1]
    if (weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return {}
    return {"blocked": torch.ops.mkldnn._reorder_linear_weight(weight, BLOCKED_ROWS), "blocked_from": 1}


@kernel("linear", prepare=prepare_linear)
def linear(x, weight, bias=None, blocked=None, blocked_from=None, batch_invariant=False, **attrs):
    if batch_invariant:   # the same dot products at every row count (MKL's depend on it)
        y = cpu_native.gemv_f32(x, weight, bias)
        if y is not None:
            return [y]
    # see blocked_linear_weight and prepare_linear
    if blocked is not None and x.dim() == 2 and x.shape[0] >= (blocked_from or BLOCKED_FROM_ROWS):
        return [torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")]
    return [F.linear(x, weight, bias)]


BLOCKED_ROWS = 6   # the row count oneDNN tunes the blocked layout for: a verification of 5 drafts
BLOCKED_FROM_ROWS = 4


def blocked_linear_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    """`weight` (fp32, on the CPU) reordered into oneDNN's blocked layout, or None where that does
    not apply. MKL's GEMM of 4 to 9 rows costs 1.5-2.4x its one-row GEMV on SmolLM2's shapes (fp32,
    one thread, weights streamed from memory); oneDNN on the blocked copy 1.1-1.4x at 4 to 6 rows and
    0.9x at 64. At 1 to 3 rows MKL was as fast or faster (2 rows: 1.0x against oneDNN's 1.1-1.3x), so
    `linear` keeps MKL below BLOCKED_FROM_ROWS."""
    if (weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, BLOCKED_ROWS)


def pack_for_cpu(scheme: str, qweight, scales, zeros, act_scale, group_size: int):
    """int8/int4 in torch's packed layout (codegen/torch_cpu/cpu_qlinear.py), fp8/w8a8 as exact codes for
    their activation-quantising GEMMs (codegen/torch_cpu/cpu_qlinear_a8.py); None when torch has no kernel."""
    if SCHEMES[scheme].activations != FLOAT_ACTS:
        return pack_a8_qlinear(scheme, qweight, scales, act_scale)
    return pack_qlinear(scheme, qweight, scales, zeros, group_size)


def prepare_qlinear(inputs, attrs, meta: dict | None = None) -> dict:
    """Convert a qlinear's stored weights once, at load, into the native GEMV's form where it has one
    (codegen/torch_cpu/cpu_qlinear_native.py), else torch's packed CPU layout, and pair them with the dense path
    (dequantise + fp32 GEMM) taken from the row count where it measured faster, or that the plan's meta
    records for the shape (codegen/torch_cpu/cpu_qlinear_dense.py)."""
    _, qweight, scales, zeros, act_scale = qlinear_inputs(list(inputs), attrs)[:5]
    if (qweight is None or scales is None or (attrs.get("has_zeros") and zeros is None)
            or (attrs.get("has_act_scale") and act_scale is None)):
        return {}
    scheme = attrs["scheme"]
    native = native_gemv_weights(scheme, qweight, scales, zeros, q4_activations(meta),
                                 bool((meta or {}).get(WEIGHTS_CACHED)))
    extra = {} if native is None else {"native_gemv": native}
    if (meta or {}).get(BATCH_INVARIANT) and cpu_native.gemv_runs() and (native is not None or scheme in DENSE_SCHEMES):
        # every row count through one per-row code path: the GEMVs, else dequantise + the fp32 GEMV
        dense = None if native is not None else dense_source(scheme, qweight, scales, zeros, act_scale)
        return {"invariant_dense": dense, **extra}
    packed = packed_weights(scheme, qweight, scales, zeros, act_scale, attrs.get("group_size", -1), native)
    if packed is None or isinstance(packed, DenseWeights):
        return extra if packed is None else {"cpu_weights": packed, **extra}
    dense = packed.dense if type(packed) is NativeGemm else dense_source(scheme, qweight, scales, zeros, act_scale)
    dense_from = choose_dense_from(meta, shape_key(scheme, qweight, scales), packed_run(packed, native), dense)
    return {"cpu_weights": DispatchedWeights(packed, dense, dense_from), **extra}


def packed_weights(scheme: str, qweight, scales, zeros, act_scale, group_size: int, native):
    """The one packed form a qlinear keeps: the native GEMV's (`native`) where it serves every row count,
    else torch's (pack_for_cpu)."""
    packed = native_gemm(scheme, qweight, scales, zeros, native)
    return pack_for_cpu(scheme, qweight, scales, zeros, act_scale, group_size) if packed is None else packed


def packed_run(packed, native=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the low-bit kernel's result over `packed` weights, through the native GEMV (`native`:
    cpu_native.Q8Weights or Q4Weights) at the rows where `qlinear` takes it."""
    if native is None:
        return lambda x: _run_packed(x, packed)

    def run(x: torch.Tensor) -> torch.Tensor:
        y = cpu_native.gemv(x, native)
        return _run_packed(x, packed) if y is None else y
    return run


BATCH_INVARIANT = "batch_invariant"   # the key of plan meta (as the executor passes it) and launch attrs
Q4_ACTIVATIONS = "q4_activations"     # plan meta (as the executor passes it): cpu_native.Q4_ACTIVATIONS
WEIGHTS_CACHED = "weights_cached"     # as the executor passes it: the weights fit the last-level cache
DENSE_SCHEMES = schemes_where(family=TORCH)   # what dense_source reads


def q4_activations(meta: dict | None) -> str:
    """How the 4-bit GEMVs round activations for this plan (an artifact without the record: int16, as it
    was compiled and measured)."""
    return (meta or {}).get(Q4_ACTIVATIONS) or "int16"


@kernel("qlinear", prepare=prepare_qlinear)
def qlinear(*inputs, scheme, cpu_weights=None, native_gemv=None, **attrs):
    """int8 and 4-bit codes on a few fp32 rows (below the dense row count) through the native GEMV
    (cpu_native.gemv: the reference's fp32 arithmetic, where torch's kernels round x to bf16);
    otherwise int8/int4 through torch's packed kernels, fp8/w8a8 through exact-code GEMMs, each up to
    the row count where dequantising into an fp32 GEMM wins; group sizes torch does not pack run the
    reference (dequantise, fp32 GEMM). Batch-invariant (prepare_qlinear gave `invariant_dense`): the
    GEMVs at every row count, MAX_ROWS rows a call, or dequantise + the fp32 GEMV."""
    if "invariant_dense" in attrs:
        y = _run_invariant(inputs[0], native_gemv, attrs["invariant_dense"])
        if y is not None:   # a bias added after, as the decode program adds it
            return [y if not attrs.get("has_bias") else y + qlinear_inputs(list(inputs), attrs)[5]]
    if native_gemv is not None and not attrs.get("has_bias") and (
            type(cpu_weights) is not DispatchedWeights or rows_of(inputs[0]) < cpu_weights.dense_from):
        y = cpu_native.gemv(inputs[0], native_gemv)
        if y is not None:
            return [y]
    if type(cpu_weights) is DispatchedWeights and not attrs.get("has_bias") and \
            rows_of(inputs[0]) < cpu_weights.dense_from:   # the common case: no inputs to sort out
        return [_run_packed(inputs[0], cpu_weights.packed)]
    x, qweight, scales, zeros, act_scale, bias = qlinear_inputs(list(inputs), attrs)
    if cpu_weights is None:
        cpu_weights = packed_weights(scheme, qweight, scales, zeros, act_scale, attrs.get("group_size", -1),
                                     native_gemv_weights(scheme, qweight, scales, zeros))
    if cpu_weights is None:
        return qlinear_ref(*inputs, scheme=scheme, **attrs)
    if isinstance(cpu_weights, DispatchedWeights):
        if rows_of(x) >= cpu_weights.dense_from:
            return [run_dense(x, cpu_weights.dense, bias)]
        cpu_weights = cpu_weights.packed
    return [_run_packed(x, cpu_weights, bias)]


def _run_invariant(x: torch.Tensor, native, dense) -> torch.Tensor | None:
    """x [..., K] through the per-row GEMVs (or dense's weight dequantised, then the fp32 GEMV); None where
    they do not apply."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    if native is not None:
        y = cpu_native.gemm(rows, native)
    else:
        y = run_dense_rows(rows, dense)
    return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def _run_packed(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    if type(packed) is NativeGemm:
        return run_native_gemm(x, packed, bias)
    return (run_a8_qlinear if type(packed) in A8_MATMULS else run_qlinear)(x, packed, bias)


@kernel("silu")
def silu(x, **attrs):
    return [F.silu(x)]


@kernel("mul")
def mul(a, b, **attrs):
    return [a * b]


@kernel("add")
def add(a, b, **attrs):
    return [a + b]


@kernel("split")
def split(x, *, sizes, **attrs):
    # Views into x, not copies: the kernels reading them accept strided inputs.
    return list(x.split(sizes, dim=-1))


@kernel("add_rms_norm")
def add_rms_norm(x, residual, weight, *, eps, feeds_qlinear=False, batch_invariant=False, **attrs):
    """x + residual, and its rms_norm. `feeds_qlinear` (set at load where only quantised GEMMs read
    the norm: PlanExecutor._mark_norms_feeding_qlinears): a few rows take the native kernel, one call
    for torch's ~15 us of dispatch, its rounding differences far under those GEMMs' own."""
    if feeds_qlinear or batch_invariant:   # batch-invariant: the decode program's norm at every row count
        done = cpu_native.add_rms_norm(x, residual, weight, eps, any_rows=batch_invariant)
        if done is not None:
            return list(done)
    summed = x + residual
    return [_rms_norm(summed, weight, eps), summed]


@kernel("swiglu")
def swiglu(*inputs, batch_invariant=False, **attrs):
    if batch_invariant and len(inputs) == 1:   # rounded as the decode program's OP_SWIGLU, at every row count
        out = cpu_native.swiglu(inputs[0])
        if out is not None:
            return [out]
    gate, up = inputs if len(inputs) == 2 else inputs[0].chunk(2, dim=-1)
    # in place on silu's fresh result: one activation-sized allocation instead of two
    return [F.silu(gate).mul_(up)]


@kernel("cast")
def cast(x, *, dtype, **attrs):
    return [x.to(TORCH_DTYPES[dtype])]


@kernel("select_rows")
def select_rows(x, indices, **attrs):
    return [x.index_select(0, indices)]


def rope_tables(rope_cache: RopeCache | None, positions, inv_freq, scaling: float, dtype, head_dim: int,
                width: int) -> Rotary:
    """The tables `rotate` takes, from the forward's cache when there is one."""
    if rope_cache is None:
        cos, sin = rope_cos_sin(positions.reshape(-1), inv_freq, scaling, dtype)
        return Rotary.of(cos, sin, head_dim, width)
    return rope_cache.rotary(positions, inv_freq, scaling, dtype, head_dim, width)


@kernel("rope", context=("rope_cache",))
def rope(x, positions, inv_freq, *, head_dim, scaling=1.0, rope_cache: RopeCache | None = None, **attrs):
    return [rotate(x, rope_tables(rope_cache, positions, inv_freq, scaling, x.dtype, head_dim, x.shape[-1]))]


@kernel("attention", context=("backend",))
def attention(q, k, v, kv_scales=None, *, backend, layer, num_heads, num_kv_heads, head_dim, scale, causal=True,
              window=None, kv_cache=None, softcap=None, **attrs):
    """q: [tokens, num_heads*head_dim], k/v: [tokens, num_kv_heads*head_dim] (optionally
    after unit leading dims); the backend decides which cached keys the queries also see. With a
    quantised KV cache (`kv_cache`, scales input), keys and values go through it: a paged cache
    stores the codes itself; a backend that keeps nothing reads them through the same arithmetic."""
    if kv_cache is not None and not getattr(backend, "quantizes_kv", False):
        k, v = through_kv_cache(k, v, kv_scales, {"num_kv_heads": num_kv_heads, "head_dim": head_dim,
                                                  "kv_cache": kv_cache})
    lead = q.shape[:-2]
    if lead or k.dim() != 2 or v.dim() != 2:
        q, k, v = (t.reshape(t.shape[-2], t.shape[-1]) for t in (q, k, v))
    # soft-capping goes only to backends that take it: one that does not fails loudly
    capped = {} if softcap is None else {"softcap": softcap}
    out = backend.forward(layer, q, k, v, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, scale=scale, causal=causal, window=window, **capped)
    return [out.reshape(*lead, *out.shape) if lead else out]


@kernel("flash_attention", context=("backend", "rope_cache"))
def flash_attention(*inputs, backend, head_dim, rope=None, rope_cache: RopeCache | None = None, **attrs):
    """The rotary prologue on q and k (when `rope` is set), then the attention kernel: on the CPU
    the fused op runs the same backend, so its keys reach the KV cache rotated as before."""
    inputs, kv_scales = split_kv_scales(inputs, attrs)
    q, k, v = inputs[:3]
    native = getattr(backend, "decode_native", None)
    if native is not None and attrs.get("kv_cache") is None and q.dim() == 2:   # a decode step: one native call
        rotary = None if rope is None else (rope_cache or RopeCache()).cos_sin(inputs[3], inputs[4], rope["scaling"],
                                                                               q.dtype)
        out = native(q, k, v, rotary, head_dim=head_dim, **attrs)
        if out is not None:
            return [out]
    if rope is not None:
        q, k = _rotate_q_k(q, k, inputs[3], inputs[4], rope["scaling"], head_dim, rope_cache)
    return attention(q, k, v, kv_scales, backend=backend, head_dim=head_dim, **attrs)


def _rotate_q_k(q, k, positions, inv_freq, scaling: float, head_dim: int, rope_cache: RopeCache | None):
    """Rotary on q and k; in one pass over both when they lie side by side in one buffer."""
    qk = _adjacent(q, k)
    if qk is None:
        return tuple(rotate(x, rope_tables(rope_cache, positions, inv_freq, scaling, q.dtype, head_dim, x.shape[-1]))
                     for x in (q, k))
    rotary = rope_tables(rope_cache, positions, inv_freq, scaling, q.dtype, head_dim, qk.shape[-1])
    return rotate(qk, rotary).split([q.shape[-1], k.shape[-1]], dim=-1)


# Resolving (and allow-list checking) torch.ops.aten.<op>.<overload> walks attributes and schemas;
# do it once per target. Plans are checked at load (runtime/plan_check.py); this is a second line.
_resolve_aten = functools.lru_cache(maxsize=None)(resolve_allowed_aten)


@kernel("aten")
def aten(*inputs, target, args, kwargs, **attrs):
    fn = _resolve_aten(target)
    device = next((i.device for i in inputs if isinstance(i, torch.Tensor)), None)
    decoded_kwargs = {k: decode_arg(a, inputs, device) for k, a in kwargs.items()}
    out = fn(*decode_arg(args, inputs, device), **decoded_kwargs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _reference_kernel(op: str) -> Callable[..., list[torch.Tensor]]:
    reference = OPS[op].reference

    def run(*inputs, **attrs):
        return reference(*inputs, **attrs)
    run.context = ()
    return run


def resolve_kernel(name: str) -> Callable[..., list[torch.Tensor]]:
    """The kernel a plan step names; an IR op without a CPU kernel of its own runs its
    reference, which defines its meaning."""
    fn = CPU_KERNELS.get(name)
    if fn is not None:
        return fn
    ns, _, op = name.partition(".")
    if ns == "cpu" and op in OPS:
        return _reference_kernel(op)
    raise ArtifactError(f"plan names kernel {name!r}, which this llmc does not have (CPU kernels: "
                        f"{sorted(CPU_KERNELS)}); recompile the model for target 'cpu' with this llmc")


__all__ = ["CPU_KERNELS", "RopeCache", "kernel", "resolve_kernel"]

# the collectives register themselves as cpu.all_reduce / cpu.all_gather, the sparse MoE kernel as
# cpu.moe (they need `kernel` above)
from llmc.codegen.torch_cpu import cpu_collectives, cpu_moe  # noqa: E402,F401
