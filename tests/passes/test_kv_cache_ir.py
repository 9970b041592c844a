"""KV-cache quantisation lives in the IR: quantize_kv_cache gives each attention node its layer's
scales as an input and the cache dtype as an attr, so the graph computes what the quantised cache
gives back (the reference interpreter equals the paged runtime), a cleanup pass after it cannot
drop the scales, and the manifest's kv_cache is derived from the nodes."""

import json

import pytest
import torch

import llmc
from llmc.compiler.artifact import read_artifact
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.compiler.ops import ATTENTION_OPS


@pytest.fixture(scope="module")
def kv_int8(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-ir")
    # dce after the KV pass: with the scales read by attention nodes, nothing is left to drop
    return llmc.compile("tiny-llama", output=root / "kv8.llmc", calib_samples=2, calib_seq_len=24,
                        passes="fuse_attention,quantize_kv_cache:dtype=int8,dce")


def graph_of(path) -> Graph:
    art = read_artifact(path)
    graph = Graph.from_json(art.graph_json)
    graph.weights = art.weights
    return graph


def test_attention_nodes_read_their_layers_scales_and_carry_the_cache_dtype(kv_int8):
    graph = graph_of(kv_int8)
    attns = [n for n in graph.nodes if n.op in ATTENTION_OPS]
    assert attns and all(n.attrs["kv_cache"] == "int8" for n in attns)
    assert [n.inputs[-1] for n in attns] == [f"kv_scales.{n.attrs['layer']}" for n in attns]
    assert all(graph.params[n.inputs[-1]].type.shape == (2, n.attrs["num_kv_heads"]) for n in attns)
    manifest = json.loads((kv_int8 / "manifest.json").read_text())
    assert manifest["model"]["kv_cache"] == {"dtype": "int8", "scales": "static", "scale_params": "kv_scales.{layer}"}
    assert [p["name"] for p in manifest["pipeline"]][-1] == "dce"


def test_the_reference_interpreter_equals_the_paged_int8_runtime(kv_int8):
    graph = graph_of(kv_int8)
    ids = torch.randint(0, 512, (13,), generator=torch.Generator().manual_seed(11))
    rows = torch.arange(13)
    reference = interpret(graph, {"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"]
    model = llmc.load(kv_int8)
    out = model.generate({"prompt_token_ids": ids.tolist()}, llmc.SamplingParams(max_tokens=1, temperature=0,
                                                                                 logprobs=1))
    first = out[0].outputs[0].token_ids[0]
    assert first == int(reference[-1].argmax())
    # the same graph without the cache's rounding is measurably different: the IR models the loss
    plain = Graph.from_json(graph.to_json())
    plain.weights = graph.weights
    for node in plain.nodes:
        if node.attrs.get("kv_cache"):
            node.attrs.pop("kv_cache")
            node.inputs.pop()
    unquantised = interpret(plain, {"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"]
    assert not torch.equal(unquantised, reference)
    torch.testing.assert_close(unquantised, reference, rtol=0.1, atol=0.1)
