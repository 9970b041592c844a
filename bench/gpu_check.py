"""The GPU check of llmc's Triton kernels, for a machine with an NVIDIA GPU (about 3-5 minutes):
every kernel against a torch reference, FlashAttention prefill against torch SDPA (TFLOP/s at
several sequence lengths), paged decode attention (GB/s against the GPU's memory roofline), the
int4/fp8/w8a8 GEMMs against a torch bf16 matmul, and decode tokens/s of SmolLM2 compiled for
h100-bf16 and h100-fp8. Prints one table and writes JSON.

    python bench/gpu_check.py [--out bench/out/gpu_check.json] [--skip-model] [--dry-run]

Exit status: 0 all kernel checks pass, 1 one fails, 2 no GPU (one line)."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# Datasheet memory bandwidth (bytes/s) by device-name fragment, first match wins.
BANDWIDTHS = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
              ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
              ("RTX 4090", 1.008e12), ("L40S", 0.864e12), ("L4", 0.3e12), ("Orin", 204.8e9)]
# llmc's GPU family (codegen/triton/triton_configs.py) by compute capability
FAMILIES = {(9, 0): "h100", (8, 0): "a100", (8, 9): "rtx4090", (8, 7): "orin"}
MODEL_TARGETS = ("h100-bf16", "h100-fp8")
DEADLINE_S = 280  # model runs are skipped once this much time has passed


@dataclass(frozen=True)
class Sizes:
    """Problem sizes: GPU() for the real run, tiny() for a smoke run through the interpreter."""
    rows: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    prefill_lens: tuple             # ragged (cached prefix, new tokens) per sequence
    decode_lens: tuple              # context length per decode sequence
    gemm_mnk: tuple                 # (M, N, K) of the GEMM checks
    group_size: int
    prefill_timing: tuple           # (batch, seq_len) pairs, causal
    decode_timing: tuple            # (batch, context) pairs
    gemm_timing: tuple              # (M, N, K)

    @classmethod
    def gpu(cls) -> "Sizes":
        return cls(rows=333, hidden=4096, heads=32, kv_heads=8, head_dim=128, block_size=16,
                   prefill_lens=((0, 37), (0, 300), (96, 211), (0, 1), (512, 600)),
                   decode_lens=(1, 17, 300, 1000, 4096, 9000), gemm_mnk=(37, 1536, 1024), group_size=128,
                   prefill_timing=((16, 512), (8, 1024), (4, 2048), (2, 4096), (1, 8192)),
                   decode_timing=((1, 4096), (32, 2048), (64, 4096), (128, 1024)),
                   gemm_timing=((1, 4096, 4096), (16, 4096, 4096), (128, 11008, 4096), (2048, 4096, 4096)))

    @classmethod
    def tiny(cls) -> "Sizes":
        return cls(rows=5, hidden=48, heads=4, kv_heads=2, head_dim=16, block_size=4,
                   prefill_lens=((0, 5), (6, 3), (0, 1)), decode_lens=(1, 9, 14), gemm_mnk=(3, 40, 64),
                   group_size=32, prefill_timing=((2, 8),), decode_timing=((2, 9),), gemm_timing=((2, 32, 64),))


@dataclass
class Row:
    section: str
    case: str
    value: float | None
    unit: str
    reference: float | None = None      # the baseline's figure, same unit
    ok: bool | None = None              # kernel checks: within tolerance
    note: str = ""

    def to_dict(self) -> dict:
        return dict(vars(self))


# -- kernel checks ---------------------------------------------------------------------------------
def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| over max |ref| (a scale-free error for checks of any magnitude)."""
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check(name: str, error: float, tol: float, note: str = "") -> Row:
    return Row("kernel check", name, error, "rel err", tol, error <= tol, note)


def elementwise_checks(device, sizes: Sizes, target: str, gen: torch.Generator) -> list[Row]:
    from llmc.codegen.triton.triton_elementwise import rms_norm, rotary, swiglu
    from llmc.compiler.ops import rms_norm_ref, rope_ref

    m, h = sizes.rows, sizes.hidden
    x, res = (torch.randn(m, h, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(device, torch.bfloat16)
    out, summed = rms_norm(x, w, 1e-5, res, target=target)
    ref_sum = x.float() + res.float()
    gate_up = torch.randn(m, 2 * h, generator=gen).to(device, torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    q = torch.randn(m, sizes.heads * sizes.head_dim, generator=gen).to(device, torch.bfloat16)
    pos = torch.randint(0, 4096, (m,), generator=gen).to(device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, sizes.head_dim, 2) / sizes.head_dim)).to(device)
    bf16 = 2 ** -7  # bf16 rounds to 8 significant bits
    return [
        check("rms_norm bf16", relative_error(rms_norm(x, w, 1e-5, target=target),
                                              rms_norm_ref(x.float(), w.float(), eps=1e-5)[0]), 2 * bf16),
        check("add_rms_norm bf16 (sum)", relative_error(summed, ref_sum), bf16),
        check("add_rms_norm bf16 (norm)", relative_error(out, rms_norm_ref(ref_sum, w.float(), eps=1e-5)[0]),
              3 * bf16),
        check("swiglu bf16", relative_error(swiglu(gate_up, target=target), torch.nn.functional.silu(gate) * up),
              2 * bf16),
        check("rotary bf16", relative_error(rotary(q, pos, inv_freq, head_dim=sizes.head_dim, target=target),
                                            rope_ref(q.float(), pos, inv_freq, head_dim=sizes.head_dim)[0]), 2 * bf16),
    ]


def gemm_checks(device, sizes: Sizes, target: str, gen: torch.Generator) -> list[Row]:
    from llmc.codegen.triton.triton_gemm import dequant_gemm, w8a8_gemm
    from llmc.compiler.ops import qlinear_ref
    from llmc.compiler.quant import pack_int4, quantize_fp8, quantize_int4, quantize_int8

    m, n, k = sizes.gemm_mnk
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    rows = []
    q8, s8 = quantize_int8(w)
    codes, s4, z4 = quantize_int4(w, sizes.group_size)
    q4 = pack_int4(codes)
    qf, sf = quantize_fp8(w)
    act = (x.float().abs().max() / 448.0).reshape(1).cpu()
    cases = {"int8": (q8, s8, None, None), "int4": (q4, s4, z4, None), "fp8": (qf, sf, None, act)}
    for scheme, (qw, s, z, a) in cases.items():
        attrs = dict(has_zeros=z is not None, has_act_scale=a is not None, has_bias=False)
        ref = qlinear_ref(x.float().cpu(), *[t for t in (qw, s, z, a) if t is not None], scheme=scheme, **attrs)[0]
        ours = dequant_gemm(x, qw.to(device), s.to(device), None if z is None else z.to(device), scheme=scheme,
                            group_size=sizes.group_size if scheme == "int4" else None,
                            act_scale=None if a is None else a.to(device), target=target)
        rows.append(check(f"{scheme} dequant GEMM (bf16 x)", relative_error(ours.cpu(), ref), 2 ** -6))
    ours = w8a8_gemm(x, q8.to(device), s8.to(device), target=target)
    ref = qlinear_ref(x.float().cpu(), q8, s8, scheme="w8a8", has_zeros=False, has_act_scale=False)[0]
    rows.append(check("w8a8 GEMM (bf16 x)", relative_error(ours.cpu(), ref), 2 ** -6))
    return rows


@dataclass
class PagedBatch:
    """Random sequences in a paged cache (written by torch), their tables and rotary inputs."""
    cache: object                 # runtime.paged_attention.PagedKVCache with one layer
    tables: list[list[int]]
    keys: list[torch.Tensor]      # per sequence: rotated keys [ctx, kv_heads, head_dim] fp32
    values: list[torch.Tensor]
    inv_freq: torch.Tensor


def paged_batch(device, sizes: Sizes, lengths: list[int], cache_dtype, gen) -> PagedBatch:
    """Sequences of `lengths` tokens, keys rotated in fp32 and stored with PagedKVCache.write."""
    from llmc.compiler.ops import rope_ref
    from llmc.runtime.paged_attention import PagedKVCache

    bs, kvh, hd = sizes.block_size, sizes.kv_heads, sizes.head_dim
    blocks = [-(-n // bs) for n in lengths]
    order = torch.randperm(sum(blocks), generator=gen).tolist()   # scattered blocks, as a served cache
    scales = [(0.05 + torch.rand(2, kvh, generator=gen)).to(device)] if cache_dtype in (torch.int8,
                                                                                      torch.float8_e4m3fn) else None
    cache = PagedKVCache(1, sum(blocks), bs, kvh, hd, cache_dtype, device=device, kv_scales=scales)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, hd, 2) / hd)).to(device)
    tables, keys, values = [], [], []
    for n, nb in zip(lengths, blocks):
        table, order = order[:nb], order[nb:]
        k = torch.randn(n, kvh * hd, generator=gen).to(device)
        k = rope_ref(k, torch.arange(n, device=device), inv_freq, head_dim=hd)[0].reshape(n, kvh, hd)
        v = torch.randn(n, kvh, hd, generator=gen).to(device)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], device=device)
        stored = k.dtype if cache.quantized else cache_dtype    # a quantised cache takes fp32 to quantise
        cache.write(0, slots, k.to(stored), v.to(stored))
        # what the cache holds, in fp32: the reference attends over exactly that
        read_k, read_v = cache.read(0, torch.tensor(table, device=device), torch.float32)
        keys.append(read_k.float().reshape(-1, kvh, hd)[:n])
        values.append(read_v.float().reshape(-1, kvh, hd)[:n])
        tables.append(table)
    return PagedBatch(cache, tables, keys, values, inv_freq)


def padded(tables: list[list[int]], device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


def attention_checks(device, sizes: Sizes, target: str, gen: torch.Generator) -> list[Row]:
    rows = []
    for cache_dtype in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        name = str(cache_dtype).removeprefix("torch.")
        rows.append(check(f"paged prefill, rope, {name} KV", prefill_error(device, sizes, target, cache_dtype, gen),
                          2 ** -6, "ragged, prefix from cache"))
        for splits in (1, 4):
            rows.append(check(f"paged decode, rope, {name} KV, {'split-K x4' if splits > 1 else 'no split'}",
                              decode_error(device, sizes, target, cache_dtype, splits, gen), 2 ** -6))
    rows.append(kv_write_check(device, sizes, target, gen))
    return rows


def prefill_error(device, sizes: Sizes, target: str, cache_dtype, gen) -> float:
    """Queries of ragged chunks, each after a cached prefix, against attend() in fp32."""
    from llmc.codegen.triton.triton_attention import paged_prefill_attention
    from llmc.compiler.ops import rope_ref
    from llmc.runtime.attention import attend

    h, kvh, hd = sizes.heads, sizes.kv_heads, sizes.head_dim
    batch = paged_batch(device, sizes, [start + n for start, n in sizes.prefill_lens], cache_dtype, gen)
    q = torch.randn(sum(n for _, n in sizes.prefill_lens), h * hd, generator=gen).to(device, torch.bfloat16)
    positions = torch.cat([torch.arange(s, s + n) for s, n in sizes.prefill_lens]).to(device)
    cu = torch.tensor([0] + [n for _, n in sizes.prefill_lens], device=device).cumsum(0).to(torch.int32)
    starts = torch.tensor([s for s, _ in sizes.prefill_lens], dtype=torch.int32, device=device)
    scales = batch.cache.kv_scales[0] if batch.cache.quantized else None
    out = paged_prefill_attention(q, batch.cache.k_cache[0], batch.cache.v_cache[0], padded(batch.tables, device),
                                  cu, starts, num_heads=h, num_kv_heads=kvh, head_dim=hd, scale=hd ** -0.5,
                                  kv_scales=scales, positions=positions, inv_freq=batch.inv_freq, target=target)
    q_rot = rope_ref(q.float(), positions, batch.inv_freq, head_dim=hd)[0]
    refs = [attend(q_rot[cu[i]:cu[i + 1]], batch.keys[i], batch.values[i], start=s, num_heads=h, num_kv_heads=kvh,
                   head_dim=hd, scale=hd ** -0.5, causal=True) for i, (s, _) in enumerate(sizes.prefill_lens)]
    return relative_error(out, torch.cat(refs))


def decode_error(device, sizes: Sizes, target: str, cache_dtype, num_splits, gen) -> float:
    from llmc.codegen.triton.triton_attention import paged_decode_attention
    from llmc.compiler.ops import rope_ref
    from llmc.runtime.attention import attend

    h, kvh, hd = sizes.heads, sizes.kv_heads, sizes.head_dim
    lens = list(sizes.decode_lens)
    batch = paged_batch(device, sizes, lens, cache_dtype, gen)
    q = torch.randn(len(lens), h * hd, generator=gen).to(device, torch.bfloat16)
    positions = torch.tensor([n - 1 for n in lens], device=device)
    scales = batch.cache.kv_scales[0] if batch.cache.quantized else None
    out = paged_decode_attention(q, batch.cache.k_cache[0], batch.cache.v_cache[0], padded(batch.tables, device),
                                 torch.tensor(lens, dtype=torch.int32, device=device), num_heads=h, num_kv_heads=kvh,
                                 head_dim=hd, scale=hd ** -0.5, kv_scales=scales, num_splits=num_splits,
                                 positions=positions, inv_freq=batch.inv_freq, target=target)
    q_rot = rope_ref(q.float(), positions, batch.inv_freq, head_dim=hd)[0]
    refs = [attend(q_rot[i:i + 1], batch.keys[i], batch.values[i], start=n - 1, num_heads=h, num_kv_heads=kvh,
                   head_dim=hd, scale=hd ** -0.5, causal=True) for i, n in enumerate(lens)]
    return relative_error(out, torch.cat(refs))


def kv_write_check(device, sizes: Sizes, target: str, gen) -> Row:
    """int8 codes written by the kernel against runtime/kv_quant.quantize_kv (torch)."""
    from llmc.codegen.triton.triton_attention import write_kv_cache
    from llmc.runtime.paged_attention import PagedKVCache

    kvh, hd, bs, t = sizes.kv_heads, sizes.head_dim, sizes.block_size, sizes.rows
    scales = [(0.05 + torch.rand(2, kvh, generator=gen)).to(device)]
    ours, ref = (PagedKVCache(1, -(-t // bs) + 1, bs, kvh, hd, torch.int8, device=device, kv_scales=scales)
                 for _ in range(2))
    k, v = (torch.randn(t, kvh, hd, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    slots = torch.randperm(ours.k_cache[0].shape[0] * bs, generator=gen)[:t].to(device)
    write_kv_cache(k, v, ours.k_cache[0], ours.v_cache[0], slots, kv_scales=scales[0], target=target)
    ref.write(0, slots, k, v)
    diff = max(int((a.int() - b.int()).abs().max()) for a, b in zip(ours.k_cache + ours.v_cache,
                                                                       ref.k_cache + ref.v_cache))
    return Row("kernel check", "KV write int8 (codes)", diff, "max code diff", 0, diff == 0)


# -- timings ---------------------------------------------------------------------------------------
def random_bf16(device, *shape) -> torch.Tensor:
    """Timing operands, drawn on the device (GiB-sized caches would take seconds on the host)."""
    return torch.randn(*shape, device=device, dtype=torch.bfloat16)


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn: triton.testing.do_bench on a GPU, one timed call elsewhere."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def prefill_timings(device, sizes: Sizes, target: str) -> list[Row]:
    """Causal FlashAttention over b sequences of s tokens (keys already in a bf16 paged cache)
    against SDPA on dense tensors (K/V heads repeated, so SDPA may pick its flash backend)."""
    from llmc.codegen.triton.triton_attention import paged_prefill_attention

    h, kvh, hd, bs = sizes.heads, sizes.kv_heads, sizes.head_dim, sizes.block_size
    rows = []
    for b, s in sizes.prefill_timing:
        blocks = b * -(-s // bs)
        k_cache, v_cache = (random_bf16(device, blocks, bs, kvh, hd) for _ in range(2))
        tables = torch.arange(blocks, dtype=torch.int32, device=device).reshape(b, -1)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
        starts = torch.zeros(b, dtype=torch.int32, device=device)
        q = random_bf16(device, b * s, h * hd)
        ours = time_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, tables, cu, starts, num_heads=h,
                                                       num_kv_heads=kvh, head_dim=hd, scale=hd ** -0.5,
                                                       max_seqlen_q=s, target=target))
        qd = q.reshape(b, s, h, hd).transpose(1, 2)
        kd, vd = (c.reshape(b, -1, kvh, hd)[:, :s].transpose(1, 2).repeat_interleave(h // kvh, dim=1)
                  for c in (k_cache, v_cache))
        sdpa = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
        flops = 2 * b * h * s * s * hd     # causal: half of 4·b·h·s²·d
        rows.append(Row("prefill attention", f"b={b} s={s} h={h}/{kvh} d={hd}", flops / ours / 1e9, "TFLOP/s",
                        flops / sdpa / 1e9, note="reference: torch SDPA"))
    return rows


def decode_timings(device, sizes: Sizes, target: str, bandwidth: float) -> list[Row]:
    """Split-K paged decode over a bf16 cache; bytes = the keys and values every query reads."""
    from llmc.codegen.triton.triton_attention import paged_decode_attention

    h, kvh, hd, bs = sizes.heads, sizes.kv_heads, sizes.head_dim, sizes.block_size
    rows = []
    for b, ctx in sizes.decode_timing:
        per_seq = -(-ctx // bs)
        k_cache, v_cache = (random_bf16(device, b * per_seq, bs, kvh, hd) for _ in range(2))
        order = torch.randperm(b * per_seq, device=device).to(torch.int32)   # scattered blocks
        tables = order.reshape(b, per_seq)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        q = random_bf16(device, b, h * hd)
        ms = time_ms(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, num_heads=h, num_kv_heads=kvh,
                                                    head_dim=hd, scale=hd ** -0.5, target=target))
        read = 2 * b * ctx * kvh * hd * 2
        rows.append(Row("decode attention", f"b={b} ctx={ctx} h={h}/{kvh} d={hd}", read / ms / 1e6, "GB/s",
                        bandwidth / 1e9, note="reference: memory roofline"))
    return rows


def gemm_timings(device, sizes: Sizes, target: str, gen) -> list[Row]:
    from llmc.codegen.triton.triton_gemm import dequant_gemm, w8a8_gemm
    from llmc.compiler.quant import pack_int4, quantize_fp8, quantize_int4, quantize_int8

    rows = []
    for m, n, k in sizes.gemm_timing:
        x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(n, k, generator=gen) / math.sqrt(k)
        wb = w.to(device, torch.bfloat16)
        dense = time_ms(lambda: x @ wb.T)
        codes, s4, z4 = quantize_int4(w, sizes.group_size)
        q4, s4, z4 = pack_int4(codes).to(device), s4.to(device), z4.to(device)
        qf, sf = (t.to(device) for t in quantize_fp8(w))
        act = (x.float().abs().max() / 448.0).reshape(1)
        q8, s8 = (t.to(device) for t in quantize_int8(w))
        runs = {"int4 (g{})".format(sizes.group_size): lambda: dequant_gemm(x, q4, s4, z4, scheme="int4",
                                                                          group_size=sizes.group_size, target=target),
                "fp8 (static act)": lambda: dequant_gemm(x, qf, sf, scheme="fp8", act_scale=act, target=target),
                "w8a8": lambda: w8a8_gemm(x, q8, s8, target=target)}
        for name, fn in runs.items():
            ms = time_ms(fn)
            rows.append(Row("GEMM", f"{name} M={m} N={n} K={k}", 2 * m * n * k / ms / 1e9, "TFLOP/s",
                            2 * m * n * k / dense / 1e9, note="reference: torch bf16 matmul"))
    return rows


# -- SmolLM2 end to end -----------------------------------------------------------------------------
def model_rows(workdir: Path, source: str, deadline: float) -> list[Row]:
    """Compile SmolLM2 for each model target, then decode 128 tokens at batch 1 and 32 on CUDA."""
    import llmc
    from llmc.runtime.engine import Engine, EngineConfig
    from llmc.tools.bench import Workload, run_engine

    rows = []
    for target in MODEL_TARGETS:
        if time.monotonic() > deadline:
            rows.append(Row("SmolLM2 decode", target, None, "tokens/s", note="skipped: past the time budget"))
            continue
        t0 = time.monotonic()
        path = llmc.compile(source, target=target, output=workdir / f"smollm2-{target}.llmc", force=True,
                            calib_samples=4, calib_seq_len=64)
        compile_s = time.monotonic() - t0
        engine = Engine(path, EngineConfig(device="cuda", kv_memory="4GiB", max_num_seqs=64))
        for batch in (1, 32):
            requests = Workload(batch, 128, 128, seed=0).build(engine.model["vocab_size"])
            result = run_engine(engine, requests, progress=False)
            tpot = result.tpot_ms["p50"]
            rows.append(Row("SmolLM2 decode", f"{target} batch {batch}, 128 in / 128 out", batch * 1e3 / tpot,
                            "tokens/s", note=f"TPOT p50 {tpot:.2f} ms; compile {compile_s:.0f} s"))
        del engine
    return rows


# -- driver ----------------------------------------------------------------------------------------
SECTIONS = [
    ("kernel checks", "rms_norm, add_rms_norm, swiglu, rotary (bf16) vs compiler/ops.py references in fp32"),
    ("kernel checks", "int8/int4/fp8 dequant GEMM and w8a8 GEMM vs qlinear_ref (fp32)"),
    ("kernel checks", "paged prefill (ragged, cached prefix, fused rope) and decode (split-K and not) over "
                      "bf16/int8/fp8 KV caches vs fp32 attention; KV write int8 codes vs torch"),
    ("prefill attention", "FlashAttention prefill vs torch SDPA, TFLOP/s at s = 512..8192"),
    ("decode attention", "paged decode GB/s vs the GPU's memory roofline"),
    ("GEMM", "int4 / fp8 / w8a8 GEMMs vs torch bf16 matmul, TFLOP/s"),
    ("SmolLM2 decode", f"decode tokens/s of SmolLM2 compiled for {', '.join(MODEL_TARGETS)} (batch 1 and 32)"),
]


def detect_gpu() -> dict:
    props = torch.cuda.get_device_properties(0)
    name = props.name
    bandwidth = next((bw for fragment, bw in BANDWIDTHS if fragment in name), None)
    copy = measured_copy_bandwidth()
    return {"name": name, "capability": f"{props.major}.{props.minor}",
            "family": FAMILIES.get((props.major, props.minor), "h100"), "memory_gib": props.total_memory / 2**30,
            "datasheet_bandwidth": bandwidth, "copy_bandwidth": copy, "roofline_bandwidth": bandwidth or copy}


def measured_copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the roofline of unknown GPUs."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms * 1e3


def run_all(device, sizes: Sizes, target: str, bandwidth: float, skip_model: bool, workdir: Path,
            model_source: str, deadline: float) -> list[Row]:
    gen = torch.Generator().manual_seed(0)   # the checks' inputs
    torch.manual_seed(0)                     # the timings' (drawn on the device)
    rows = elementwise_checks(device, sizes, target, gen) + gemm_checks(device, sizes, target, gen)
    rows += attention_checks(device, sizes, target, gen)
    rows += prefill_timings(device, sizes, target) + decode_timings(device, sizes, target, bandwidth)
    rows += gemm_timings(device, sizes, target, gen)
    if not skip_model:
        rows += model_rows(workdir, model_source, deadline)
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [f"{'section':<18} {'case':<58} {'ours':>10} {'reference':>10} {'unit':<13} ok/note"]
    for r in rows:
        ours = "-" if r.value is None else f"{r.value:10.4g}"
        ref = "" if r.reference is None else f"{r.reference:10.4g}"
        flag = "" if r.ok is None else ("ok" if r.ok else "FAIL")
        lines.append(f"{r.section:<18} {r.case:<58} {ours:>10} {ref:>10} {r.unit:<13} {flag} {r.note}".rstrip())
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out/gpu_check.json", help="JSON results file")
    ap.add_argument("--skip-model", action="store_true", help="skip the SmolLM2 compile and decode runs")
    ap.add_argument("--model", default="smollm2-135m",
                    help="model source for the decode runs (sample name, GGUF file or HF dir)")
    ap.add_argument("--dry-run", action="store_true", help="list the checks and exit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        for section, what in SECTIONS:
            print(f"{section:<18} {what}")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; run it where an NVIDIA GPU is present", file=sys.stderr)
        return 2
    start = time.monotonic()
    gpu = detect_gpu()
    with tempfile.TemporaryDirectory(prefix="llmc-gpu-check-") as workdir:
        rows = run_all(torch.device("cuda"), Sizes.gpu(), gpu["family"], gpu["roofline_bandwidth"],
                       args.skip_model, Path(workdir), args.model, start + DEADLINE_S)
    print(f"{gpu['name']} (sm_{gpu['capability'].replace('.', '')}, llmc family {gpu['family']}), "
          f"roofline {gpu['roofline_bandwidth'] / 1e9:.0f} GB/s, measured copy {gpu['copy_bandwidth'] / 1e9:.0f} GB/s")
    print(format_table(rows))
    result = {"gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
              "seconds": time.monotonic() - start, "rows": [r.to_dict() for r in rows]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
