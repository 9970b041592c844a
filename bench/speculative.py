"""Speculative against plain decoding at batch 1, interleaved request by request on one engine (the
speculator detached for the plain runs, the order alternating), so a busy machine slows both alike.
Decode tok/s counts the tokens after the first over the time from the first token to the last, so
the prefill, the same in both, does not dilute the ratio.
Usage: python bench/speculative.py ART [--workload grounded|open] [-n 8] [--output-len 64] [-k 5]
       [--draft DRAFT_ART] [--threads 1]"""

from __future__ import annotations

import argparse
import json
import time

from llmc.runtime.bench_workloads import text_prompts
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams


def decode_run(engine: Engine, prompt: str, max_tokens: int) -> tuple[int, float]:
    """(tokens after the first, seconds from the first token to the last) of one greedy request."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("r", prompt=prompt, params=params)
    first = None
    while engine.has_unfinished():
        out = engine.step()
        if first is None and out and out[0].outputs[0].token_ids:
            first, n_first = time.perf_counter(), len(out[0].outputs[0].token_ids)
    return max_tokens - n_first, time.perf_counter() - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--workload", default="grounded", choices=["grounded", "open"])
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = ({"method": "draft", "model": args.draft} if args.draft else {"method": "ngram"}) | \
        {"num_speculative_tokens": args.k}
    engine = Engine(args.artifact, EngineConfig(max_num_seqs=1, threads=args.threads, kv_memory="512MiB",
                                                enable_prefix_caching=False, speculative=spec))
    speculator = engine.speculator
    decode_run(engine, "warm up", 8)
    totals = {"plain": [0, 0.0], "speculative": [0, 0.0]}
    speculator.metrics.__init__()
    for i, prompt in enumerate(text_prompts(args.workload, args.n, args.seed)):
        for mode in (("plain", "speculative") if i % 2 == 0 else ("speculative", "plain")):
            engine.speculator = speculator if mode == "speculative" else None
            tokens, seconds = decode_run(engine, prompt, args.output_len)
            totals[mode][0] += tokens
            totals[mode][1] += seconds
    rate = {mode: tokens / seconds for mode, (tokens, seconds) in totals.items()}
    print(json.dumps({"workload": args.workload, "requests": args.n, "output_len": args.output_len,
                      "method": spec["method"], "k": args.k, "plain_decode_tok_s": rate["plain"],
                      "speculative_decode_tok_s": rate["speculative"],
                      "speedup": rate["speculative"] / rate["plain"], **speculator.metrics.to_dict()}))


if __name__ == "__main__":
    main()
