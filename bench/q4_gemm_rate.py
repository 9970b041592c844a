"""The native 4-bit GEMM's rate on int8 activations by row count, in Llama-3B's FFN shapes (Q4_1 form,
random codes): what a prefill (512 rows), a speculative verification or a batched decode step (2-8) and a
decode step (1) get from it. Median of 5 calls after one warm-up, in GOPS (2 x rows x N x K a call).
Usage: python bench/q4_gemm_rate.py [--threads N] [--rows 1,2,4,8,64,512]"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import llmc  # noqa: F401 (before torch, so that its tensors go on huge pages as under the CLI)
import torch
# isort: on

from llmc.codegen.native import cpu_native

SHAPES = ((8192, 3072), (3072, 8192))   # (N, K): gate/up, down
GROUP = 32


def median_seconds(fn) -> float:
    fn()
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,64,512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = cpu_native.q4_weights(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                                  (torch.rand(n, k // GROUP) * 0.01).half(),
                                  (torch.randn(n, k // GROUP) * 0.01).half(), False, "int8")
        if w is None or not cpu_native.takes_int8(k, GROUP):
            raise SystemExit(f"the native int8-activation GEMM does not run here: {cpu_native.status()}")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            seconds = median_seconds(lambda: cpu_native.gemm(x, w))
            print(f"{k} -> {n}, {rows} rows: {seconds * 1e3:.2f} ms, {2 * rows * n * k / seconds / 1e9:.1f} GOPS")
    print(cpu_native.status())


if __name__ == "__main__":
    main()
