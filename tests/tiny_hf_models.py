"""Tiny seeded random-weight Hugging Face checkpoints of any architecture, built in-process and saved
with save_pretrained (plus the tiny-llama sample's byte-level tokenizer), and what HF computes on
them: the references the architecture and sliding-window tests compare llmc against."""

from pathlib import Path

import torch
import transformers

from llmc import SamplingParams
from llmc.compiler.frontends.samples import SPECIAL_TOKENS, build_tiny_tokenizer
from llmc.runtime.paged_attention import PagedKVCache, StepMetadata

TOKENIZER = build_tiny_tokenizer()
VOCAB = len(TOKENIZER)
SPECIAL = dict(bos_token_id=TOKENIZER.bos_token_id, eos_token_id=TOKENIZER.eos_token_id,
               pad_token_id=TOKENIZER.pad_token_id)
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, **SPECIAL)


def _config(cls, **fields):
    return lambda **overrides: cls(**{**fields, **overrides})


# One tiny config per architecture llmc compiles (keyword overrides change any field); the
# architecture tests and compiler/architectures.py's table name them by these keys.
ARCHS = {
    "llama": _config(transformers.LlamaConfig, **SIZES, num_key_value_heads=2),
    "mistral": _config(transformers.MistralConfig, **SIZES, num_key_value_heads=2, sliding_window=16),
    "qwen2": _config(transformers.Qwen2Config, **SIZES, num_key_value_heads=2),
    "qwen3": _config(transformers.Qwen3Config, **SIZES, num_key_value_heads=2, head_dim=16),
    "gemma": _config(transformers.GemmaConfig, **SIZES, num_key_value_heads=1, head_dim=16),
    "gemma2": _config(transformers.Gemma2Config, **SIZES, num_key_value_heads=2, head_dim=16, sliding_window=16),
    "phi3": _config(transformers.Phi3Config, **SIZES, num_key_value_heads=2),
    "gpt_neox": _config(transformers.GPTNeoXConfig, **SIZES, rotary_pct=0.25, use_parallel_residual=True),
    "gpt2": _config(transformers.GPT2Config, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                    **SPECIAL),
    "opt": _config(transformers.OPTConfig, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, ffn_dim=128, max_position_embeddings=128, word_embed_proj_dim=64,
                   **SPECIAL),
    "falcon": _config(transformers.FalconConfig, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=128, **SPECIAL),
    "starcoder2": _config(transformers.Starcoder2Config, **SIZES, num_key_value_heads=2),
    "olmo": _config(transformers.OlmoConfig, **SIZES, num_key_value_heads=2),
    "mixtral": _config(transformers.MixtralConfig, **SIZES, num_key_value_heads=2, num_local_experts=4,
                       num_experts_per_tok=2),
}


def tiny_module(config: transformers.PretrainedConfig, seed: int) -> torch.nn.Module:
    """The config's causal LM with seeded weights: embeddings ~ N(0, 1), projections ~ N(0, 1/fan_in),
    norm gains ~ 1 + N(0, 0.1^2) and biases ~ N(0, 0.1^2), so logits are O(1) and not near-ties."""
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG
        module = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, sub in sorted(module.named_modules()):
            for pname, param in sorted(sub.named_parameters(recurse=False)):
                noise = torch.randn(param.shape, generator=gen)
                param.copy_(_scaled(sub, pname, param, noise))
    return module.eval()


def _scaled(module: torch.nn.Module, name: str, param: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    if "norm" in type(module).__name__.lower():
        return 1.0 + 0.1 * noise if name == "weight" else 0.1 * noise
    if isinstance(module, torch.nn.Embedding):
        return noise
    if param.dim() == 1:  # biases (and Falcon-style scalars)
        return 0.1 * noise
    fan_in = param.shape[0] if type(module).__name__ == "Conv1D" else param.shape[-1]  # GPT-2's is [in, out]
    return noise / fan_in ** 0.5


def save_checkpoint(config: transformers.PretrainedConfig, path: Path, seed: int = 0) -> torch.nn.Module:
    """Build, save (weights, config, tokenizer) to `path`, and return the module HF reloads from it."""
    tiny_module(config, seed).save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(module: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: HF's logits at every position of one sequence."""
    with torch.no_grad():
        return module(input_ids=torch.tensor([ids])).logits[0]


def hf_greedy(module: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():  # an explicit mask: generate would otherwise hide prompt tokens equal to pad
        out = module.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=TOKENIZER.pad_token_id)
    return out[0, len(ids):].tolist()


def prompt_ids(length: int, seed: int = 0) -> list[int]:
    """Random ordinary tokens (none of the special ones)."""
    first = len(SPECIAL_TOKENS)  # the tokenizer gives them the first ids
    return torch.randint(first, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def paged_logits(llm, ids: list[int], prefill_chunks: tuple[int, ...], block_size: int = 4) -> torch.Tensor:
    """[len(ids), vocab]: the loaded artifact's logits at every position, its plan fed through a paged
    KV cache in shuffled blocks: the prompt in chunks of `prefill_chunks` tokens, then one token a step."""
    executor = llm.engine.executor
    layout = executor.plan.kv_layout()
    num_blocks = -(-len(ids) // block_size) + 2
    cache = PagedKVCache(layout["num_layers"], num_blocks, block_size, layout["num_kv_heads"], layout["head_dim"],
                         dtype=executor.kv_dtype())
    backend = executor.paged_backend(cache)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(ids))).tolist()
    bounds = [0]
    for n in prefill_chunks:
        bounds.append(bounds[-1] + n)
    bounds += range(bounds[-1] + 1, len(ids) + 1)
    rows = []
    for lo, hi in zip(bounds, bounds[1:]):
        backend.metadata = StepMetadata.build([(table, lo, hi - lo)], block_size)
        inputs = {"input_ids": torch.tensor(ids[lo:hi]), "positions": torch.arange(lo, hi),
                  "logits_indices": torch.arange(hi - lo)}
        rows.append(executor.run_values(inputs, backend)["logits"].float())
    return torch.cat(rows)


def max_relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def llmc_greedy(llm, ids: list[int], n: int) -> list[int]:
    """The loaded artifact's n greedy tokens after `ids` (EOS does not stop it, as in hf_greedy)."""
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return out[0].outputs[0].token_ids
