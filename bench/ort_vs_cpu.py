"""Batch-1 decode and one-request prefill of artifacts side by side in one process, interleaved
round by round so a busy machine slows each alike (for `--kernels cpu` against `--kernels ort` builds
of one model). Prints the best round's tok/s per artifact.
Usage: python bench/ort_vs_cpu.py ART [ART ...] [--rounds 3] [--decode 64] [--prefill 512]."""

from __future__ import annotations

import argparse
import time

import torch

import llmc
from llmc.runtime.sampling_params import SamplingParams


def timed_generate(model, prompt: list[int], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    model.generate({"prompt_token_ids": prompt}, params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", type=int, default=64, help="decode tokens after a 128-token prompt")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill row")
    args = parser.parse_args()
    # no prefix caching: every round repeats its prompts, and a cached prompt would skip the prefill
    models = {path: llmc.load(path, enable_prefix_caching=False) for path in args.artifacts}
    vocab = min(m.engine.model["vocab_size"] for m in models.values())
    prompt = torch.randint(3, vocab, (128,)).tolist()
    long_prompt = torch.randint(3, vocab, (args.prefill,)).tolist()
    best = {path: {"decode": 0.0, "prefill": 0.0} for path in models}
    for _ in range(args.rounds):
        for path, model in models.items():
            # decode tok/s: the generate time less a one-token generate of the same prompt (its prefill)
            decode = timed_generate(model, prompt, args.decode + 1) - timed_generate(model, prompt, 1)
            prefill = timed_generate(model, long_prompt, 1)
            best[path]["decode"] = max(best[path]["decode"], args.decode / decode)
            best[path]["prefill"] = max(best[path]["prefill"], args.prefill / prefill)
    print(f"{'artifact':<40} {'decode tok/s':>13} {'prefill tok/s':>14}  (threads {torch.get_num_threads()})")
    for path, b in best.items():
        print(f"{path:<40} {b['decode']:>13.1f} {b['prefill']:>14.0f}")


if __name__ == "__main__":
    main()
