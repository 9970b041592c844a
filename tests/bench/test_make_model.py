"""bench/make_model.py: random-weight Llamas whose files read back in the asked formats, whose weights
dequantise like a trained layer's, that are byte-identical for one seed, and that transformers runs."""

import hashlib
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def make_model():
    spec = importlib.util.spec_from_file_location("make_model", ROOT / "bench" / "make_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_model"] = module   # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    del sys.modules["make_model"]


@pytest.fixture(scope="module")
def tiny_ggufs(make_model, smollm2_gguf, tmp_path_factory):
    """The tiny shape in every GGUF format, seed 0."""
    folder = tmp_path_factory.mktemp("tiny-ggufs")
    tiny = make_model.SHAPES["tiny"]
    return {fmt: make_model.make_model(tiny, fmt, folder / f"{fmt}.gguf", tokenizer_gguf=smollm2_gguf)
            for fmt in make_model.GGUF_FORMATS}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_readers(tiny_ggufs):
    """Each tiny GGUF parsed once (a few seconds each: the 49152-token vocabulary)."""
    return {fmt: gguf.GGUFReader(path) for fmt, path in tiny_ggufs.items()}


def assert_trained_looking(weights: np.ndarray) -> None:
    assert abs(weights.mean()) < 0.005
    assert 0.005 < weights.std() < 0.1


def test_k_scales_unpack_to_what_was_packed(make_model):
    rng = np.random.default_rng()
    scales, mins = rng.integers(0, 64, (2, 100, 8), dtype=np.uint8)
    unpacked = gguf.quants.Q4_K.get_scale_min(make_model.pack_k_scales(scales, mins))
    np.testing.assert_array_equal(unpacked[0], scales)
    np.testing.assert_array_equal(unpacked[1], mins)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_blocks_dequantise_to_mean_0_std_0_02(make_model, qtype):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = make_model.BLOCK_WRITERS[qtype](np.random.default_rng(), 4096)
    assert blocks.shape == (4096, type_size) and blocks.dtype == np.uint8
    weights = gguf.quants.dequantize(blocks.reshape(64, -1), qtype)
    assert weights.shape == (64, 4096 * block_size // 64)
    assert abs(weights.mean()) < 0.001
    assert weights.std() == pytest.approx(make_model.WEIGHT_STD, rel=0.1)


def test_shards_hold_consecutive_tensors_up_to_the_shard_size(make_model):
    specs = make_model.llama_tensors(make_model.SHAPES["tiny"])
    shards = make_model.plan_shards(specs, 2 * 256 * 512 * 3)
    assert [s for shard in shards for s in shard] == specs
    assert all(len(shard) == 1 or sum(2 * s.numel for s in shard) <= 2 * 256 * 512 * 3 for shard in shards)


def test_safetensors_shard_reads_back_in_bf16_same_bytes_per_seed(make_model, tmp_path):
    from safetensors import safe_open
    specs = make_model.llama_tensors(make_model.SHAPES["tiny"])[:6]
    paths = [tmp_path / f"{name}.safetensors" for name in ("a", "b", "c")]
    for path, seed in zip(paths, (0, 0, 1)):
        with make_model.progress_bar(1) as bar:
            make_model.write_safetensors(path, specs, seed, bar)
    assert sha256(paths[0]) == sha256(paths[1]) != sha256(paths[2])
    with safe_open(paths[0], "pt") as f:
        assert sorted(f.keys()) == sorted(s.hf_name for s in specs)
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert q.shape == (256, 256) and str(q.dtype) == "torch.bfloat16"
    assert_trained_looking(q.float().numpy())
    assert (norm == 1).all()


@pytest.mark.smollm2
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4_k", "q8_0"])
def test_tiny_gguf_has_the_asked_types_and_trained_looking_weights(make_model, tiny_readers, fmt):
    tensors = {t.name: t for t in tiny_readers[fmt].tensors}
    assert len(tensors) == 1 + 9 * 2 + 1 and "output.weight" not in tensors   # tied
    assert tensors["token_embd.weight"].tensor_type == Q.Q8_0
    assert tensors["blk.1.ffn_norm.weight"].tensor_type == Q.F32
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight"):
        assert tensors[name].tensor_type == make_model.GGUF_FORMATS[fmt]
    down = tensors["blk.1.ffn_down.weight"]
    weights = gguf.quants.dequantize(down.data, down.tensor_type)
    assert weights.shape == (256, 512)   # [hidden, ffn]
    assert_trained_looking(weights)


@pytest.mark.smollm2
def test_tiny_gguf_carries_llama_keys_and_smollm2_tokenizer(tiny_readers):
    fields = tiny_readers["q4_k"].fields
    value = lambda key: fields[key].contents()
    assert value("general.architecture") == "llama"
    assert value("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_S
    assert (value("llama.embedding_length"), value("llama.feed_forward_length"), value("llama.block_count")) == (
        256, 512, 2)
    assert (value("llama.attention.head_count"), value("llama.attention.head_count_kv")) == (4, 2)
    assert value("llama.rope.dimension_count") == 64
    assert value("llama.rope.freq_base") == 500000.0
    assert value("llama.context_length") == 4096
    assert value("llama.vocab_size") == len(value("tokenizer.ggml.tokens")) == 49152
    assert value("tokenizer.ggml.model") == "gpt2"


@pytest.mark.smollm2
def test_same_seed_same_bytes_other_seed_other_bytes(make_model, smollm2_gguf, tiny_ggufs, tmp_path):
    tiny = make_model.SHAPES["tiny"]
    again = make_model.make_model(tiny, "q4_1", tmp_path / "again.gguf", seed=0, tokenizer_gguf=smollm2_gguf)
    other = make_model.make_model(tiny, "q4_1", tmp_path / "other.gguf", seed=1, tokenizer_gguf=smollm2_gguf)
    assert sha256(again) == sha256(tiny_ggufs["q4_1"]) != sha256(other)


def test_only_untied_shapes_have_a_q8_0_lm_head(make_model):
    tied, untied = (make_model.llama_tensors(make_model.SHAPES[name]) for name in ("llama-1b", "llama-8b"))
    assert "lm_head.weight" not in {s.hf_name for s in tied}
    head = untied[-1]
    assert (head.gguf_name, head.hf_name, head.shape) == ("output.weight", "lm_head.weight", (49152, 4096))
    assert make_model.gguf_type(head, Q.Q4_0) == Q.Q8_0


def assert_finite_logits(model) -> None:
    import torch
    with torch.no_grad():
        logits = model(torch.tensor([[1, 100, 2000, 30000]])).logits
    assert logits.shape == (1, 4, 49152)
    assert torch.isfinite(logits).all()


@pytest.mark.smollm2
def test_tiny_q4_1_gguf_runs_in_transformers(tiny_ggufs):
    from transformers import AutoModelForCausalLM
    path = tiny_ggufs["q4_1"]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    assert model.config.num_key_value_heads == 2
    assert_finite_logits(model)


@pytest.mark.smollm2
def test_tiny_hf_folder_runs_in_transformers(make_model, smollm2_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = make_model.make_model(make_model.SHAPES["tiny"], "hf-bf16", tmp_path / "tiny-hf",
                                   tokenizer_gguf=smollm2_gguf)
    assert (folder / "model-00001-of-00001.safetensors").is_file()
    assert (folder / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.tie_word_embeddings and model.config.rms_norm_eps == 1e-5
    assert model.config.rope_parameters["rope_theta"] == 500000.0
    assert_finite_logits(model)
    assert AutoTokenizer.from_pretrained(folder).eos_token_id == model.config.eos_token_id == 2
