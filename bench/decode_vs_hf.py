"""Batch-1 decode speed of `llmc run`'s path against HF transformers' `generate` on the same
prompt, in the same process: `python bench/decode_vs_hf.py ART [--prompt P] [--tokens N]`.
Decode tokens/s excludes the prefill (time to first token) on both sides."""

import argparse
import json
import time

import torch

import llmc
from llmc import SamplingParams
from llmc.tools.bench import hf_model_from_artifact


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = llmc.load(args.artifact, kv_memory="256MiB")
    hf = hf_model_from_artifact(model.engine)
    ids = torch.tensor([model.tokenizer(args.prompt)["input_ids"]])
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    ours, theirs = [], []
    for _ in range(args.repeats):
        out = model.generate({"prompt_token_ids": ids[0].tolist()}, params)[0]
        m = out.metrics
        ours.append((len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
            theirs.append((args.tokens - 1) / (time.perf_counter() - t0 - ttft))
    result = {"llmc_decode_tokens_per_s": max(ours), "hf_decode_tokens_per_s": max(theirs),
              "ratio": max(ours) / max(theirs), "prompt": args.prompt, "tokens": args.tokens}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
