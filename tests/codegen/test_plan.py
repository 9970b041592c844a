"""The static plan (one kernel launch per node, deterministic JSON) and the CPU kernels it
launches, each checked against its ops.py reference."""

import json

import pytest
import torch

from llmc.codegen.plan import Plan, build_plan
from llmc.codegen.torch_cpu.cpu_kernels import CPU_KERNELS, RopeCache, resolve_kernel
from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import OPS, run_reference
from llmc.errors import ArtifactError, IRError, TargetError
from llmc.runtime.attention import NoCacheAttention

from tiny_llama import build_tiny_llama

GEN = torch.Generator().manual_seed(7)


def randn(*shape):
    return torch.randn(shape, generator=GEN)


# -- plan --------------------------------------------------------------------------------
def test_one_cpu_launch_per_node_in_graph_order(tiny_llama):
    plan = build_plan(tiny_llama, "cpu", max_tokens=32)
    assert [s.node for s in plan.steps] == [n.name for n in tiny_llama.nodes]
    assert [s.kernel for s in plan.steps] == [f"cpu.{n.op}" for n in tiny_llama.nodes]
    assert [s.inputs for s in plan.steps] == [n.inputs for n in tiny_llama.nodes]
    assert plan.inputs == ["input_ids", "positions"] and plan.outputs == ["logits"]
    assert set(plan.params) == set(tiny_llama.params)
    assert plan.memory.peak_bytes < plan.memory.naive_bytes
    assert plan.max_tokens == 32 and plan.target == "cpu"


def test_aten_fallback_becomes_cpu_aten_with_its_attrs():
    g = build_tiny_llama(aten_scale=True)
    step = next(s for s in build_plan(g, "cpu", 8).steps if s.node == "embed_scale")
    assert step.kernel == "cpu.aten"
    assert step.attrs == {"target": "aten.mul.Tensor", "args": [{"$in": 0}, {"$float": "1.5"}], "kwargs": {}}


def test_json_round_trip_is_byte_identical(tiny_llama):
    text = build_plan(tiny_llama, "cpu", 16).to_json()
    again = Plan.from_json(text)
    assert again.to_json() == text
    assert again.memory.slot_of == build_plan(tiny_llama, "cpu", 16).memory.slot_of
    assert build_plan(build_tiny_llama(), "cpu", 16).to_json() == text  # same graph, same bytes


def test_plan_records_types_and_kv_layout(tiny_llama):
    plan = Plan.from_json(build_plan(tiny_llama, "cpu", 16).to_json())
    assert plan.type_of("positions") == TensorType(("tokens",), "int64")
    assert plan.type_of("logits") == TensorType(("tokens", 50), "float32")
    assert plan.kv_layout() == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    assert [s.attrs["layer"] for s in plan.attention_steps()] == [0, 1]


def test_build_plan_verifies_the_graph_first(tiny_llama):
    tiny_llama.nodes[3].inputs[0] = "nowhere"
    with pytest.raises(IRError, match="nowhere"):
        build_plan(tiny_llama, "cpu", 16)


def test_unknown_target_is_a_target_error(tiny_llama):
    with pytest.raises(TargetError, match="no-such-gpu"):
        build_plan(tiny_llama, "no-such-gpu", 16)


def test_corrupt_or_foreign_plan_json_is_an_artifact_error(tiny_llama):
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Plan.from_json("{steps")
    d = json.loads(build_plan(tiny_llama, "cpu", 16).to_json())
    d["format"] = 99
    with pytest.raises(ArtifactError, match="format 99"):
        Plan.from_json(json.dumps(d))


# -- kernels -------------------------------------------------------------------------------
def check_kernel(op, inputs, **attrs):
    node = Node("n", op, [], [], attrs)
    want = run_reference(node, inputs)
    got = CPU_KERNELS[f"cpu.{op}"](*inputs, **attrs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_every_ir_op_resolves_to_a_cpu_kernel():
    assert {"cpu.embedding", "cpu.rms_norm", "cpu.linear", "cpu.rope", "cpu.attention", "cpu.silu",
            "cpu.mul", "cpu.add", "cpu.aten"} <= set(CPU_KERNELS)
    assert all(callable(resolve_kernel(f"cpu.{op}")) for op in OPS)


def test_elementwise_kernels_match_references():
    check_kernel("silu", [randn(5, 12)])
    check_kernel("mul", [randn(5, 12), randn(5, 12)])
    check_kernel("add", [randn(5, 12), randn(12)])


def test_select_rows_matches_reference():
    check_kernel("select_rows", [randn(6, 16), torch.tensor([5, 0, 3])])


def test_embedding_and_linear_match_references():
    check_kernel("embedding", [torch.randint(0, 20, (6,), generator=GEN), randn(20, 16)])
    check_kernel("linear", [randn(6, 16), randn(24, 16)])
    check_kernel("linear", [randn(6, 16), randn(24, 16), randn(24)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype):
    x, w = (randn(6, 32) * 3).to(dtype), (1 + 0.1 * randn(32)).to(dtype)
    check_kernel("rms_norm", [x, w], eps=1e-6)


def test_rope_matches_reference_and_shares_tables_within_a_forward():
    positions, inv_freq = torch.tensor([3, 4, 5, 9]), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    check_kernel("rope", [randn(4, 32), positions, inv_freq], head_dim=8, scaling=1.0)
    cache = RopeCache()
    for x in (randn(4, 32), randn(4, 16)):
        node = Node("n", "rope", [], [], {"head_dim": 8, "scaling": 0.5})
        want = run_reference(node, [x, positions, inv_freq])
        got = CPU_KERNELS["cpu.rope"](x, positions, inv_freq, head_dim=8, scaling=0.5, rope_cache=cache)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert len(cache._tables) == 1


@pytest.mark.parametrize("causal", [True, False])
def test_attention_kernel_with_no_cache_matches_reference(causal):
    q, k, v = randn(7, 4 * 8), randn(7, 2 * 8), randn(7, 2 * 8)
    attrs = dict(num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5, causal=causal)
    want = run_reference(Node("n", "attention", [], [], {**attrs, "layer": 0}), [q, k, v])[0]
    got = CPU_KERNELS["cpu.attention"](q, k, v, backend=NoCacheAttention(), layer=0, **attrs)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_aten_kernel_matches_reference():
    x = randn(3, 4)
    attrs = {"target": "aten.transpose.int", "args": [{"$in": 0}, 0, 1], "kwargs": {}}
    check_kernel("aten", [x], **attrs)
    check_kernel("aten", [x, randn(4)], target="aten.add.Tensor", args=[{"$in": 0}, {"$in": 1}],
                 kwargs={"alpha": {"$float": "2.0"}})


def test_unknown_kernel_is_an_artifact_error_and_new_ops_fall_back_to_reference(monkeypatch):
    with pytest.raises(ArtifactError, match="cpu.frobnicate"):
        resolve_kernel("cpu.frobnicate")
    monkeypatch.setitem(OPS, "neg", OPS["silu"].__class__("neg", None, lambda x, **a: [-x]))
    x = randn(3)
    assert torch.equal(resolve_kernel("cpu.neg")(x)[0], -x)


def test_graph_without_attention_has_empty_kv_layout():
    g = Graph("mlp")
    g.add_input("x", TensorType(("tokens", 4), "float32"))
    g.nodes.append(g.make_node("silu", ["x"], [TensorType(("tokens", 4), "float32")], name="y"))
    g.outputs = ["y"]
    assert build_plan(g, "cpu", 4).kv_layout() == {"num_layers": 0, "num_kv_heads": 0, "head_dim": 0}
