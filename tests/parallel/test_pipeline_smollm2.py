"""SmolLM2-135M (the GGUF dequantised) compiled with --pp 2 and served on two gloo ranks, one a stage:
the balanced split gives the last stage fewer layers (it also runs the 49152-row LM head), each
rank holds only its layers, and the next-token log-probabilities and 64 greedy tokens are HF
transformers' (the unsharded reference, which the unsharded artifact matches in test_smollm2.py)."""

import pytest
import torch

import llmc
from llmc import SamplingParams

pytestmark = pytest.mark.smollm2

PROMPTS = ["What is the capital of France?", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smol_pp2(tmp_path_factory, smollm2_model):
    path = llmc.compile("smollm2-135m", target="cpu", output=tmp_path_factory.mktemp("pp") / "smol-pp2.llmc",
                        quant="none", pp=2)
    model = llmc.load(path, kv_memory="128MiB")
    yield model
    model.close()


def test_stages_split_the_layers_by_cost(smol_pp2):
    parallel = smol_pp2.engine.manifest["parallel"]
    assert parallel["split"] == [19, 11]
    assert [r["layers"] for r in parallel["ranks"]] == [[0, 19], [19, 30]]
    assert [r["kv_bytes_per_token"] for r in parallel["ranks"]] == [19 * 1536, 11 * 1536]
    assert len(smol_pp2.engine.cache.k_cache) == 19  # rank 0: its layers alone


def test_next_token_logprobs_and_64_greedy_tokens_equal_hf(smol_pp2, smollm2_model):
    hf, tok = smollm2_model.module, smollm2_model.tokenizer
    ids = tok(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
    out = smol_pp2.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    for token, lp in out[0].outputs[0].logprobs[0].items():
        assert abs(lp.logprob - ref[token].item()) < 1e-4
    ids = torch.tensor([tok(PROMPTS[1])["input_ids"]])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=tok.eos_token_id)
    got = smol_pp2.generate(PROMPTS[1], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    assert got.outputs[0].token_ids == want[0, ids.shape[1]:].tolist()
