"""The new architectures on a GPU target, run through Triton's interpreter on the CPU: tiny Mistral
(sliding window 16, honoured by the paged prefill and decode kernels), Qwen3 (qk_norm) and GPT-NeoX
(partial_rope, layer_norm, gelu, which run their torch reference on the GPU) compiled for h100-bf16
give HF's greedy tokens past the window."""

import pytest
import tiny_hf_models as tiny
import transformers

import llmc

pytestmark = pytest.mark.triton

SIZES = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128, **tiny.SPECIAL)
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**SIZES, num_key_value_heads=2, sliding_window=16),
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=16),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SIZES, rotary_pct=0.25),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_gpu_artifact_decodes_hf_s_greedy_tokens_past_the_window(name, tmp_path):
    module = tiny.save_checkpoint(CONFIGS[name](), tmp_path / "hf", seed=1)
    path = llmc.compile(str(tmp_path / "hf"), target="h100-bf16", output=tmp_path / "gpu.llmc")
    llm = llmc.load(path, device="cpu", kv_memory="8MiB")
    ids = tiny.prompt_ids(30, seed=3)
    assert tiny.llmc_greedy(llm, ids, 8) == tiny.hf_greedy(module, ids, 8)
