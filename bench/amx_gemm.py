"""GMAC/s of the AMX 4-bit GEMM (codegen/native/gemm_amx.c) against the current native 4-bit kernel (the
int8-activation VNNI GEMV, 8 rows a call, as cpu_native.gemm runs it) in the same run, on SmolLM2-135M's
Q4_1 projection shapes with the weights in cache; and the repack's rate in GB/s of stored weights.
Both kernels are called through ctypes with their outputs made beforehand; best of 5 medians.
Usage: python bench/amx_gemm.py [--threads N] [--rows 1,8,16,64,256]

On the 2-core Xeon (AMX-INT8, 2 threads, load average 2.0 with other work running) at m = 1 / 16 / 64:
960x576 67 / 315 / 371 GMAC/s against 25 / 71 / 77 (2.6x / 4.4x / 4.9x); 3072x576 103 / 419 / 460 against
35 / 87 / 86; 576x1536 69 / 321 / 349 against 43 / 120 / 120 (1.6x / 2.7x / 2.9x: the current GEMV is at
its best on long rows). Repack 6-8 GB/s."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from llmc.codegen.native import cpu_native as cn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "codegen"))
import amx_reference as ar  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # N x K: q/o (and k/v), gate/up, down
GROUP = 32


def best_rate(fn, macs: float, seconds: float = 0.15) -> float:
    """GMAC/s: the best of 5 medians of timed calls"""
    fn()
    calls = max(1, int(seconds / max(1e-7, _once(fn))))
    medians = []
    for _ in range(5):
        times = []
        for _ in range(calls):
            times.append(_once(fn))
        medians.append(statistics.median(times))
    return macs / min(medians) / 1e9


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def current_gemm(lib, x: torch.Tensor, w: cn.Q4Weights, y: torch.Tensor, threads: int):
    """cpu_native.gemm's loop without its Python wrapping: llmc_gemv_q4 on MAX_ROWS rows a call"""
    rows, k = x.shape
    n = w.packed.shape[0]
    for start in range(0, rows, cn.MAX_ROWS):
        part = min(cn.MAX_ROWS, rows - start)
        lib.llmc_gemv_q4(x[start].data_ptr(), x.stride(0), part, w.packed.data_ptr(), w.scales.data_ptr(),
                         w.other.data_ptr(), cn.q4_other_row(w), True, False, n, k, GROUP, y[start].data_ptr(),
                         threads, cn.q4_flags(w))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,16,64,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    amx = ar.build(Path(tempfile.mkdtemp()))
    if not amx.llmc_amx_ready():
        sys.exit("AMX-INT8 not usable here")
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads; GMAC/s (current: VNNI GEMV 8 rows a call,"
          " with / without its L2 prefetch)")
    print(f"{'N x K':>11} {'rows':>5} {'amx':>8} {'current':>16} {'x':>6}")
    for n, k in SHAPES:
        packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        scales = (rng.random((n, k // GROUP)) * 0.02 + 0.002).astype(np.float16)
        mins = (-rng.random((n, k // GROUP)) * 0.15).astype(np.float16)
        tiles = ar.repack(amx, packed, scales, mins, False, args.threads)
        weights = {cached: cn.q4_weights(torch.from_numpy(packed), torch.from_numpy(scales), torch.from_numpy(mins),
                                         False, "int8", cached) for cached in (True, False)}
        lib = cn._load()[0]
        for m in rows:
            x = torch.randn(m, k)
            xn = x.numpy()
            y = np.empty((m, n), np.float32)
            yt = torch.empty(m, n)
            macs = m * n * k
            px, pt, py = xn.ctypes.data, tiles.ctypes.data, y.ctypes.data   # (each .ctypes costs about 1 us)
            fast = best_rate(lambda: amx.llmc_gemm_q4_amx(px, k, m, pt, n, k, GROUP, 0, py, args.threads), macs)
            now = [best_rate(lambda w=w: current_gemm(lib, x, w, yt, args.threads), macs) for w in weights.values()]
            print(f"{n:>5} x {k:<4} {m:>5} {fast:8.1f} {now[0]:7.1f} / {now[1]:6.1f} {fast / max(now):6.2f}")
        stored = packed.nbytes + scales.nbytes + mins.nbytes
        out = np.empty(amx.llmc_q4_tiles_bytes(n, k, GROUP, 1, k // GROUP), np.uint8)
        seconds = min(_once(lambda: amx.llmc_q4_repack(packed.ctypes.data, scales.ctypes.data, mins.ctypes.data,
                                                       k // GROUP, 1, 0, n, k, GROUP, out.ctypes.data, args.threads))
                      for _ in range(20))
        rate = stored / seconds / 1e9
        print(f"{n:>5} x {k:<4} repack {rate:.2f} GB/s of stored weights ({stored} -> {out.nbytes} B)")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
