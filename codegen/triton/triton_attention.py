"""Launchers of llmc's Triton attention kernels over the paged KV cache of runtime/paged_attention.py:
the KV-cache write by slot mapping (kv_cache_write.py.j2), FlashAttention-2 prefill over packed
variable-length sequences (flash_attention_prefill.py.j2), and split-K paged decode
(paged_decode.py.j2 + paged_decode_reduce.py.j2). Each render_* function gives the exact kernel
source a launch uses, so a compiler can record it (template, name, constants, sha256); the launch
functions render through those same functions.

Layouts: k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]; a quantised cache
(int8, float8_e4m3fn) holds codes x ≈ code * scale with kv_scales fp32 [2, num_kv_heads] (row 0
keys, row 1 values), as runtime/kv_quant.py. Activations are float32, bfloat16 or float16;
kernels compute in fp32 and return the activations' dtype."""

from __future__ import annotations

import functools

import torch

from llmc.codegen.triton.triton_configs import AttentionConfig, attention_config
from llmc.codegen.triton.triton_render import RenderedKernel, load_kernel, render_kernel
from llmc.compiler.schemes import KV_CACHE_FORMATS, TRITON

ACTIVATION_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# the KV formats these kernels read (int4 is refused for GPU targets at compile: compiler/recipes.py)
TRITON_KV_FORMATS = [f for f in KV_CACHE_FORMATS.values() if TRITON in f.families]
CACHE_DTYPES = {**ACTIVATION_DTYPES, **{f.torch_dtype: f.storage for f in TRITON_KV_FORMATS}}
QUANTIZED_CACHE_DTYPES = tuple(f.storage for f in TRITON_KV_FORMATS)
WRITE_NUM_WARPS = 4   # one program stores one token's kv_heads * head_dim values: no tiling to tune


# --- rendering ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def render_kv_cache_write(target: str, kv_dtype, cache_dtype, head_dim: int, *, num_kv_heads: int,
                          block_size: int, rope: bool = False) -> RenderedKernel:
    """The KV-cache write for k/v of `kv_dtype` into a `cache_dtype` cache (dtypes as torch dtypes
    or their names); `rope` rotates the keys before they are stored."""
    attention_config(target)  # the target must be a known GPU family
    cache = _dtype_name(cache_dtype, CACHE_DTYPES, "KV cache")
    constants = dict(KV_DTYPE=_dtype_name(kv_dtype, ACTIVATION_DTYPES, "k/v"), CACHE_DTYPE=cache,
                     QUANTIZED=cache in QUANTIZED_CACHE_DTYPES, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
                     NUM_KV_HEADS=num_kv_heads, BLOCK_H=_next_pow2(num_kv_heads), BLOCK_SIZE=block_size,
                     ROPE=rope, NUM_WARPS=WRITE_NUM_WARPS)
    return render_kernel("kv_cache_write.py.j2", "kv_cache_write", constants)


@functools.lru_cache(maxsize=None)
def render_prefill(target: str, q_dtype, cache_dtype, head_dim: int, *, num_heads: int, num_kv_heads: int,
                   block_size: int, causal: bool = True, window: bool = False, rope: bool = False,
                   config: AttentionConfig | None = None) -> RenderedKernel:
    """The FlashAttention-2 prefill for one dtype pair and head layout; `window` says whether a
    sliding window is passed (its size is a launch argument); `config` overrides the target's."""
    config = config or attention_config(target)
    constants = dict(_attention_constants(q_dtype, cache_dtype, head_dim, num_heads, num_kv_heads, block_size,
                                          window, rope),
                     CAUSAL=causal, BLOCK_M=config.block_m, BLOCK_N=config.block_n, NUM_WARPS=config.num_warps,
                     NUM_STAGES=config.num_stages)
    return render_kernel("flash_attention_prefill.py.j2", "flash_attention_prefill", constants)


@functools.lru_cache(maxsize=None)
def render_decode(target: str, q_dtype, cache_dtype, head_dim: int, *, num_heads: int, num_kv_heads: int,
                  block_size: int, split_k: bool, window: bool = False, rope: bool = False,
                  config: AttentionConfig | None = None) -> RenderedKernel:
    """The paged decode kernel; with `split_k` it writes per-split partials for
    render_decode_reduce's kernel, without it the normalised output."""
    config = config or attention_config(target)
    group = num_heads // num_kv_heads
    constants = dict(_attention_constants(q_dtype, cache_dtype, head_dim, num_heads, num_kv_heads, block_size,
                                          window, rope),
                     SPLIT_K=split_k, BLOCK_H=max(16, _next_pow2(group)), BLOCK_N=config.decode_block_n,
                     NUM_WARPS=config.decode_num_warps, NUM_STAGES=config.decode_num_stages)
    return render_kernel("paged_decode.py.j2", "paged_decode", constants)


@functools.lru_cache(maxsize=None)
def render_decode_reduce(target: str, out_dtype, head_dim: int, *, num_splits: int) -> RenderedKernel:
    """The split-K combine for up to the next power of two of `num_splits` splits."""
    attention_config(target)
    constants = dict(OUT_DTYPE=_dtype_name(out_dtype, ACTIVATION_DTYPES, "q"), HEAD_DIM=head_dim,
                     BLOCK_D=_block_d(head_dim), BLOCK_S=_next_pow2(num_splits), NUM_WARPS=WRITE_NUM_WARPS)
    return render_kernel("paged_decode_reduce.py.j2", "paged_decode_reduce", constants)


def decode_num_splits(config: AttentionConfig, max_context_len: int, batch: int, num_kv_heads: int) -> int:
    """Split-K partitions for a decode batch: enough for batch * kv_heads * splits programs to fill
    the SMs, but none shorter than config.split_keys keys and at most config.max_splits."""
    by_length = _cdiv(max_context_len, config.split_keys)
    by_occupancy = _cdiv(config.num_sms, batch * num_kv_heads)
    return max(1, min(config.max_splits, by_length, by_occupancy))


def _attention_constants(q_dtype, cache_dtype, head_dim, num_heads, num_kv_heads, block_size, window, rope):
    q_name = _dtype_name(q_dtype, ACTIVATION_DTYPES, "q")
    cache = _dtype_name(cache_dtype, CACHE_DTYPES, "KV cache")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    # 16-bit operands are exact in tf32; fp32 ones keep full precision
    precision = "ieee" if q_name == "float32" else "tf32"
    return dict(Q_DTYPE=q_name, CACHE_DTYPE=cache, QUANTIZED=cache in QUANTIZED_CACHE_DTYPES, HEAD_DIM=head_dim,
                BLOCK_D=_block_d(head_dim), NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads,
                BLOCK_SIZE=block_size, HAS_WINDOW=window, ROPE=rope, DOT_PRECISION=precision)


# --- launching ---------------------------------------------------------------------------------

def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, kv_scales: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                   rope_scaling: float = 1.0, target: str = "h100") -> None:
    """Store k/v [T, kv_heads * head_dim] (or [T, kv_heads, head_dim]) at cache slots
    slot_mapping [T] (slot = block * block_size + offset; slots < 0 are padding, skipped).
    int8/float8_e4m3fn caches quantise on write with kv_scales fp32 [2, kv_heads], rounding as
    runtime/kv_quant.quantize_kv does. With positions [T] and inv_freq [head_dim / 2] the keys get
    GPT-NeoX rotary first (compiler.ops.apply_rope, cos/sin times rope_scaling)."""
    _, block_size, num_kv_heads, head_dim = _check_caches(k_cache, v_cache, kv_scales)
    t = k.shape[0]
    k3, v3 = _heads_view(k, t, num_kv_heads, head_dim, "k"), _heads_view(v, t, num_kv_heads, head_dim, "v")
    if k3.dtype != v3.dtype:
        raise ValueError(f"k is {k3.dtype} but v is {v3.dtype}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping must have shape ({t},), one slot a token, got {tuple(slot_mapping.shape)}")
    rope = _check_rope(positions, inv_freq, t, head_dim)
    if t == 0:
        return
    kernel = load_kernel(render_kv_cache_write(target, k3.dtype, k_cache.dtype, head_dim, num_kv_heads=num_kv_heads,
                                               block_size=block_size, rope=rope))
    scales, pos, freq = _optional_operands(slot_mapping, kv_scales, positions, inv_freq)
    kc, vc = _cache_operand(k_cache), _cache_operand(v_cache)
    kernel[(t,)](k3, v3, kc, vc, slot_mapping, scales, pos, freq, k3.stride(0), k3.stride(1), v3.stride(0),
                 v3.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), float(rope_scaling),
                 num_warps=WRITE_NUM_WARPS)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_starts: torch.Tensor, *, num_heads: int,
                            num_kv_heads: int, head_dim: int, scale: float, causal: bool = True,
                            window: int | None = None, kv_scales: torch.Tensor | None = None,
                            positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                            rope_scaling: float = 1.0, max_seqlen_q: int | None = None, target: str = "h100",
                            config: AttentionConfig | None = None) -> torch.Tensor:
    """FlashAttention-2 over packed sequences -> [T, num_heads * head_dim] in q's dtype.

    q [T, num_heads * head_dim] (or [T, num_heads, head_dim]); sequence i has queries
    q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]] at positions context_starts[i] + j and attends to keys
    0 .. context_starts[i] + q_len - 1, read from the caches through block_tables[i] ([seqs,
    max_blocks] block ids): a prefix-cache hit reads its cached blocks, and this step's keys must
    already be written (write_kv_cache). Query head h reads KV head h // (num_heads // num_kv_heads).
    causal hides keys after the query; window w also hides keys at or before position p - w.
    kv_scales dequantise int8/fp8 caches; positions [T] + inv_freq rotate q first (GPT-NeoX).
    max_seqlen_q (the longest q_len) saves a device sync; config overrides the target's tiles."""
    config = config or attention_config(target)
    t = q.shape[0]
    _, block_size, *_ = _check_attention(q, k_cache, v_cache, kv_scales, num_heads, num_kv_heads, head_dim,
                                                  window)
    q3 = _heads_view(q, t, num_heads, head_dim, "q")
    num_seqs = cu_seqlens_q.numel() - 1
    _check_tables(block_tables, num_seqs, "cu_seqlens_q has")
    if context_starts.shape != (num_seqs,):
        raise ValueError(f"context_starts must have shape ({num_seqs},), one per sequence, got "
                         f"{tuple(context_starts.shape)}")
    rope = _check_rope(positions, inv_freq, t, head_dim)
    out = torch.empty(t, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if t == 0 or num_seqs <= 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    kernel = load_kernel(render_prefill(target, q.dtype, k_cache.dtype, head_dim, num_heads=num_heads,
                                        num_kv_heads=num_kv_heads, block_size=block_size, causal=causal,
                                        window=window is not None, rope=rope, config=config))
    scales, pos, freq = _optional_operands(cu_seqlens_q, kv_scales, positions, inv_freq)
    kc, vc = _cache_operand(k_cache), _cache_operand(v_cache)
    grid = (_cdiv(max_seqlen_q, config.block_m), num_seqs, num_heads)
    kernel[grid](q3, kc, vc, block_tables, cu_seqlens_q, context_starts, scales, pos, freq, out,
                 q3.stride(0), q3.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
                 out.stride(0), head_dim, float(scale), window or 0, float(rope_scaling),
                 num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                           scale: float, window: int | None = None, kv_scales: torch.Tensor | None = None,
                           num_splits: int | None = None, positions: torch.Tensor | None = None,
                           inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0, target: str = "h100",
                           config: AttentionConfig | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence -> [B, num_heads * head_dim] in q's dtype.

    q [B, num_heads * head_dim] (or [B, num_heads, head_dim]); sequence b's query sits at position
    context_lens[b] - 1 (>= 0) and attends to keys 0 .. context_lens[b] - 1 (its own already
    written) through block_tables[b]. Split-K (flash-decoding): grid (B, kv_heads, num_splits),
    each program combining the query heads of one KV head over one split of the keys, then a
    reduce kernel; num_splits None picks decode_num_splits from the longest context (one device
    sync: pass it to avoid that). window, kv_scales, positions/inv_freq as paged_prefill_attention."""
    config = config or attention_config(target)
    b = q.shape[0]
    _, block_size, *_ = _check_attention(q, k_cache, v_cache, kv_scales, num_heads, num_kv_heads, head_dim,
                                                  window)
    q3 = _heads_view(q, b, num_heads, head_dim, "q")
    _check_tables(block_tables, b, "q has")
    if context_lens.shape != (b,):
        raise ValueError(f"context_lens must have shape ({b},), one per sequence, got {tuple(context_lens.shape)}")
    rope = _check_rope(positions, inv_freq, b, head_dim)
    out = torch.empty(b, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(config, int(context_lens.max()), b, num_kv_heads)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    kernel = load_kernel(render_decode(target, q.dtype, k_cache.dtype, head_dim, num_heads=num_heads,
                                       num_kv_heads=num_kv_heads, block_size=block_size, split_k=num_splits > 1,
                                       window=window is not None, rope=rope, config=config))
    scales, pos, freq = _optional_operands(context_lens, kv_scales, positions, inv_freq)
    kc, vc = _cache_operand(k_cache), _cache_operand(v_cache)
    if num_splits == 1:
        dest, maxes, sums = out, out, out   # unused max/sum pointers
    else:
        dest = torch.empty(b, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        maxes = torch.empty(b, num_heads, num_splits, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
    kernel[(b, num_kv_heads, num_splits)](
        q3, kc, vc, block_tables, context_lens, scales, pos, freq, dest, maxes, sums, q3.stride(0), q3.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0), out.stride(0), head_dim, float(scale),
        window or 0, float(rope_scaling), num_warps=config.decode_num_warps, num_stages=config.decode_num_stages)
    if num_splits > 1:
        reduce = load_kernel(render_decode_reduce(target, q.dtype, head_dim, num_splits=num_splits))
        reduce[(b, num_heads)](dest, maxes, sums, out, num_splits, out.stride(0), head_dim, num_warps=WRITE_NUM_WARPS)
    return out


# --- operand checks ----------------------------------------------------------------------------
# Mismatched operands are bugs of the caller (the plan was verified when loaded), so they raise ValueError.

def _check_caches(k_cache, v_cache, kv_scales) -> tuple[int, int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim] of one "
                         f"dtype, got {k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} "
                         f"{tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache and v_cache must share strides with head_dim contiguous, got {k_cache.stride()} "
                         f"and {v_cache.stride()}")
    name = _dtype_name(k_cache.dtype, CACHE_DTYPES, "KV cache")
    num_kv_heads = k_cache.shape[2]
    if (name in QUANTIZED_CACHE_DTYPES) != (kv_scales is not None):
        raise ValueError(f"a {name} KV cache {'needs' if kv_scales is None else 'takes no'} kv_scales")
    if kv_scales is not None and (kv_scales.shape != (2, num_kv_heads) or kv_scales.dtype != torch.float32):
        raise ValueError(f"kv_scales must be float32 [2, {num_kv_heads}] (keys, values), got {kv_scales.dtype} "
                         f"{tuple(kv_scales.shape)}")
    return tuple(k_cache.shape)


def _check_attention(q, k_cache, v_cache, kv_scales, num_heads, num_kv_heads, head_dim, window):
    shape = _check_caches(k_cache, v_cache, kv_scales)
    if shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"the KV cache holds {shape[2]} heads of {shape[3]} dims, the attention wants "
                         f"{num_kv_heads} of {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    _dtype_name(q.dtype, ACTIVATION_DTYPES, "q")
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1 (a query sees itself), got {window}")
    return shape


def _check_tables(block_tables, num_seqs, counted_by) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be a row-contiguous [{num_seqs}, max_blocks] tensor ({counted_by} "
                         f"{num_seqs} sequences), got {tuple(block_tables.shape)}")


def _check_rope(positions, inv_freq, t, head_dim) -> bool:
    if (positions is None) != (inv_freq is None):
        raise ValueError("rotary needs both positions and inv_freq, or neither")
    if positions is None:
        return False
    if positions.shape != (t,) or inv_freq.shape != (head_dim // 2,) or head_dim % 2:
        raise ValueError(f"rotary wants positions [{t}] and inv_freq [{head_dim // 2}] for an even head_dim "
                         f"{head_dim}, got {tuple(positions.shape)} and {tuple(inv_freq.shape)}")
    return True


def _heads_view(x: torch.Tensor, t: int, heads: int, head_dim: int, name: str) -> torch.Tensor:
    """x [t, heads * head_dim] or [t, heads, head_dim] as a [t, heads, head_dim] view (a copy only
    when head_dim is not contiguous); row strides of a fused QKV slice are kept."""
    if x.shape not in ((t, heads * head_dim), (t, heads, head_dim)):
        raise ValueError(f"{name} must be [{t}, {heads * head_dim}] or [{t}, {heads}, {head_dim}], "
                         f"got {tuple(x.shape)}")
    _dtype_name(x.dtype, ACTIVATION_DTYPES, name)
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.view(t, heads, head_dim) if x.dim() == 2 else x


def _optional_operands(placeholder, *operands):
    """Absent operands still need a pointer; their kernels never read it."""
    return tuple(placeholder if x is None else x.contiguous() for x in operands)


def _cache_operand(cache: torch.Tensor) -> torch.Tensor:
    # float8_e4m3fn codes travel as their bit patterns (see _e4m3_decode.py.j2)
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _dtype_name(dtype, names: dict, what: str) -> str:
    if isinstance(dtype, str) and dtype in names.values():
        return dtype
    if dtype in names:
        return names[dtype]
    raise ValueError(f"{what} dtype {dtype} is not supported; use one of {', '.join(names.values())}")


def _block_d(head_dim: int) -> int:
    return max(16, _next_pow2(head_dim))  # head_dim 80 or 96 pads to 128; tl.dot wants >= 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["render_kv_cache_write", "render_prefill", "render_decode", "render_decode_reduce", "decode_num_splits",
           "write_kv_cache", "paged_prefill_attention", "paged_decode_attention"]
