"""SmolLM2-135M (the GGUF dequantised) compiled with --tp 3 and served on three gloo ranks: its
next-token log-probabilities match HF transformers', its 64 greedy tokens are HF's, and 16 mixed
requests batched give what they give alone."""

import pytest
import torch

import llmc
from llmc import SamplingParams

pytestmark = pytest.mark.smollm2

PROMPTS = ["What is the capital of France?", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smol_tp3(tmp_path_factory, smollm2_model):
    path = llmc.compile("smollm2-135m", target="cpu", output=tmp_path_factory.mktemp("tp") / "smol-tp3.llmc",
                        quant="none", tp=3)
    model = llmc.load(path, kv_memory="128MiB")
    yield model
    model.close()


def test_every_rank_holds_a_third_of_the_layers_and_of_the_vocabulary(smol_tp3):
    ranks = smol_tp3.engine.manifest["parallel"]["ranks"]
    assert [(r["num_heads"], r["num_kv_heads"]) for r in ranks] == [(3, 1)] * 3
    assert [r["collectives"] for r in ranks] == [{"all_reduce": 61, "all_gather": 1}] * 3


def test_next_token_logprobs_match_hf(smol_tp3, smollm2_model):
    hf, tok = smollm2_model.module, smollm2_model.tokenizer
    for prompt in PROMPTS[:2]:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
        out = smol_tp3.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
        top = out[0].outputs[0].logprobs[0]
        assert out[0].outputs[0].token_ids[0] == int(ref.argmax())
        for token, lp in top.items():
            assert abs(lp.logprob - ref[token].item()) < 1e-4


def test_64_greedy_tokens_identical_to_hf(smol_tp3, smollm2_model):
    tok = smollm2_model.tokenizer
    ids = torch.tensor([tok(PROMPTS[2])["input_ids"]])
    with torch.no_grad():
        ref = smollm2_model.module.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=tok.eos_token_id)
    got = smol_tp3.generate(PROMPTS[2], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    assert got.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_16_mixed_requests_batched_equal_alone(smol_tp3, smollm2_model):
    base = smollm2_model.tokenizer(" ".join(PROMPTS))["input_ids"]
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": base[: 3 + int(torch.randint(0, len(base) - 3, (1,), generator=gen))]}
               for _ in range(16)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in smol_tp3.generate(prompts, params)]
    alone = [smol_tp3.generate(p, params)[0].outputs[0].token_ids for p in prompts[:4]]
    assert together[:4] == alone
