"""How far an artifact's decode steps are from the function it was compiled to compute:
`python bench/decode_accuracy.py ART [--prompts N] [--tokens T] [--fp32-activations]`.

Greedy-decodes T tokens from each of N prompts cut from samples/eval.txt, keeping every decode step's
logits (the native decode kernels compute these; `llmc eval` scores prefill windows, which run torch's
GEMMs), then scores the same token sequences teacher-forced through HF transformers' fp32 model of the
artifact (quantised weights dequantised, so only the kernels' arithmetic differs): mean and largest
KL(HF || llmc) per step, top-1 agreement, and the largest logit difference. --fp32-activations runs the
native 4-bit and int8 GEMVs on fp32 activations instead of int16 codes, for an A/B."""

import argparse
import json
from pathlib import Path

import torch

import llmc
from llmc import SamplingParams
from llmc.codegen.native import cpu_native
from llmc.tools.bench import hf_model_from_artifact

TEXT = Path(__file__).resolve().parent.parent / "samples" / "eval.txt"


def decoded(model, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """(generated token ids, the logits of each decode step [tokens - 1, vocab])"""
    rows = []
    sampler = model.engine.sampler
    sample = sampler.sample

    def keep(logits, states):
        rows.append(logits.float().clone())
        return sample(logits, states)

    sampler.sample = keep
    try:
        out = model.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                          ignore_eos=True))[0]
    finally:
        sampler.sample = sample
    return list(out.outputs[0].token_ids), torch.cat(rows[1:])   # rows[0]: the prefill's


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--fp32-activations", action="store_true")
    args = ap.parse_args()
    if args.fp32_activations:
        cpu_native.set_int16_activations(False)
    model = llmc.load(args.artifact, kv_memory="256MiB")
    hf = hf_model_from_artifact(model.engine)
    text = model.tokenizer(TEXT.read_text())["input_ids"]
    kl, agree, diff = [], [], 0.0
    for p in range(args.prompts):
        prompt = text[p * args.prompt_len * 4:][:args.prompt_len]
        ids, ours = decoded(model, prompt, args.tokens)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt):].float()
        ref_lp, our_lp = ref.log_softmax(-1), ours.log_softmax(-1)
        kl.append((ref_lp.exp() * (ref_lp - our_lp)).sum(-1))
        agree.append(ref.argmax(-1) == ours.argmax(-1))
        diff = max(diff, float((ref - ours).abs().max()))
    kl, agree = torch.cat(kl), torch.cat(agree)
    print(json.dumps({"artifact": args.artifact, "activations": "fp32" if args.fp32_activations else "default",
                      "decode_steps": kl.numel(), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                      "top1_agreement": float(agree.float().mean()), "max_logit_diff": diff}, indent=2))


if __name__ == "__main__":
    main()
