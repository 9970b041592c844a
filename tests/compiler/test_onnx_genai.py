"""ONNX Runtime GenAI model-builder decoders: a tiny seeded Llama (and Qwen2, Qwen3, Gemma, Mistral)
turned into ONNX by the builder itself (GroupQueryAttention with past KV inputs and rotary caches,
SkipSimplifiedLayerNormalization, packed qkv; MatMulNBits int4 weights at -p int4) compiles with
`llmc compile`; its logits at every position through the paged KV cache match HF's (fp32) and ONNX
Runtime's on the same file to 1e-4, and its greedy tokens are HF's / ORT's; int4 weights stay int4
with the file's codes, scales and zero points; unsupported contrib ops and attributes are refused in
one line naming the node and op."""

import copy
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tiny_hf_models as tiny
import torch
from llmc_cli import error_line, llmc_in_process

import llmc
from llmc.cli import main
from llmc.compiler.artifact import read_artifact
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.compiler.quant import dequantize_affine, dequantize_int4

pytest.importorskip("onnxruntime_genai")  # the model builder (the `test` extra)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    return tiny.save_checkpoint(tiny.ARCHS["llama"](), path, seed=5), path


def build(checkpoint_dir, out, precision, *extra_options, provider="cpu"):
    """The model builder's ONNX decoder for the checkpoint, offline, for an ONNX Runtime provider."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(checkpoint_dir), "-i",
               str(checkpoint_dir), "-o", str(out), "-p", precision, "-e", provider, "-c", str(out) + "_cache"]
    if extra_options:
        command += ["--extra_options", *extra_options]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out


def compile_to(source, output, *extra) -> int:
    try:
        main(["compile", str(source), "--target", "cpu", "-o", str(output), "--quiet", *extra])
    except SystemExit as e:
        return e.code
    return 0


@pytest.fixture(scope="module")
def fp32(checkpoint, tmp_path_factory):
    module, path = checkpoint
    source = build(path, tmp_path_factory.mktemp("genai") / "fp32", "fp32")
    output = source.parent / "fp32.llmc"
    assert compile_to(source, output) == 0
    return module, source, llmc.load(output, kv_memory="8MiB")


@pytest.fixture(scope="module", params=["symmetric", "zero points"])
def int4(checkpoint, tmp_path_factory, request):
    """accuracy_level 1: ONNX Runtime computes MatMulNBits in float32, as its reference semantics say
    (the builder's default, 4, rounds activations to int8 in ORT). Symmetric weights (the builder's
    default) have no zero points; is_symmetric=false stores them."""
    _, path = checkpoint
    options = ["accuracy_level=1"] + (["is_symmetric=false"] if request.param == "zero points" else [])
    source = build(path, tmp_path_factory.mktemp("genai") / "int4", "int4", *options)
    output = source.parent / "int4.llmc"
    assert compile_to(source, output) == 0
    return source, output


def ort_logits(source, ids: list[int], positions: bool = False) -> torch.Tensor:
    """[len(ids), vocab]: ONNX Runtime running the model file on the whole sequence, past empty."""
    session = ort.InferenceSession(str(source / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.array([ids], dtype=np.int64)
    feeds = {"input_ids": x, "attention_mask": np.ones_like(x)}
    if positions:
        feeds["position_ids"] = np.arange(len(ids))[None]
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, i.shape[1], 0, 16), np.float32)
    return torch.from_numpy(session.run(["logits"], feeds)[0][0])


def ort_greedy(source, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(ort_logits(source, out)[-1].argmax()))
    return out[len(ids):]


def test_fp32_logits_at_every_position_match_hf_and_ort_through_the_paged_cache(fp32):
    module, source, llm = fp32
    ids = tiny.prompt_ids(30, seed=1)
    ids += tiny.hf_greedy(module, ids, 10)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(13, 17))
    assert tiny.max_relative_error(got, tiny.hf_logits(module, ids)) < 1e-4
    assert tiny.max_relative_error(got, ort_logits(source, ids)) < 1e-4


def test_fp32_16_greedy_tokens_are_hf_s(fp32):
    module, _, llm = fp32
    ids = tiny.prompt_ids(21, seed=2)
    assert tiny.llmc_greedy(llm, ids, 16) == tiny.hf_greedy(module, ids, 16)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma", "mistral"])
def test_other_builder_architectures_match_hf_through_the_paged_cache(arch, tmp_path):
    """Qwen2 (the packed qkv's bias Add, split with it), Qwen3 (q/k norms between head split and
    rotary, folded into the attention), Gemma (GELU, scaled embeddings, (1 + w) norms) and Mistral
    (its sliding window of 16, which the builder leaves to genai_config.json, over 30 tokens)."""
    module = tiny.save_checkpoint(tiny.ARCHS[arch](), tmp_path / "hf", seed=8)
    source = build(tmp_path / "hf", tmp_path / "onnx", "fp32")
    assert compile_to(source, tmp_path / "model.llmc") == 0
    llm = llmc.load(tmp_path / "model.llmc", kv_memory="8MiB")
    ids = tiny.prompt_ids(30, seed=9)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(13,))
    assert tiny.max_relative_error(got, tiny.hf_logits(module, ids)) < 1e-4


def test_fp16_build_for_cuda_reads_in_float32(checkpoint, tmp_path):
    """-p fp16 -e cuda (float16 weights, past inputs and rotary caches; ORT runs it on CUDA alone): its
    graph computes HF's logits, on float16-rounded params, to 1e-4 (the rotary from the float16
    caches' inv_freq, exact to float32)."""
    from llmc.compiler.frontends.onnx_frontend import load_onnx

    module, path = checkpoint
    loaded = load_onnx(build(path, tmp_path / "fp16", "fp16", provider="cuda"))
    reference = copy.deepcopy(module)
    for p in reference.parameters():
        p.data = p.data.half().float()
    ids = torch.tensor([tiny.prompt_ids(100, seed=7)])
    with torch.no_grad():
        got, want = loaded.module(input_ids=ids).logits[0], reference(input_ids=ids).logits[0]
    assert tiny.max_relative_error(got, want) < 1e-4


def test_int4_weights_stay_int4_and_match_ort(int4):
    """The IR computes ORT's logits to 1e-4; the CPU int4 kernel, with bf16 activations, to 2e-2 at
    every position through the paged cache, and greedy decoding gives ORT's tokens."""
    source, output = int4
    manifest = json.loads((output / "manifest.json").read_text())
    kept = next(p for p in manifest["pipeline"] if p["name"] == "keep_gguf_quant")["details"]["quant"]["gguf"]
    # per layer q, k and v (split from the packed qkv), o, gate, up and down; and the LM head
    assert kept["linears"] == 15 and set(kept["formats"].values()) == {"MatMulNBits"}
    ids = tiny.prompt_ids(24, seed=3)
    ids += ort_greedy(source, ids, 8)
    want = ort_logits(source, ids)
    graph = artifact_graph(output)
    inputs = {"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids)),
              "logits_indices": torch.arange(len(ids))}
    assert tiny.max_relative_error(interpret(graph, inputs)["logits"], want) < 1e-4
    llm = llmc.load(output, kv_memory="8MiB")
    assert tiny.max_relative_error(tiny.paged_logits(llm, ids, prefill_chunks=(11,)), want) < 2e-2
    prompt = tiny.prompt_ids(17, seed=4)
    assert tiny.llmc_greedy(llm, prompt, 12) == ort_greedy(source, prompt, 12)


def test_int4_artifact_holds_the_files_codes_scales_and_zero_points(int4):
    """MatMulNBits' packing (two codes a byte, low nibble first, blocks along K) is llmc's: the artifact
    stores the file's bytes, scales and zero points (8 without them), which dequantise as (q - z) * s."""
    source, output = int4
    graph = artifact_graph(output)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(source / "model.onnx")).graph.initializer}
    for name in ("model.layers.0.mlp.down_proj.MatMul.weight_Q4", "lm_head.MatMul.weight_Q4"):
        packed, scales = inits[name], inits[name.replace("_Q4", "_scales")]    # [N, blocks, 16], [N, blocks]
        zeros = np.full(scales.shape, 8, np.uint8)
        if name.replace("_Q4", "_zero_points") in inits:  # two blocks' zero points a byte, low nibble first
            zp = inits[name.replace("_Q4", "_zero_points")].reshape(len(packed), -1)
            zeros = np.stack([zp & 15, zp >> 4], -1).reshape(len(packed), -1)[:, :scales.shape[1]]
        stem = next(p for p in graph.params if name in p and p.endswith(".qweight")).removesuffix(".qweight")
        stored = {k: graph.weights.get(f"{stem}.{k}") for k in ("qweight", "scales", "zeros")}
        assert torch.equal(stored["qweight"], torch.from_numpy(packed.reshape(len(packed), -1)))
        assert torch.equal(stored["scales"], torch.from_numpy(scales))
        quant = graph.params[f"{stem}.qweight"].quant
        assert (quant.method, quant.group_size) == ("gguf:MatMulNBits", 32)
        codes = np.stack([packed & 15, packed >> 4], -1).reshape(len(packed), scales.shape[1], -1)
        reference = ((codes.astype(np.float32) - zeros[..., None]) * scales[..., None]).reshape(len(packed), -1)
        if stored["zeros"] is None:
            values = dequantize_affine("affine4", stored["qweight"], stored["scales"], None)
        else:
            assert torch.equal(stored["zeros"], torch.from_numpy(zeros).float())
            values = dequantize_int4(stored["qweight"], stored["scales"], stored["zeros"])
        assert torch.equal(values, torch.from_numpy(reference))


def artifact_graph(path) -> Graph:
    art = read_artifact(path)
    graph = Graph.from_json(art.graph_json)
    graph.weights = art.weights
    return graph


def edited(fp32, tmp_path, edit):
    """The fp32 model directory with `edit` applied to its graph."""
    _, source, _ = fp32
    folder = tmp_path / "edited"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("model.onnx*"))
    proto = onnx.load(str(source / "model.onnx"))
    edit(proto.graph)
    onnx.save(proto, str(folder / "model.onnx"))
    return folder


def first(graph, op_type):
    return next(n for n in graph.node if n.op_type == op_type)


def set_attr(node, name, value):
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute(name, value)])


def rotary_nodes_apart(graph):
    """Each GroupQueryAttention's packed qkv split by a Split node, q and k turned by RotaryEmbedding
    nodes over a position_ids input, and the attention without rotary of its own (as the builder
    writes some models)."""
    graph.input.append(onnx.helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64,
                                                          ["batch_size", "sequence_length"]))
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([64, 32, 32], np.int64), "qkv_sizes"))
    nodes = []
    for n in graph.node:
        if n.op_type == "GroupQueryAttention":
            q, k, v = (f"{n.name}/{part}" for part in "qkv")
            nodes.append(onnx.helper.make_node("Split", [n.input[0], "qkv_sizes"], [q, k, v], axis=-1))
            for x, heads in ((q, 4), (k, 2)):
                nodes.append(onnx.helper.make_node("RotaryEmbedding", [x, "position_ids", n.input[7], n.input[8]],
                                                   [x + "/turned"], domain="com.microsoft", num_heads=heads))
            n.input[:3] = [q + "/turned", k + "/turned", v]
            n.input[7], n.input[8] = "", ""
            set_attr(n, "do_rotary", 0)
        nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)


def test_rotary_embedding_nodes_fold_into_attention(fp32, tmp_path):
    module, _, _ = fp32
    folder = edited(fp32, tmp_path, rotary_nodes_apart)
    assert compile_to(folder, tmp_path / "rotary.llmc") == 0
    llm = llmc.load(tmp_path / "rotary.llmc", kv_memory="8MiB")
    ids = tiny.prompt_ids(26, seed=6)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(9,))
    assert tiny.max_relative_error(got, tiny.hf_logits(module, ids)) < 1e-4
    assert tiny.max_relative_error(got, ort_logits(folder, ids, positions=True)) < 1e-4


REFUSALS = {
    "interleaved rotary": (lambda g: set_attr(first(g, "GroupQueryAttention"), "rotary_interleaved", 1),
                           "GroupQueryAttention", "rotary_interleaved=1"),
    "local window": (lambda g: set_attr(first(g, "GroupQueryAttention"), "local_window_size", 16),
                     "GroupQueryAttention", "local_window_size=16"),
    "unknown contrib op": (lambda g: setattr(first(g, "SkipSimplifiedLayerNormalization"), "op_type", "SkipGroupNorm"),
                           "SkipGroupNorm", "com.microsoft"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_unsupported_contrib_ops_and_attributes_are_refused_naming_node_and_op(fp32, tmp_path, capsys, case):
    edit, op, detail = REFUSALS[case]
    folder = edited(fp32, tmp_path, edit)
    node = next(n for n in onnx.load(str(folder / "model.onnx")).graph.node if n.op_type == op)
    code, _, err = llmc_in_process(capsys, "compile", folder, "-o", tmp_path / "x.llmc")
    line = error_line(err)
    assert code == 2 and f"'{node.name}'" in line and op in line and detail in line
