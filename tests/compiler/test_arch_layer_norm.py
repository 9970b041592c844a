"""Decoders with LayerNorm, each a tiny seeded random-weight HF checkpoint: GPT-2 (learned positions,
Conv1D projections, a fused qkv split, tanh GELU) compiled through the `llmc` command line, OPT
(position offset, scaled q, ReLU) and Falcon (multi-query fused qkv picked by index, x @ W.T
projections, parallel attention and MLP, in-place residual add; and Falcon-40B's grouped layout)
through `llmc.compile`; each matches HF's logits at every position through the paged KV cache to
1e-4 and its greedy tokens."""

import pytest
import tiny_hf_models as tiny
import transformers

import llmc
from llmc.cli import main

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=tiny.VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                            **tiny.SPECIAL),
    "opt": lambda: transformers.OPTConfig(vocab_size=tiny.VOCAB, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, ffn_dim=128, max_position_embeddings=128,
                                          word_embed_proj_dim=64, **tiny.SPECIAL),
    "falcon": lambda: transformers.FalconConfig(vocab_size=tiny.VOCAB, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=128, **tiny.SPECIAL),
    # Falcon-40B's layout: per KV group, its query heads then one key and one value head
    "falcon_grouped": lambda: transformers.FalconConfig(vocab_size=tiny.VOCAB, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=4, num_kv_heads=2,
                                                        new_decoder_architecture=True, max_position_embeddings=128,
                                                        **tiny.SPECIAL),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def compiled(request, tmp_path_factory):
    name = request.param
    source = tmp_path_factory.mktemp(name)
    module = tiny.save_checkpoint(CONFIGS[name](), source, seed=13)
    output = tmp_path_factory.mktemp("art") / f"{name}.llmc"
    if name == "gpt2":
        main(["compile", str(source), "--target", "cpu", "-o", str(output), "--quiet"])  # a refusal exits 2
    else:
        llmc.compile(str(source), output=output)
    return module, llmc.load(output, kv_memory="8MiB"), output


def test_logits_at_every_position_match_hf_through_the_paged_cache(compiled):
    module, llm, _ = compiled
    ids = tiny.prompt_ids(40, seed=1)
    ids += tiny.hf_greedy(module, ids, 24)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(17, 23))
    assert tiny.max_relative_error(got, tiny.hf_logits(module, ids)) < 1e-4


def test_16_greedy_tokens_are_hf_s(compiled):
    module, llm, _ = compiled
    ids = tiny.prompt_ids(21, seed=2)
    assert tiny.llmc_greedy(llm, ids, 16) == tiny.hf_greedy(module, ids, 16)


def test_gpt2_quantises_with_calibration_as_long_as_its_position_table(tmp_path):
    """Self-generated calibration of --calib-seq-len 128 on a GPT-2 with 128 learned positions: the
    left-padded batch must not run a row past position 127."""
    source = tmp_path / "gpt2"
    module = tiny.save_checkpoint(CONFIGS["gpt2"](), source, seed=13)
    output = llmc.compile(str(source), output=tmp_path / "gpt2-int8.llmc", quant="int8")
    ids = tiny.prompt_ids(21, seed=2)
    agree = sum(a == b for a, b in zip(tiny.llmc_greedy(llmc.load(output, kv_memory="8MiB"), ids, 16),
                                       tiny.hf_greedy(module, ids, 16)))
    assert agree >= 12
