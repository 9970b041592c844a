"""The ONNX frontend: a tiny seeded Llama (grouped KV heads) exported with torch.onnx.export (dynamo)
into a directory beside its config and tokenizer, compiled by `llmc compile`, matches HF's logits at
every position through the paged KV cache to 1e-4 and its greedy tokens; so does a float16 export
with mask and position inputs; it quantises; an unknown op, a missing config field and a missing
tokenizer are refused in one line."""

import json
import shutil

import onnx
import pytest
import tiny_hf_models as tiny
import torch
import transformers
from llmc_cli import error_line, llmc_in_process

import llmc
from llmc.cli import main

pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True) needs it (the `test` extra)


class WithMaskAndPositions(torch.nn.Module):
    """input_ids, attention_mask, position_ids -> logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits


class LogitsOnly(torch.nn.Module):
    """input_ids -> logits, no KV cache: the graph the ONNX frontend reads."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def tiny_llama(source, seed):
    config = transformers.LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, **tiny.SPECIAL)
    return tiny.save_checkpoint(config, source, seed=seed)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    source = tmp_path_factory.mktemp("llama_onnx")
    module = tiny_llama(source, seed=11)
    ids = torch.tensor([tiny.prompt_ids(8)])
    torch.onnx.export(LogitsOnly(module).eval(), (ids,), str(source / "model.onnx"), dynamo=True,
                      input_names=["input_ids"], output_names=["logits"], verbose=False,
                      dynamic_shapes=({1: torch.export.Dim("tokens", min=2, max=128)},))
    for weights in source.glob("*.safetensors"):  # the directory holds the ONNX model, not the checkpoint
        weights.unlink()
    return module, source


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    module, source = exported
    output = tmp_path_factory.mktemp("art") / "llama_onnx.llmc"
    assert _compile(source / "model.onnx", output) == 0
    return module, llmc.load(output, kv_memory="8MiB")


def _compile(source, output, *extra) -> int:
    try:
        main(["compile", str(source), "--target", "cpu", "-o", str(output), "--quiet", *extra])
    except SystemExit as e:
        return e.code
    return 0


def test_logits_at_every_position_match_hf_through_the_paged_cache(compiled):
    module, llm = compiled
    ids = tiny.prompt_ids(30, seed=1)
    ids += tiny.hf_greedy(module, ids, 10)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(13, 17))
    assert tiny.max_relative_error(got, tiny.hf_logits(module, ids)) < 1e-4


def test_16_greedy_tokens_are_hf_s(compiled):
    module, llm = compiled
    ids = tiny.prompt_ids(21, seed=2)
    assert tiny.llmc_greedy(llm, ids, 16) == tiny.hf_greedy(module, ids, 16)


def test_fp16_weights_with_mask_and_position_inputs_unoptimised(tmp_path):
    """float16 initializers (widened), attention_mask and position_ids inputs, the exporter's graph
    before its optimiser (Constant nodes, CastLike, arange + 0): logits at every position match HF's
    on the same float16-rounded weights."""
    source = tmp_path / "fp16"
    module = tiny_llama(source, seed=12).half()
    ids = torch.tensor([tiny.prompt_ids(8)])
    tokens = torch.export.Dim("tokens", min=2, max=128)
    torch.onnx.export(WithMaskAndPositions(module).eval(), (ids, torch.ones_like(ids), torch.arange(8)[None]),
                      str(source / "model.onnx"), dynamo=True, optimize=False, verbose=False,
                      input_names=["input_ids", "attention_mask", "position_ids"], output_names=["logits"],
                      dynamic_shapes=({1: tokens}, {1: tokens}, {1: tokens}))
    for weights in source.glob("*.safetensors"):
        weights.unlink()
    assert _compile(source, tmp_path / "fp16.llmc") == 0
    llm = llmc.load(tmp_path / "fp16.llmc", kv_memory="8MiB")
    ids = tiny.prompt_ids(24, seed=4)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(11,))
    assert tiny.max_relative_error(got, tiny.hf_logits(module.float(), ids)) < 1e-4


def test_quantises_to_int8(exported, tmp_path):
    module, source = exported
    output = tmp_path / "int8.llmc"
    assert _compile(source, output, "--quant", "int8", "--calib-samples", "2", "--calib-seq-len", "32") == 0
    llm = llmc.load(output, kv_memory="8MiB")
    ids = tiny.prompt_ids(12, seed=3)
    assert tiny.max_relative_error(tiny.paged_logits(llm, ids, prefill_chunks=(12,)),
                                   tiny.hf_logits(module, ids)) < 0.05


def test_an_unknown_op_is_refused_naming_the_node(exported, tmp_path, capsys):
    _, source = exported
    model = onnx.load(str(source / "model.onnx"))
    node = model.graph.node[-1]
    node.op_type, node.name = "Hardmax", "strange_head"
    folder = _copy_beside(source, tmp_path)
    onnx.save(model, str(folder / "model.onnx"))
    code, _, err = llmc_in_process(capsys, "compile", folder / "model.onnx", "-o", tmp_path / "x.llmc")
    assert code == 2
    line = error_line(err)
    assert "'strange_head'" in line and "Hardmax" in line


def test_a_missing_config_field_is_refused_naming_it(exported, tmp_path, capsys):
    _, source = exported
    folder = _copy_beside(source, tmp_path)
    shutil.copy(source / "model.onnx", folder / "model.onnx")
    config = json.loads((source / "config.json").read_text())
    del config["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = llmc_in_process(capsys, "compile", folder, "-o", tmp_path / "x.llmc")
    assert code == 2 and "max_position_embeddings" in error_line(err)


def test_a_missing_tokenizer_is_refused(exported, tmp_path, capsys):
    _, source = exported
    folder = _copy_beside(source, tmp_path)
    shutil.copy(source / "model.onnx", folder / "model.onnx")
    for f in folder.glob("tokenizer*"):
        f.unlink()
    code, _, err = llmc_in_process(capsys, "compile", folder, "-o", tmp_path / "x.llmc")
    assert code == 2 and "tokenizer.json" in error_line(err)


def _copy_beside(source, tmp_path):
    """A directory with the source's config and tokenizer files, and no model yet."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in source.iterdir():
        if f.suffix == ".json" or f.name.startswith("tokenizer") or f.name.endswith(".onnx.data"):
            shutil.copy(f, folder / f.name)
    return folder
