"""Greedy continuation under a KV policy against the full cache (docs/benchmarks.md, "KV policies"): prompts of
PROMPT tokens taken from a text, OUTPUT greedy tokens each, run batched through the engine with the full cache
and with each policy and budget; reports the tokens that agree position by position, the first divergence, and
the KV bytes each sequence held at its most (whole blocks). Usage:
    python bench/kv_policy.py ARTIFACT TEXT [--prompt 3968] [--output 128] [--budgets 2048,819]"""

from __future__ import annotations

import argparse
import json

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams


def generate(artifact: str, prompts: list[list[int]], output: int, **policy) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and the most KV bytes each sequence held, all prompts in one batch."""
    engine = Engine(artifact, EngineConfig(kv_memory="2GiB", max_num_seqs=len(prompts), **policy))
    seqs = []
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids,
                           params=SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))
        seqs.append(engine.requests[str(i)].samples[0].seq)
    most, outs = [0] * len(seqs), {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id)] = list(out.outputs[0].token_ids)
        most = [max(m, len(s.live_blocks)) for m, s in zip(most, seqs)]
    block = engine.block_manager.block_size * engine.model["kv_bytes_per_token"]
    return [outs[i] for i in range(len(prompts))], [m * block for m in most]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("text")
    ap.add_argument("--prompt", type=int, default=3968)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--budgets", default="2048,819")
    args = ap.parse_args()
    tokenizer = Engine(args.artifact, EngineConfig(kv_memory="64MiB")).tokenizer
    ids = tokenizer(open(args.text, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    step = (len(ids) - args.prompt) // max(args.prompts - 1, 1)
    prompts = [ids[i * step:i * step + args.prompt] for i in range(args.prompts)]
    full, full_bytes = generate(args.artifact, prompts, args.output, kv_policy="none")
    rows = [{"policy": "full", "budget": None, "agree": 1.0, "first_divergence": [args.output] * len(prompts),
             "kv_bytes_per_seq": full_bytes}]
    for budget in (int(b) for b in args.budgets.split(",")):
        for kind in ("h2o", "streaming"):
            got, held = generate(args.artifact, prompts, args.output, kv_policy=kind, kv_budget=budget)
            same = [sum(a == b for a, b in zip(g, f)) for g, f in zip(got, full)]
            first = [next((i for i, (a, b) in enumerate(zip(g, f)) if a != b), args.output) for g, f in zip(got, full)]
            rows.append({"policy": kind, "budget": budget, "agree": sum(same) / (args.output * len(prompts)),
                         "first_divergence": first, "kv_bytes_per_seq": held})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"prompt_tokens": args.prompt, "output_tokens": args.output, "rows": rows}))


if __name__ == "__main__":
    main()
