"""The native 4-bit GEMV's read rate with its weights in DRAM and in cache, beside torch's fp32 GEMV
over 2 GiB (the memory's own rate) in the same run: whether the GEMV is bound by memory or by its
arithmetic. 24 weights of 14336 x 4096 in Q4_1 form (0.88 GB), one row of activations, best of 4.
Usage: python bench/q4_gemv_bandwidth.py [--threads N]"""

from __future__ import annotations

import argparse
import time

# isort: off
import llmc  # noqa: F401 (before torch, so that its tensors go on huge pages as under the CLI)
import torch
# isort: on

from llmc.codegen.native import cpu_native

N, K, GROUP, COUNT = 14336, 4096, 32, 24


def best_seconds(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [cpu_native.q4_weights(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8),
                                     (torch.rand(N, K // GROUP) * 0.01).half(),
                                     (torch.randn(N, K // GROUP) * 0.01).half(), False, "int8")
               for _ in range(COUNT)]
    if weights[0] is None or not cpu_native.available():
        raise SystemExit(f"the native GEMV does not run here: {cpu_native.status()}")
    each = sum(t.numel() * t.element_size() for t in (weights[0].packed, weights[0].scales, weights[0].other))
    x = torch.randn(1, K)
    for name in cpu_native.Q4_ACTIVATIONS:   # the same weights on each activation rounding
        ws = [w._replace(int8=name == "int8") for w in weights]
        dram = best_seconds(lambda: [cpu_native.gemv_q4(x, w) for w in ws], 4)
        cached = best_seconds(lambda: [cpu_native.gemv_q4(x, ws[0]) for _ in range(10)], 4) / 10
        print(f"threads {args.threads}, {name} activations: Q4 GEMV in DRAM {COUNT * each / dram / 1e9:.1f} GB/s, "
              f"in cache {each / cached / 1e9:.1f} GB/s")
    big = torch.empty((2048 << 20) // (4 * K), K).fill_(1.0)
    ones = torch.ones(K)
    mv = best_seconds(lambda: torch.mv(big, ones), 3)
    print(f"torch.mv fp32 over 2 GiB {big.numel() * 4 / mv / 1e9:.1f} GB/s ({cpu_native.status()})")


if __name__ == "__main__":
    main()
