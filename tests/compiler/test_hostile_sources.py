"""Hostile model sources: a checkpoint missing a tensor or holding an extra one, a config that
disagrees with its weights or declares absurd sizes, broken JSON or tokenizer files, lying
safetensors and GGUF headers. `llmc compile` prints one `llmc: error:` line naming the file and the
tensor or field, says what to do, exits 2 and writes nothing: it never compiles random weights,
and never allocates more than the file's tensors could hold."""

import json
import random
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import add_vocabulary, finish
from llmc_cli import error_line, llmc_in_process
from safetensors.torch import load_file, save_file

from llmc.compiler.frontends import hf, load_model
from llmc.errors import ModelLoadError

LLMC = Path(sys.executable).parent / "llmc"
MEMORY_LIMIT = 4 << 30


# --- building the sources -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory) -> Path:
    """tiny-llama saved whole, in shards with an index, and as a float32 GGUF."""
    root = tmp_path_factory.mktemp("checkpoints")
    for name, shard_size in (("single", "1GB"), ("sharded", "100KB")):
        tiny.module.save_pretrained(root / name, max_shard_size=shard_size)
        tiny.tokenizer.save_pretrained(root / name)
    write_gguf(root / "tiny.gguf", tiny, gguf_tensors(tiny))
    return root


def gguf_names(tiny) -> dict[str, str]:
    """HF tensor name -> its GGUF name, as llama.cpp's converter writes it."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, tiny.config.num_hidden_layers)
    return {name: f"{name_map.get_name(name.rpartition('.')[0])}.{name.rpartition('.')[2]}"
            for name in tiny.module.state_dict()}


def gguf_tensors(tiny) -> dict[str, np.ndarray]:
    """The GGUF tensors of tiny-llama: q/k rows permuted the way llama.cpp's converter does."""
    heads = {"q_proj": tiny.config.num_attention_heads, "k_proj": tiny.config.num_key_value_heads}
    tensors = {}
    for name, tensor in tiny.module.state_dict().items():
        values = tensor.numpy().copy()
        head_count = next((n for proj, n in heads.items() if f".{proj}." in name), None)
        if head_count:
            values = values.reshape(head_count, 2, -1, values.shape[1]).swapaxes(1, 2).reshape(values.shape)
        tensors[gguf_names(tiny)[name]] = values
    return tensors


def write_gguf(path: Path, tiny, tensors: dict, hparams: bool = True, vocabulary: bool = True,
               embedding_length=None, head_count=None, raw_types: dict | None = None) -> Path:
    config, writer = tiny.config, gguf.GGUFWriter(str(path), "llama")
    if hparams:
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(embedding_length or config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads if head_count is None else head_count)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_rope_freq_base(10000.0)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if vocabulary:
        add_vocabulary(writer, tiny.tokenizer)
        writer.add_bos_token_id(tiny.tokenizer.bos_token_id)
        writer.add_eos_token_id(tiny.tokenizer.eos_token_id)
    for name, values in tensors.items():
        raw_type = (raw_types or {}).get(name)
        writer.add_tensor(name, values.astype(np.int32) if raw_type else values, raw_dtype=raw_type)
    finish(writer)
    return path


# --- damage ------------------------------------------------------------------------------------

def edit_config(**fields):
    def damage(path: Path, tiny):
        config = json.loads((path / "config.json").read_text())
        config.update(fields)
        (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return damage


def edit_tokenizer_config(**fields):
    def damage(path: Path, tiny):
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, **fields}))
    return damage


def edit_weights(edit):
    def damage(path: Path, tiny):
        tensors = load_file(path / "model.safetensors")
        edit(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return damage


def drop_random_tensor(path: Path, tiny) -> str:
    name = random.choice(sorted(load_file(path / "model.safetensors")))
    edit_weights(lambda tensors: tensors.pop(name))(path, tiny)
    return name


def drop_random_shard_tensor(path: Path, tiny) -> str:
    """Drop a tensor from its shard and from the index, as a half-finished re-shard would."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = random.choice(sorted(index["weight_map"]))
    shard = path / index["weight_map"].pop(name)
    tensors = load_file(shard)
    tensors.pop(name)
    save_file(tensors, shard, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return name


def edit_index(edit):
    def damage(path: Path, tiny):
        index = json.loads((path / "model.safetensors.index.json").read_text())
        edit(index["weight_map"])
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return damage


def move_first_tensor_to_another_shard(weight_map: dict) -> None:
    name = sorted(weight_map)[0]
    weight_map[name] = next(shard for shard in sorted(set(weight_map.values())) if shard != weight_map[name])


def lie_in_safetensors_header(path: Path, tiny) -> None:
    """Claim a tensor far bigger than its bytes, keeping the data and offsets as they were."""
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    header["model.norm.weight"]["shape"] = [1 << 40]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size:])


def gguf_without_random_tensor(path: Path, tiny) -> str:
    # not the head: a GGUF without output.weight ties it to the embedding, as llama.cpp does
    name = random.choice(sorted(set(gguf_names(tiny)) - {"lm_head.weight"}))
    tensors = gguf_tensors(tiny)
    del tensors[gguf_names(tiny)[name]]
    write_gguf(path, tiny, tensors)
    return name


def gguf_with(extra=None, **options):
    def damage(path: Path, tiny):
        write_gguf(path, tiny, {**gguf_tensors(tiny), **(extra or {})}, **options)
    return damage


def patch_gguf_tensor_info(field: str, value: int):
    """Overwrite one field of output_norm.weight's entry in the GGUF tensor table."""
    def damage(path: Path, tiny):
        data = bytearray(path.read_bytes())
        name = b"output_norm.weight"
        at = data.index(name) + len(name)
        dims = struct.unpack_from("<I", data, at)[0]
        offsets = {"dim": (at + 4, "<Q"), "type": (at + 4 + 8 * dims, "<I"), "offset": (at + 8 + 8 * dims, "<Q")}
        position, fmt = offsets[field]
        struct.pack_into(fmt, data, position, value)
        path.write_bytes(bytes(data))
    return damage


# case: (source kind, damage, fragments the error line must hold besides the file: culprit and remedy)
# A damage may return the tensor name it chose at random; the line must name it too.
HOSTILE = {
    # tensors missing, extra, misshapen or of the wrong type
    "missing-tensor": ("single", drop_random_tensor, ["lacks 1 tensor", "re-download or re-save"]),
    "missing-layer": ("single", edit_config(num_hidden_layers=3),
                      ["lacks 9 tensors", "model.layers.2.", "and 5 more", "check its config"]),
    "extra-tensor": ("single", edit_weights(lambda t: t.update({"model.layers.0.mystery.weight": torch.ones(3)})),
                     ["holds 1 tensor", "model.layers.0.mystery.weight", "another architecture"]),
    "extra-layer": ("single", edit_config(num_hidden_layers=1), ["holds 9 tensors", "model.layers.1.", "and 5 more"]),
    "hidden-size-edited": ("single", edit_config(hidden_size=128),
                           ["'model.embed_tokens.weight'", "[512, 64] in the file", "implies [512, 128]",
                            "restore the original config"]),
    "vocab-size-missing": ("single", edit_config(vocab_size=None),
                           ["'model.embed_tokens.weight'", "[512, 64]", "[32000, 64]"]),
    "integer-tensor": ("single", edit_weights(lambda t: t.update({"model.norm.weight": t["model.norm.weight"].int()})),
                       ["'model.norm.weight'", "stored as I32", "re-save"]),
    "safetensors-header-lies": ("single", lie_in_safetensors_header, ["model.safetensors", "truncated or corrupt"]),
    "missing-shard-tensor": ("sharded", drop_random_shard_tensor,
                             ["model.safetensors.index.json", "lacks 1 tensor", "re-download"]),
    "shard-outside-directory": ("sharded",
                                edit_index(lambda m: m.update({sorted(m)[0]: "../single/model.safetensors"})),
                                ["model.safetensors.index.json", "'../single/model.safetensors'",
                                 "not a .safetensors file", "re-download"]),
    "index-disagrees-with-shards": ("sharded", edit_index(move_first_tensor_to_another_shard),
                                    ["model.safetensors.index.json", "disagree", "re-download"]),
    # config.json
    "config-not-an-object": ("single", lambda p, t: (p / "config.json").write_text("[64, 512]"),
                             ["config.json", "JSON array, not an object", "re-download"]),
    "config-nan": ("single", lambda p, t: (p / "config.json").write_text(
        (p / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN')),
        ["config.json", "not valid JSON", "NaN"]),
    "negative-size": ("single", edit_config(hidden_size=-64),
                      ["config.json", "hidden_size is -64", "positive integer", "restore the original config"]),
    "huge-size": ("single", edit_config(intermediate_size=10**30), ["config.json", "intermediate_size is 10000"]),
    "size-not-an-integer": ("single", edit_config(num_hidden_layers=2.0),
                            ["config.json", "num_hidden_layers is 2.0", "positive integer"]),
    "zero-heads": ("single", edit_config(num_attention_heads=0), ["config.json", "num_attention_heads is 0"]),
    "field-of-the-wrong-type": ("single", edit_config(tie_word_embeddings="yes"),
                                ["'tie_word_embeddings'", "expected bool"]),
    "pre-quantised": ("single", edit_config(quantization_config={"quant_method": "gptq", "bits": 4}),
                      ["config.json", "pre-quantised", "'gptq'", "--quant"]),
    "heads-do-not-divide-hidden": ("single", edit_config(num_attention_heads=3, num_key_value_heads=3, head_dim=None),
                                   ["hidden size (64)", "attention heads (3)"]),
    "kv-heads-do-not-divide-heads": ("single", edit_config(num_key_value_heads=3),
                                     ["config.json", "num_key_value_heads (3)", "restore the original config"]),
    "eos-outside-vocabulary": ("single", edit_config(eos_token_id=[2, 100000]),
                               ["config.json", "eos_token_id [2, 100000]", "512-token vocabulary"]),
    "model-type-disagrees": ("single", edit_config(model_type="bert"),
                             ["config.json", "model_type 'bert'", "LlamaForCausalLM"]),
    # tokenizer
    "tokenizer-garbage": ("single", lambda p, t: (p / "tokenizer.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff"),
                          ["tokenizer.json", "not valid JSON", "re-download"]),
    "tokenizer-not-a-tokenizer": ("single", lambda p, t: (p / "tokenizer.json").write_text('{"model": 5}'),
                                  ["tokenizer.json", "not a valid tokenizer", "save_pretrained"]),
    "tokenizer-max-length-not-a-number": ("single", edit_tokenizer_config(model_max_length="abc"),
                                          ["tokenizer_config.json", "model_max_length is 'abc'"]),
    # GGUF
    "gguf-vocabulary-only": ("gguf", lambda p, t: write_gguf(p, t, {}, hparams=False),
                             ["holds no tensors", "pass a GGUF file with the model's weights"]),
    "gguf-without-vocabulary": ("gguf", gguf_with(vocabulary=False), ["no vocabulary", "tokenizer.ggml.tokens"]),
    "gguf-zero-heads": ("gguf", gguf_with(head_count=0), ["transformers cannot load", "by zero"]),
    "gguf-missing-tensor": ("gguf", gguf_without_random_tensor, ["lacks 1 tensor", "re-download"]),
    "gguf-extra-tensor": ("gguf", gguf_with(extra={"rope_freqs.weight": np.ones(8, np.float32)}),
                          ["holds 1 tensor", "rope_freqs.weight"]),
    "gguf-embedding-length-edited": ("gguf", gguf_with(embedding_length=128),
                                     ["'model.embed_tokens.weight'", "[512, 64] in the file", "implies [512, 128]"]),
    "gguf-integer-tensor": ("gguf", gguf_with(raw_types={"output_norm.weight": gguf.GGMLQuantizationType.I32}),
                            ["'output_norm.weight'", "type I32", "re-convert"]),
    "gguf-unknown-tensor-type": ("gguf", patch_gguf_tensor_info("type", 99), ["truncated or corrupt", "99"]),
    "gguf-offset-past-the-end": ("gguf", patch_gguf_tensor_info("offset", 1 << 40), ["truncated or corrupt"]),
    "gguf-shape-past-the-end": ("gguf", patch_gguf_tensor_info("dim", 1 << 40), ["truncated or corrupt"]),
}


def make_source(kind: str, damage, checkpoints: Path, tiny, tmp_path: Path) -> tuple[Path, str | None]:
    """A damaged copy of the `kind` checkpoint, and the tensor name the damage chose, if any."""
    if kind == "gguf":
        source = Path(shutil.copy(checkpoints / "tiny.gguf", tmp_path / "model.gguf"))
    else:
        source = Path(shutil.copytree(checkpoints / kind, tmp_path / kind))
    chosen = damage(source, tiny)
    return source, chosen if isinstance(chosen, str) else None


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_source_is_refused_in_one_line_and_leaves_nothing(case, checkpoints, tiny, tmp_path, capfd):
    kind, damage, fragments = HOSTILE[case]
    source, chosen = make_source(kind, damage, checkpoints, tiny, tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, stdout, err = llmc_in_process(capfd, "compile", source, "--target", "cpu", "-o", out_dir / "model.llmc")
    assert code == 2, err
    assert stdout == ""
    message = error_line(err)
    for fragment in [str(source), *fragments, *([f"{chosen}"] if chosen else [])]:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert list(out_dir.iterdir()) == []  # neither model.llmc nor .model.llmc.tmp-*


@pytest.mark.parametrize("case", ["gguf-vocabulary-only", "billion-token-vocabulary"])
def test_source_declaring_a_huge_model_is_refused_before_allocating(case, checkpoints, tiny, tmp_path):
    """Without the checks, the vocabulary-only GGUF builds Llama's default 7B-parameter model and
    the edited config a 64-billion-float embedding; under a 4 GiB address-space limit either dies."""
    if case == "gguf-vocabulary-only":
        source = write_gguf(tmp_path / "vocab.gguf", tiny, {}, hparams=False)
    else:
        source, _ = make_source("single", edit_config(vocab_size=10**9), checkpoints, tiny, tmp_path)
    output = tmp_path / "out" / "model.llmc"
    output.parent.mkdir()
    result = subprocess.run([str(LLMC), "compile", str(source), "--target", "cpu", "-o", str(output)],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300,
                            preexec_fn=limit_memory)
    assert result.returncode == 2, result.stderr[-2000:]
    assert str(source) in error_line(result.stderr)
    assert list(output.parent.iterdir()) == []


def limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


# --- complete checkpoints still load -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["single", "sharded", "tiny.gguf"])
def test_complete_checkpoint_loads_with_the_models_logits(kind, checkpoints, tiny):
    loaded = load_model(str(checkpoints / kind))
    ids = torch.randint(0, tiny.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(ids).logits, tiny.module(ids).logits)


def test_tied_head_needs_no_lm_head_tensor(tiny_model, tmp_path):
    tiny_model.module.config.tie_word_embeddings = True
    tiny_model.module.tie_weights()
    tiny_model.module.save_pretrained(tmp_path)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = load_model(str(tmp_path))
    assert loaded.module.lm_head.weight is loaded.module.model.embed_tokens.weight


def test_rotary_inv_freq_saved_by_older_checkpoints_is_ignored(checkpoints, tiny, tmp_path):
    source = shutil.copytree(checkpoints / "single", tmp_path / "old")
    edit_weights(lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.rand(8)}))(source, tiny)
    ids = torch.randint(0, tiny.config.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(source)).module(ids).logits, tiny.module(ids).logits)


def test_weights_transformers_would_initialise_are_refused_even_past_the_table_check(
        checkpoints, tiny, tmp_path, monkeypatch):
    """The header check runs first; transformers' own loading report is the second line of defence."""
    monkeypatch.setattr(hf, "check_tensor_table", lambda *args: None)
    source, name = make_source("single", drop_random_tensor, checkpoints, tiny, tmp_path)
    with pytest.raises(ModelLoadError, match="would fill them with random values") as info:
        load_model(str(source))
    assert name in str(info.value) and str(source / "model.safetensors") in str(info.value)
