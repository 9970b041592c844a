"""`--quant int8` on every architecture through the whole runtime: each tiny model's int8 artifact is
loaded with llmc.load, scores a 40-token prompt through the paged KV cache and generates 24 greedy
tokens with llmc.generate; its top-1 token agrees with the fp32 model's (HF's own logits, which the
fp32 artifacts match to 1e-4 in the architecture tests) at >= 95% of the 63 positions, read on the
int8 run's own tokens so one flip does not carry over to the positions after it."""

import pytest
import tiny_hf_models as tiny
import torch

import llmc
from llmc import SamplingParams

PROMPT, GENERATED, MIN_AGREEMENT = 40, 24, 0.95


@pytest.mark.parametrize("name", sorted(tiny.ARCHS))
def test_int8_artifact_agrees_with_fp32_on_the_top_token(name, tmp_path):
    module = tiny.save_checkpoint(tiny.ARCHS[name](), tmp_path / "hf", seed=31)
    llm = llmc.load(llmc.compile(str(tmp_path / "hf"), quant="int8", output=tmp_path / "int8.llmc"),
                    kv_memory="4MiB", block_size=4)
    prompt = tiny.prompt_ids(PROMPT, seed=9)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=GENERATED, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    ours = torch.cat([tiny.paged_logits(llm, prompt, prefill_chunks=(23, 17))[:-1].argmax(-1), torch.tensor(out)])
    reference = tiny.hf_logits(module, prompt + out)[:-1].argmax(-1)
    assert len(ours) == len(reference) == PROMPT + GENERATED - 1
    agreement = (ours == reference).float().mean().item()
    assert agreement >= MIN_AGREEMENT, f"{name}: int8 agrees with fp32 on {agreement:.1%} of the top-1 tokens"
