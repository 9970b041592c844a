"""Gemma 2, a tiny seeded random-weight HF checkpoint: attention logit soft-capping (carried as the
attention op's `softcap`), sliding-window and full layers alternating, pre and post norms, final
logit soft-capping. On the CPU it matches HF's logits at every position past the window through
the paged KV cache and its greedy tokens; a GPU target, whose Triton kernels do not soft-cap,
refuses it in one line."""

import json

import pytest
import tiny_hf_models as tiny
import transformers

import llmc
from llmc.errors import TargetError

WINDOW = 16


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    source = tmp_path_factory.mktemp("gemma2")
    config = transformers.Gemma2Config(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, max_position_embeddings=128, sliding_window=WINDOW,
                                       **tiny.SPECIAL)
    module = tiny.save_checkpoint(config, source, seed=17)
    path = llmc.compile(str(source), output=tmp_path_factory.mktemp("art") / "gemma2.llmc")
    return source, module, llmc.load(path, kv_memory="8MiB"), path


def test_layers_carry_the_softcap_and_alternate_windows(gemma2):
    nodes = json.loads((gemma2[3] / "graph.json").read_text())["nodes"]
    attrs = [n["attrs"] for n in nodes if n["op"] in ("attention", "flash_attention")]
    assert [(a["softcap"], a.get("window")) for a in attrs] == [(50.0, WINDOW), (50.0, None)]


def test_logits_at_every_position_past_the_window_match_hf_through_the_paged_cache(gemma2):
    _, module, llm, _ = gemma2
    ids = tiny.prompt_ids(40, seed=1)
    ids += tiny.hf_greedy(module, ids, 24)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(25, 15))
    assert tiny.max_relative_error(got, tiny.hf_logits(module, ids)) < 1e-4


def test_16_greedy_tokens_are_hf_s(gemma2):
    _, module, llm, _ = gemma2
    ids = tiny.prompt_ids(21, seed=2)
    assert tiny.llmc_greedy(llm, ids, 16) == tiny.hf_greedy(module, ids, 16)


def test_a_gpu_target_refuses_soft_capped_attention(gemma2, tmp_path):
    with pytest.raises(TargetError, match="no Triton kernel .* soft-capping"):
        llmc.compile(str(gemma2[0]), target="h100-bf16", output=tmp_path / "gpu.llmc")
    assert not (tmp_path / "gpu.llmc").exists()
