"""Lowering raises HF Llama-family graphs to LLM ops and keeps their numerics."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.pipeline import trace_and_lower
from llmc.errors import IRError


def _lower(module):
    return trace_and_lower(module, 256, lambda *a: None)


def _logits(graph, ids):
    t = ids.shape[0]
    inputs = {"input_ids": ids, "positions": torch.arange(t), "logits_indices": torch.arange(t)}
    return interpret(graph, {k: v for k, v in inputs.items() if k in {i.name for i in graph.inputs}})["logits"]


@pytest.fixture(scope="module")
def tiny():
    from llmc.compiler.frontends import load_model
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def tiny_graph(tiny):
    return _lower(tiny.module)


def test_tiny_llama_lowers_to_llm_ops_only(tiny_graph, tiny):
    layers = tiny.config.num_hidden_layers
    counts = tiny_graph.op_counts()
    assert "aten" not in counts
    assert counts["attention"] == layers
    assert counts["linear"] == 7 * layers + 1
    assert counts["rms_norm"] == 2 * layers + 1
    assert counts["rope"] == 2 * layers


def test_attention_carries_gqa_grouping_scale_and_causality(tiny_graph, tiny):
    cfg = tiny.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attn = [n for n in tiny_graph.nodes if n.op == "attention"]
    assert [n.attrs["layer"] for n in attn] == list(range(cfg.num_hidden_layers))
    for n in attn:
        assert n.attrs["num_heads"] == cfg.num_attention_heads
        assert n.attrs["num_kv_heads"] == cfg.num_key_value_heads
        assert n.attrs["causal"] is True
        assert n.attrs["scale"] == pytest.approx(head_dim ** -0.5)


@pytest.mark.parametrize("length", [1, 2, 7, 33])
def test_lowered_graph_matches_hf_logits(tiny_graph, tiny, length):
    ids = torch.randint(0, tiny.config.vocab_size, (length,))
    with torch.no_grad():
        ref = tiny.module(input_ids=ids[None]).logits[0]
    got = _logits(tiny_graph, ids)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


def test_unrecognised_ops_stay_aten_fallbacks_and_still_match_hf():
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, hidden_act="relu")
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).eval()
    graph = _lower(model)
    fallbacks = [n.attrs["target"] for n in graph.nodes if n.op == "aten"]
    assert fallbacks == ["aten.relu.default"]
    assert graph.op_counts()["attention"] == 1
    ids = torch.randint(0, 96, (6,))
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
    assert torch.allclose(_logits(graph, ids), ref, atol=1e-5)


def test_ir_json_round_trip_is_deterministic(tiny_graph):
    text = tiny_graph.to_json()
    again = Graph.from_json(text)
    again.verify()
    assert again.to_json() == text
    assert str(again) == str(tiny_graph)


def test_verifier_names_the_broken_node(tiny_graph):
    g = tiny_graph.copy()
    victim = g.nodes[3]
    victim.inputs[0] = "nowhere"
    with pytest.raises(IRError, match=victim.name):
        g.verify()
    g = tiny_graph.copy()
    lin = next(n for n in g.nodes if n.op == "linear")
    lin.outputs[0].type = TensorType(("tokens", 3), "float32")
    with pytest.raises(IRError, match=f"{lin.name} \\(linear\\)"):
        g.verify()
