"""Rotary decoders, Llama and Qwen2 and beyond, each a tiny seeded random-weight HF checkpoint compiled with
`llmc.compile` and run through `llmc.load`: HF's logits at every position of a 40-token prompt and
24 greedy continuations, through the paged KV cache, to 1e-4, and 16 greedy tokens identical.
Qwen3 (per-head q/k RMS norm before rotary), Gemma (GELU-tanh, (1 + w) RMS norm, scaled
embeddings), Phi-3 (fused qkv and gate_up projections), GPT-NeoX (partial rotary, interleaved
fused qkv, parallel residual, LayerNorm), StarCoder2 and OLMo."""

import json

import pytest
import tiny_hf_models as tiny

import llmc

CONFIGS = {k: tiny.ARCHS[k] for k in ("llama", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "starcoder2", "olmo")}
# ops lowering must produce for each (what the architecture has a name for)
EXPECTED_OPS = {"qwen3": {"qk_norm"}, "gpt_neox": {"partial_rope"}}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def compiled(request, tmp_path_factory):
    """(HF module, loaded artifact, artifact path) for one architecture."""
    name = request.param
    source = tmp_path_factory.mktemp(name)
    module = tiny.save_checkpoint(CONFIGS[name](), source, seed=11)
    path = llmc.compile(str(source), output=tmp_path_factory.mktemp("art") / f"{name}.llmc")
    return name, module, llmc.load(path, kv_memory="8MiB"), path


def test_every_attention_is_raised(compiled):
    name, module, _, path = compiled
    ops = [n["op"] for n in json.loads((path / "graph.json").read_text())["nodes"]]
    assert ops.count("flash_attention") + ops.count("attention") == module.config.num_hidden_layers
    assert EXPECTED_OPS.get(name, set()) <= set(ops)


def test_logits_at_every_position_match_hf_through_the_paged_cache(compiled):
    _, module, llm, _ = compiled
    ids = tiny.prompt_ids(40, seed=1)
    ids += tiny.hf_greedy(module, ids, 24)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(40,))
    assert tiny.max_relative_error(got, tiny.hf_logits(module, ids)) < 1e-4


def test_16_greedy_tokens_are_hf_s(compiled):
    _, module, llm, _ = compiled
    ids = tiny.prompt_ids(21, seed=2)
    assert tiny.llmc_greedy(llm, ids, 16) == tiny.hf_greedy(module, ids, 16)
