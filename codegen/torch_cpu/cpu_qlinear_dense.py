"""qlinear on the CPU for many rows (prefill, large batches): dequantise the stored codes into a
reused fp32 scratch and run one fp32 GEMM, exactly the reference (compiler/ops.qlinear_ref). The
low-bit kernels (cpu_qlinear.py, cpu_qlinear_a8.py) win at a few rows, where reading the weight
dominates; from some row count on the dense GEMM wins, because torch's packed kernels and bf16/int8
GEMMs run far below the fp32 GEMM's rate on CPUs without AVX512-BF16/VNNI. Measured on this 2-core
AMD EPYC (AVX2), one thread, N=3072 K=576 (SmolLM2's gate/up), ms per call:
    M=1:   fp32 0.52, int4pack 0.31, int8pack 0.16
    M=64:  fp32 9.3,  int4pack 22.4, int8pack 21.2, bf16 70.8
    M=512: fp32 80,   int4pack 134,  int8pack 149
and dequantising the 4-bit codes into the scratch costs ~1 ms (8 ms through compiler.quant's
allocating ops). Where the two cross is measured per weight shape and thread count at load
(`choose_dense_from`), or at compile under `--kernels auto` (the default), which records it in
plan.meta["kernel_choice"]["qlinear_dispatch"] for the runtime and `llmc inspect` (measured once per
machine, compiler/driver/tuning/qlinear_dispatch.py)."""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmc.codegen.native import cpu_native
from llmc.compiler.quant import (
    AFFINE4_CENTRE,
    fake_quant_fp8,
    fake_quant_int8_per_token,
    group_params,
    is_packed,
    packed_groups,
)
from llmc.compiler.schemes import FLOAT_OFFSET, FP8_STATIC, INT8_PER_TOKEN, INT_ZERO, SCHEMES
from llmc.errors import RuntimeLlmcError

# row counts timed per shape (a prefill chunk or a batch of 64 decodes is hundreds of rows); timing
# stops once the dense GEMM has won twice in a row
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# dense_from when the packed kernel still won at the largest probe: more rows than any plan batches
NEVER_DENSE = 1 << 20
DISPATCH_META = "qlinear_dispatch"
DENSE_FROM_ENV = "LLMC_QLINEAR_DENSE_FROM"


class DenseSource(NamedTuple):
    """A qlinear's stored params, ready to dequantise per group of K: int4 w = (q - z) * s, affine
    w = q * s + m (affine4 without minimums (q - 8) * s), int8/w8a8/fp8 w = q * s per channel."""
    scheme: str
    codes: torch.Tensor             # as stored: uint8 [N, K/2] (two nibbles), int8 or fp8 [N, K]
    scales: torch.Tensor            # [N, groups] (per channel: groups = 1), fp32 or fp16/bf16 (widened exactly),
                                    # or K-quant packed rows (uint8; compiler/quant.py's pack_k_params)
    zeros: torch.Tensor | None      # int4: zero points [N, groups]
    mins: torch.Tensor | None       # affine: minimums [N, groups]
    act_scale: torch.Tensor | None  # fp8: the static activation scale
    out_features: int
    in_features: int

    def rows(self, start: int, end: int) -> DenseSource:
        """Output rows start..end of the weight (views)."""
        cut = (lambda t: None if t is None else t[start:end])
        return self._replace(codes=self.codes[start:end], scales=self.scales[start:end], zeros=cut(self.zeros),
                             mins=cut(self.mins), out_features=end - start)


class DispatchedWeights(NamedTuple):
    """A low-bit kernel's packed weights for few rows, the dense source from `dense_from` rows."""
    packed: object
    dense: DenseSource
    dense_from: int


def dense_source(scheme: str, qweight, scales, zeros, act_scale) -> DenseSource | None:
    """The stored params as they are (views: the in-place dequantisation widens fp16 and bf16 exactly)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * SCHEMES[scheme].codes_per_element
    s = scales.reshape(n, -1) if scales.numel() > 1 else scales.float().reshape(1, 1).expand(n, 1)
    as_groups = (lambda t: None if t is None else _widenable(t).reshape(n, -1))
    zero_point = SCHEMES[scheme].zero_point
    return DenseSource(scheme, qweight, _widenable(s), as_groups(zeros) if zero_point == INT_ZERO else None,
                       as_groups(zeros) if zero_point == FLOAT_OFFSET else None,
                       None if act_scale is None else act_scale.float(), n, k)


def _widenable(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float16, torch.bfloat16) or is_packed(t) else t.float()


def q4_source(scheme: str, w) -> DenseSource:
    """The dense source of a 4-bit weight held in the native GEMV's form only (cpu_native.Q4Weights): its
    codes as stored, its zero points or offsets its `other` (one row of them broadcast where all rows share
    it)."""
    n, k = w.packed.shape[0], 2 * w.packed.shape[1]
    second = w.other.expand(n, -1)
    zeros, mins = (second, None) if w.zero_point else (None, second)
    return DenseSource("int4" if w.zero_point else scheme, w.packed, w.scales, zeros, mins, None, n, k)


_scratch = threading.local()
_scratches: weakref.WeakSet = weakref.WeakSet()   # every thread's, for scratch_bytes


DENSE_BLOCK_BYTES = 256 * 2**20


def _scratch_for(n: int, k: int) -> torch.Tensor:
    """An fp32 [n, k] view of one buffer per thread, grown to the largest weight it has held: layers
    dequantise one at a time, so every shape shares it (a buffer per shape held Llama-1B's four
    projections' 244 MB at once)."""
    buf = getattr(_scratch, "buffer", None)
    with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
        if buf is None or buf.numel() < n * k:
            buf = _scratch.buffer = torch.empty(n * k)
            _scratches.add(buf)
        return buf[:n * k].view(n, k)


def scratch_bytes() -> int:
    """Bytes of the dequantisation buffers the threads hold."""
    return sum(buf.nbytes for buf in _scratches)


def dequantize_into(src: DenseSource, out: torch.Tensor) -> torch.Tensor:
    """The weight src stands for, written into `out` [N, K]; the same fp32 operations, in the same
    order, as compiler.quant.dequantize_weight, so bit-identical to it."""
    n, k = src.out_features, src.in_features
    if SCHEMES[src.scheme].packed:
        pairs = out.view(n, k // 2, 2)
        pairs[..., 0].copy_(src.codes & 0x0F)
        pairs[..., 1].copy_(src.codes >> 4)
    else:
        out.copy_(src.codes)
    scales, mins = group_params(src.scales, k), group_params(src.mins, k)   # K-quant packed rows: unpacked here
    groups = out.view(n, scales.shape[1], -1)
    if src.zeros is not None:
        groups.sub_(src.zeros[..., None])
    elif src.scheme == "affine4" and mins is None:
        groups.sub_(AFFINE4_CENTRE)
    groups.mul_(scales[..., None])
    if mins is not None:
        groups.add_(mins[..., None])
    return out


def run_dense(x: torch.Tensor, src: DenseSource, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] as qlinear_ref computes it (activations fake-quantised for fp8/w8a8).
    A weight over DENSE_BLOCK_BYTES in fp32 (an 8B model's LM head: 805 MB) is dequantised and
    multiplied a block of output rows at a time, so the scratch stays that size."""
    h = x.float()
    activations = SCHEMES[src.scheme].activations
    if activations == FP8_STATIC and src.act_scale is not None:
        h = fake_quant_fp8(h, src.act_scale)
    elif activations == INT8_PER_TOKEN:
        h = fake_quant_int8_per_token(h)
    bias = None if bias is None else bias.float()
    block = max(1, DENSE_BLOCK_BYTES // (4 * src.in_features))
    if src.out_features <= block:
        return F.linear(h, dequantize_into(src, _scratch_for(src.out_features, src.in_features)), bias).to(x.dtype)
    out = h.new_empty(*h.shape[:-1], src.out_features)
    for start in range(0, src.out_features, block):
        end = min(start + block, src.out_features)
        weight = dequantize_into(src.rows(start, end), _scratch_for(end - start, src.in_features))
        out[..., start:end] = F.linear(h, weight, None if bias is None else bias[start:end])
    return out.to(x.dtype)


def run_dense_rows(x: torch.Tensor, src: DenseSource) -> torch.Tensor | None:
    """fp32 rows x [rows, K] -> [rows, N] as run_dense, through the native fp32 GEMV (one dot product per
    output, in the same order at every row count: batch-invariant) instead of the GEMM; None where that
    GEMV does not run."""
    h = x
    activations = SCHEMES[src.scheme].activations
    if activations == FP8_STATIC and src.act_scale is not None:
        h = fake_quant_fp8(h, src.act_scale)
    elif activations == INT8_PER_TOKEN:
        h = fake_quant_int8_per_token(h)
    block = max(1, DENSE_BLOCK_BYTES // (4 * src.in_features))
    out = h.new_empty(h.shape[0], src.out_features)
    for start in range(0, src.out_features, block):
        end = min(start + block, src.out_features)
        weight = dequantize_into(src.rows(start, end), _scratch_for(end - start, src.in_features))
        y = cpu_native.gemv_f32(h, weight)
        if y is None:
            return None
        out[:, start:end] = y
    return out


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def shape_key(scheme: str, qweight: torch.Tensor, scales: torch.Tensor) -> str:
    """The dispatch record's key: scheme, N x K and the groups per row of the scales."""
    src_k = qweight.shape[1] * SCHEMES[scheme].codes_per_element
    groups = scales.shape[1] if scales.dim() == 2 else (1 if scales.numel() > 1 else 0)
    groups = packed_groups(groups, src_k) if is_packed(scales) else groups
    return f"{scheme} {qweight.shape[0]}x{src_k} groups {groups}"


def recorded(meta: dict | None) -> dict:
    """The dispatch record `--kernels auto` stores in plan.meta["kernel_choice"] ({} when none)."""
    record = ((meta or {}).get("kernel_choice") or {}).get(DISPATCH_META)
    return record if isinstance(record, dict) else {}


# (shape key, threads) -> measure_shape's record, for the shapes measured at load in this process
MEASURED: dict[tuple[str, int], dict] = {}


def choose_dense_from(meta: dict | None, key: str, packed_run, src: DenseSource) -> int:
    """The row count from which this shape runs dense: LLMC_QLINEAR_DENSE_FROM when set, else what
    the plan records (`--kernels auto` measures at compile), else (`--kernels cpu|ort` plans)
    measured here once per shape and thread count."""
    forced = os.environ.get(DENSE_FROM_ENV)
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise RuntimeLlmcError(f"{DENSE_FROM_ENV}={forced!r} is no row count; set it to a positive integer "
                                   f"or unset it")
        return int(forced)
    entry = recorded(meta).get("shapes", {}).get(key)
    value = entry.get("dense_from") if isinstance(entry, dict) else None
    if type(value) is int and value >= 1:
        return value
    threads = torch.get_num_threads()
    if (key, threads) not in MEASURED:
        with torch.inference_mode():
            MEASURED[(key, threads)] = measure_shape(packed_run, src)
    return MEASURED[(key, threads)]["dense_from"]


# a probe's repeats stop early once MIN_REPEATS have run and they took PROBE_BUDGET_S: the best of two
# or three calls of many milliseconds is as steady as of five, and five at 256 and 512 rows took a
# second of SmolLM2's compile. Where the first calls already differ by CLEAR_MARGIN, no repeat would
# change which is faster, and none is made: SmolLM2's LM head (49152 x 576, 83 ms a dense call at one
# row against 3 ms packed) took 7 s of its first compile's timings with them.
MIN_REPEATS = 2
PROBE_BUDGET_S = 0.03
CLEAR_MARGIN = 2.0


def _time_us(runs, x, repeats: int) -> list[float]:
    """Best microseconds per call of each of `runs` on x, their calls alternated so that both meet
    the same machine (a burst of other work slows both, not one); the first calls' times alone where
    they differ by CLEAR_MARGIN."""
    first = []
    for fn in runs:
        start = time.perf_counter()
        fn(x)
        first.append(time.perf_counter() - start)
    if max(first) >= CLEAR_MARGIN * min(first):
        return [round(b * 1e6, 1) for b in first]
    best = [float("inf")] * len(runs)
    began = time.perf_counter()
    for repeat in range(repeats):
        for i, fn in enumerate(runs):
            start = time.perf_counter()
            fn(x)
            best[i] = min(best[i], time.perf_counter() - start)
        if repeat + 1 >= MIN_REPEATS and time.perf_counter() - began > PROBE_BUDGET_S:
            break
    return [round(b * 1e6, 1) for b in best]


def measure_shape(packed_run, src: DenseSource, repeats: int = 5, rows: tuple[int, ...] = PROBE_ROWS) -> dict:
    """Microseconds per call of the packed kernel and of dequantise + fp32 GEMM at `rows`
    (interleaved, minimum of `repeats`), and the row count from which the dense GEMM is chosen:
    the first probe from which it won at every later probe timed (NEVER_DENSE if it lost at the
    last). Timed on one thread: threads that share their cores with other processes wait for each
    other at every barrier, which on this 2-core host under load made 80 us calls take 100 ms and
    chose dense w8a8 from 64 rows (its int8 GEMM is 4x faster there); which kernel wins is a
    property of the kernels, not of the thread count."""
    us: dict[str, dict[int, float]] = {"packed": {}, "dense": {}}
    dense_from, wins = NEVER_DENSE, 0
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for count in rows:
            x = torch.randn(count, src.in_features)
            us["packed"][count], us["dense"][count] = _time_us((packed_run, lambda h: run_dense(h, src)), x, repeats)
            if us["dense"][count] <= us["packed"][count]:
                dense_from, wins = min(dense_from, count), wins + 1
                if wins == 2:
                    break
            else:
                dense_from, wins = NEVER_DENSE, 0
    finally:
        torch.set_num_threads(previous)
        _scratch.buffer = None   # a load's probe of the LM head's shape would keep its fp32 size held
    return {"us": {name: {str(r): t for r, t in times.items()} for name, times in us.items()},
            "dense_from": dense_from}


__all__ = ["DenseSource", "DispatchedWeights", "dense_source", "q4_source", "scratch_bytes", "dequantize_into",
           "run_dense", "run_dense_rows", "rows_of", "shape_key", "choose_dense_from", "recorded", "measure_shape",
           "MEASURED", "DENSE_FROM_ENV", "DISPATCH_META", "PROBE_ROWS", "NEVER_DENSE"]
