"""`llmc export --format onnx`: the exported decoder passes onnx's full check, and plain onnxruntime,
fed its own present keys/values back as past, gives the artifact's logits and greedy tokens (tiny-llama:
fp32, int8, and int4 through com.microsoft MatMulNBits); unsupported artifacts and taken outputs are
refused with one line and nothing written."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from llmc_cli import error_line, llmc_in_process

import llmc
from llmc.compiler.artifact import read_artifact
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.runtime.sampling_params import SamplingParams

QUANTS = {"fp32": {}, "int8": {"quant": "int8"}, "int4": {"quant": "int4-rtn", "group_size": 32}}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx_export")
    return {name: (llmc.compile("tiny-llama", output=root / f"{name}.llmc", **options), root)
            for name, options in QUANTS.items()}


@pytest.fixture(scope="module")
def exports(artifacts):
    return {name: llmc.export(art, output=root / f"{name}.onnx") for name, (art, root) in artifacts.items()}


def _session(export_dir) -> ort.InferenceSession:
    return ort.InferenceSession(str(export_dir / "model.onnx"), providers=["CPUExecutionProvider"])


def _empty_past(export_dir) -> dict:
    config = json.loads((export_dir / "llmc_onnx.json").read_text())
    shape = (0, config["num_kv_heads"], config["head_dim"])
    return {f"past_{kind}.{layer}": np.zeros(shape, np.float32)
            for layer in range(config["num_layers"]) for kind in ("key", "value")}


def _reference_logits(artifact, ids: torch.Tensor) -> np.ndarray:
    a = read_artifact(artifact)
    graph = Graph.from_json(a.graph_json)
    t = len(ids)
    inputs = {"input_ids": ids, "positions": torch.arange(t), "logits_indices": torch.arange(t)}
    return interpret(graph, inputs, weights=a.weights)[graph.outputs[0]].numpy()


def _ort_greedy(export_dir, prompt: list[int], max_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding over InferenceSession.run: prefill with an empty past, then one token a step,
    each step's present keys/values fed back as the next step's past. Returns (tokens, each step's
    last-row logits)."""
    session = _session(export_dir)
    names = [o.name for o in session.get_outputs()]
    past, ids, start, steps = _empty_past(export_dir), list(prompt), 0, []
    for _ in range(max_tokens):
        feed = {"input_ids": np.array(ids[start:], np.int64), "positions": np.arange(start, len(ids))} | past
        logits, *present = session.run(None, feed)
        past = {n.replace("present_", "past_"): v for n, v in zip(names[1:], present)}
        start = len(ids)
        steps.append(logits[-1])
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):], steps


def test_export_passes_full_check_and_declares_its_interface(exports):
    path = exports["fp32"] / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert inputs["input_ids"] == ["tokens"] and inputs["positions"] == ["tokens"]
    assert inputs["past_key.1"] == ["past_len", 2, 16] and outputs["present_value.0"] == ["total_len", 2, 16]
    assert outputs["logits"] == ["tokens", 512]
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}  # fp32: standard ops only
    config = json.loads((exports["fp32"] / "llmc_onnx.json").read_text())
    assert config["num_layers"] == 2 and config["eos_token_ids"] == [2]
    assert (exports["fp32"] / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize("quant", list(QUANTS))
def test_prefill_logits_equal_the_artifacts(artifacts, exports, quant):
    ids = torch.randint(0, 512, (int(torch.randint(2, 40, ())),))
    ours = _session(exports[quant]).run(["logits"], {"input_ids": ids.numpy(), "positions": np.arange(len(ids))}
                                        | _empty_past(exports[quant]))[0]
    np.testing.assert_allclose(ours, _reference_logits(artifacts[quant][0], ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("quant", list(QUANTS))
def test_64_greedy_tokens_equal_llmc_generate(artifacts, exports, quant):
    """fp32: all 64 tokens equal. Quantised: the runtime's qlinear kernels run bf16 or (as auto may
    choose) int8 activations where the export, like the artifact's reference semantics, runs fp32 (its
    logits equal the reference's to 1e-4 above), so the two may part only at a step whose top two
    logits in the export are near a tie; every token before it is equal. Over 1,300 prompts the
    widest gap at which int4's tokens parted was 0.047: the bound is 0.1."""
    prompt = torch.randint(3, 512, (9,)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = list(llmc.load(artifacts[quant][0]).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids)
    ours, logits = _ort_greedy(exports[quant], prompt, 64)
    if quant == "fp32" or ours == want:
        assert ours == want
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, want)) if a != b)
    top2 = np.sort(logits[first])[-2:]
    assert top2[1] - top2[0] < 0.1, f"{quant}: token {first} differs ({ours[first]} vs {want[first]}) at no near tie"


def test_int4_runs_as_matmulnbits(exports):
    model = onnx.load(str(exports["int4"] / "model.onnx"))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(n.domain == "com.microsoft" for n in nbits)
    assert {a.name: onnx.helper.get_attribute_value(a) for a in nbits[0].attribute}["block_size"] == 32
    assert not any(n.op_type == "MatMul" and "proj" in n.input[1] for n in model.graph.node)


def test_cli_writes_and_refuses_taken_outputs(artifacts, capfd, tmp_path):
    art = artifacts["fp32"][0]
    out = tmp_path / "sub" / "exported"
    assert llmc_in_process(capfd, "export", art, "--format", "onnx", "-o", out)[0] == 0
    assert {"model.onnx", "tokenizer", "llmc_onnx.json"} <= set(os.listdir(out))
    code, _, err = llmc_in_process(capfd, "export", art, "-o", out)
    assert code == 2 and "exists; pass --force" in error_line(err)
    before = (out / "model.onnx").stat().st_mtime_ns
    assert llmc_in_process(capfd, "export", art, "-o", out, "--force")[0] == 0
    assert (out / "model.onnx").stat().st_mtime_ns >= before
    code, _, err = llmc_in_process(capfd, "export", art, "-o", art, "--force")  # an artifact is no export
    assert code == 2 and "not a previous ONNX export" in error_line(err)
    assert (art / "manifest.json").is_file()
    assert sorted(os.listdir(tmp_path / "sub")) == ["exported"]  # no staging directory left


@pytest.mark.parametrize("options, words", [({"quant": "fp8"}, "scheme fp8 does not export"),
                                            ({"kv_cache": "int8"}, "quantised KV cache (int8)")])
def test_cli_refuses_what_it_does_not_export(tmp_path, capfd, options, words):
    art = llmc.compile("tiny-llama", output=tmp_path / "q.llmc", **options)
    code, _, err = llmc_in_process(capfd, "export", art, "-o", tmp_path / "out")
    line = error_line(err)
    assert code == 2 and words in line and line.startswith("node ")
    assert sorted(os.listdir(tmp_path)) == ["q.llmc"]


def test_exporter_module_does_not_import_onnx():
    code = "import sys, llmc.codegen.ort.onnx_export; print(sorted({'onnx', 'onnxruntime'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_sliding_window_with_a_past_matches_the_reference(artifacts):
    """A `window` on the attention nodes masks keys older than the window, across the past too."""
    from llmc.codegen.ort.onnx_export import build_model

    a = read_artifact(artifacts["fp32"][0])
    graph = Graph.from_json(a.graph_json)
    window = int(torch.randint(2, 6, ()))
    for n in graph.nodes:
        if n.op in ("attention", "flash_attention"):
            n.attrs["window"] = window
    t, split = 14, int(torch.randint(1, 13, ()))
    ids = torch.randint(0, 512, (t,))
    ref = interpret(graph, {"input_ids": ids, "positions": torch.arange(t), "logits_indices": torch.arange(t)},
                    weights=a.weights)[graph.outputs[0]].numpy()
    session = ort.InferenceSession(build_model(graph, a.weights)[0].SerializeToString())
    names = [o.name for o in session.get_outputs()]
    past = {i.name: np.zeros((0, *i.shape[1:]), np.float32) for i in session.get_inputs()[2:]}
    first, *present = session.run(None, {"input_ids": ids[:split].numpy(), "positions": np.arange(split)} | past)
    past = {n.replace("present_", "past_"): v for n, v in zip(names[1:], present)}
    rest = session.run(["logits"], {"input_ids": ids[split:].numpy(), "positions": np.arange(split, t)} | past)[0]
    np.testing.assert_allclose(np.concatenate([first, rest]), ref, atol=1e-4, rtol=0)
