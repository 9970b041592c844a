"""Batch-1 decode against the memory's streaming rate of the same minute: on a shared host that rate moves
between runs (an AMD EPYC: torch.mv over 2 GiB 14-22 GB/s), so a decode's share of a probe taken earlier
says little. Rounds of (torch.mv over 2 GiB, best of 3; then 64 decode steps), each reporting the weights'
read rate and its share of that round's mv rate.
Usage: python bench/decode_vs_memory.py ART [--rounds 3] [--threads 2]"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# isort: off
import llmc  # (before torch, so that its tensors go on huge pages as under the CLI)
import torch
# isort: on

from llmc import SamplingParams

PROMPT = "Tell me a long story about a cat and a dog. " * 3
STEPS = 64


def mv_rate(big: torch.Tensor, ones: torch.Tensor) -> float:
    torch.mv(big, ones)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        torch.mv(big, ones)
        best = min(best, time.perf_counter() - t)
    return big.numel() * 4 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = llmc.load(args.artifact, kv_memory="256MiB", threads=args.threads)
    weights = sum(f.stat().st_size for f in Path(args.artifact).glob("*.safetensors")) / 1e9
    big = torch.empty((2048 << 20) // (4 * 4096), 4096).fill_(1.0)
    ones = torch.ones(4096)

    def generate(n: int) -> float:
        t = time.perf_counter()
        llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t

    generate(2)
    for r in range(args.rounds):
        rate = mv_rate(big, ones)
        tpot = (generate(STEPS + 1) - generate(1)) / STEPS
        print(f"round {r}: torch.mv {rate:.1f} GB/s; TPOT {tpot * 1e3:.1f} ms ({1 / tpot:.2f} tok/s), "
              f"{weights:.2f} GB of weights at {weights / tpot:.1f} GB/s = {weights / tpot / rate:.0%} of mv; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
