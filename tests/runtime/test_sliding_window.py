"""Sliding-window attention end to end: Mistral's `sliding_window` (and Qwen2's use_sliding_window /
max_window_layers) is read off the traced mask, carried into each layer's attention op and checked
against the config; a sequence longer than the window matches HF at every position through the
paged KV cache, without a cache, and in greedy decoding, alone and batched."""

import json

import pytest
import torch
from tiny_hf_models import (
    SPECIAL,
    VOCAB,
    hf_greedy,
    hf_logits,
    max_relative_error,
    paged_logits,
    prompt_ids,
    save_checkpoint,
)
from transformers import LlamaConfig, MistralConfig, Qwen2Config

import llmc
from llmc import SamplingParams
from llmc.compiler.pipeline import trace_and_lower
from llmc.errors import IRError

WINDOW = 16
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, **SPECIAL)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(HF module, loaded artifact, artifact path) of a tiny Mistral with a 16-token window."""
    source = tmp_path_factory.mktemp("mistral")
    module = save_checkpoint(MistralConfig(**SIZES, sliding_window=WINDOW), source, seed=3)
    path = llmc.compile(str(source), output=tmp_path_factory.mktemp("art") / "mistral.llmc")
    return module, llmc.load(path, kv_memory="8MiB"), path


def attention_windows(path) -> list:
    graph = json.loads((path / "graph.json").read_text())
    return [n["attrs"].get("window") for n in graph["nodes"] if n["op"] in ("attention", "flash_attention")]


def test_every_layer_carries_the_configs_window(mistral):
    assert attention_windows(mistral[2]) == [WINDOW, WINDOW]


def test_prompt_and_decode_past_the_window_match_hf_at_every_position_through_the_paged_cache(mistral):
    module, llm, _ = mistral
    ids = prompt_ids(40, seed=1)
    ids += hf_greedy(module, ids, 24)
    got = paged_logits(llm, ids, prefill_chunks=(23, 17))
    assert max_relative_error(got, hf_logits(module, ids)) < 1e-4


def test_the_no_cache_path_honours_the_window(mistral):
    module, llm, _ = mistral
    ids = prompt_ids(50, seed=2)
    got = llm.engine.executor.run_values({"input_ids": torch.tensor(ids), "positions": torch.arange(50),
                                          "logits_indices": torch.arange(50)})["logits"]
    assert max_relative_error(got, hf_logits(module, ids)) < 1e-4


def test_24_greedy_tokens_after_a_40_token_prompt_are_hf_s(mistral):
    module, llm, _ = mistral
    ids = prompt_ids(40, seed=4)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(module, ids, 24)


def test_mixed_lengths_batched_equal_their_solo_runs(mistral):
    _, llm, _ = mistral
    prompts = [{"prompt_token_ids": prompt_ids(n, seed=n)} for n in (3, 15, 17, 33, 40, 9)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]


def test_qwen2_windows_only_the_layers_from_max_window_layers_on(tmp_path):
    config = Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    module = save_checkpoint(config, tmp_path, seed=5)
    graph = trace_and_lower(module, 64, lambda *a: None)
    assert [n.attrs.get("window") for n in graph.nodes if n.op == "attention"] == [None, WINDOW]


def test_a_window_the_config_gives_but_the_model_code_ignores_is_refused(tmp_path):
    config = LlamaConfig(**SIZES)
    config.sliding_window = WINDOW  # Llama's attention has no window: the config claims what it does not do
    module = save_checkpoint(config, tmp_path, seed=6)
    with pytest.raises(IRError, match="layer 0: the config gives sliding_window=16 .* plain causal"):
        trace_and_lower(module, 64, lambda *a: None)
