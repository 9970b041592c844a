"""Speculative against plain decoding at batch 1, interleaved request by request on one engine (the
speculator detached for the plain runs, the order rotating), so a busy machine slows both alike.
Decode tok/s counts the tokens after the first over the time from the first token to the last, so
the prefill, the same in both, does not dilute the ratio. Requests end at EOS, as a user's do
(--output-len caps them; --ignore-eos generates all of it); greedy speculation must give plain
decoding's tokens, so every mode does the same work, and a request whose tokens differ stops the run.
With --tree N, n-gram token trees of N candidates run as a third mode beside the chains. The load
average is printed with the result.
Usage: python bench/speculative.py ART [--workload grounded|open] [-n 8] [--output-len 64] [-k 5]
       [--draft DRAFT_ART] [--tree N] [--threads 1] [--ignore-eos]"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from llmc.tools.bench_workloads import text_prompts


def decode_run(engine: Engine, prompt: str, max_tokens: int, ignore_eos: bool) -> tuple[list[int], int, float]:
    """(output token ids, tokens after the first, seconds from the first token to the last) of one
    greedy request."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    engine.add_request("r", prompt=prompt, params=params)
    first = None
    while engine.has_unfinished():
        out = engine.step()
        if out and out[0].outputs[0].token_ids:
            token_ids = list(out[0].outputs[0].token_ids)
            if first is None:
                first, n_first = time.perf_counter(), len(token_ids)
    return token_ids, len(token_ids) - n_first, time.perf_counter() - first


def check_same_tokens(i: int, outputs: dict[str, list[int]]) -> None:
    """Every mode must give plain decoding's tokens: else the modes did different work (and
    speculation has a bug)."""
    plain = outputs["plain"]
    for mode, ids in outputs.items():
        if ids != plain:
            at = next((j for j, (a, b) in enumerate(zip(ids, plain)) if a != b), min(len(ids), len(plain)))
            sys.exit(f"bench/speculative.py: prompt {i}: {mode} decoding differs from plain at output token {at} "
                     f"({len(ids)} tokens against {len(plain)}); greedy speculation must be token-identical")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--workload", default="grounded", choices=["grounded", "open"])
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--tree", type=int, default=1, help="n-gram candidates per token tree (1: chains only)")
    parser.add_argument("--lookup-min", type=int, default=None, help="prompt_lookup_min (default: the config's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="generate --output-len tokens past EOS")
    args = parser.parse_args(argv)
    spec = ({"method": "draft", "model": args.draft} if args.draft else {"method": "ngram"}) | \
        {"num_speculative_tokens": args.k} | ({} if args.draft else {"tree_candidates": args.tree}) | \
        ({} if args.lookup_min is None else {"prompt_lookup_min": args.lookup_min})
    engine = Engine(args.artifact, EngineConfig(max_num_seqs=1, threads=args.threads, kv_memory="512MiB",
                                                enable_prefix_caching=False, speculative=spec))
    speculator = engine.speculator
    decode_run(engine, "warm up", 8, ignore_eos=True)
    modes = ["plain", "speculative"] + (["tree"] if args.tree > 1 else [])
    totals = {mode: [0, 0.0] for mode in modes}
    produced = 0
    metrics = {mode: type(speculator.metrics)() for mode in modes[1:]}
    load_before = os.getloadavg()
    for i, prompt in enumerate(text_prompts(args.workload, args.n, args.seed)):
        outputs = {}
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            engine.speculator = None if mode == "plain" else speculator
            if mode != "plain":
                speculator.metrics = metrics[mode]
                speculator.config.tree_candidates = args.tree if mode == "tree" else 1
            outputs[mode], tokens, seconds = decode_run(engine, prompt, args.output_len, args.ignore_eos)
            totals[mode][0] += tokens
            totals[mode][1] += seconds
        check_same_tokens(i, outputs)
        produced += len(outputs["plain"])
    rate = {mode: tokens / seconds for mode, (tokens, seconds) in totals.items()}
    result = {"workload": args.workload, "requests": args.n, "output_len": args.output_len,
              "ignore_eos": args.ignore_eos, "mean_output_tokens": produced / args.n,
              "method": spec["method"], "k": args.k, "lookup_min": speculator.config.prompt_lookup_min,
              "plain_decode_tok_s": rate["plain"],
              "speculative_decode_tok_s": rate["speculative"], "speedup": rate["speculative"] / rate["plain"],
              **metrics["speculative"].to_dict()}
    if args.tree > 1:
        result["tree"] = {"candidates": args.tree, "decode_tok_s": rate["tree"],
                          "speedup": rate["tree"] / rate["plain"], **metrics["tree"].to_dict()}
    result["load_average_1m"] = [round(load_before[0], 1), round(os.getloadavg()[0], 1)]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
