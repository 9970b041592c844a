"""fuse_swiglu and fuse_rms_norm, and the swiglu and add_rms_norm ops they emit: the ops (reference
and CPU kernel) against float64 math; on tiny-llama silu * mul becomes swiglu (packed over a fused
gate/up GEMM, whose split goes), each residual add feeding a norm becomes add_rms_norm with the
sum kept for the next residual, and the fused graph computes the unfused logits (reference
interpreter and CPU plan, whose memory plan gives every output of a multi-output node a slot)."""

import pytest
import torch

from llmc.codegen.plan import Plan, build_plan
from llmc.codegen.torch_cpu.cpu_kernels import resolve_kernel
from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.ops import OPS, infer_types
from llmc.compiler.pipeline import trace_and_lower
from llmc.errors import IRError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass
from llmc.runtime.attention import NoCacheAttention
from llmc.runtime.executor import PlanExecutor

F32 = "float32"


def run_passes(graph, names):
    return {r.name: r for r in PassManager([get_pass(n) for n in names], PassContext(quiet=True)).run(graph)}


@pytest.fixture(scope="module")
def lowered():
    graph = trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)
    run_passes(graph, ["remove_noops", "fold_constants", "dce"])
    return graph


def prompt(seed, tokens):
    ids = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "positions": torch.arange(tokens), "logits_indices": torch.arange(tokens)}


def plan_logits(graph, inputs):
    plan = Plan.from_json(build_plan(graph, "cpu", 32).to_json())
    return PlanExecutor(plan, dict(graph.weights)).run_values(inputs, NoCacheAttention())["logits"]


def assert_same_logits(unfused, fused):
    for seed, tokens in ((0, 1), (1, 6), (2, 11)):
        inputs = prompt(seed, tokens)
        torch.testing.assert_close(interpret(fused, inputs)["logits"], interpret(unfused, inputs)["logits"],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plan_logits(fused, inputs), plan_logits(unfused, inputs), rtol=1e-5, atol=1e-5)


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- the ops against float64 math ---------------------------------------------------------------------
def silu64(x):
    x = x.double()
    return x / (1 + torch.exp(-x))


@pytest.mark.parametrize("shape", [(1, 8), (5, 6), (3, 2, 130)])
def test_swiglu_is_silu_of_the_first_half_times_the_second(shape):
    packed = rand(*shape, seed=shape[-1]) * 3
    half = shape[-1] // 2
    gate, up = packed[..., :half], packed[..., half:]
    want = silu64(gate) * up.double()
    for fn in (OPS["swiglu"].reference, resolve_kernel("cpu.swiglu")):
        for inputs in ((packed,), (gate, up)):
            [got] = fn(*inputs)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_swiglu_type_rule():
    node = Graph().make_node("swiglu", ["x"], [])
    assert infer_types(node, [TensorType(("tokens", 10), F32)]) == [TensorType(("tokens", 5), F32)]
    assert infer_types(node, [TensorType(("tokens", 5), F32)] * 2) == [TensorType(("tokens", 5), F32)]
    with pytest.raises(IRError, match="even"):
        infer_types(node, [TensorType(("tokens", 7), F32)])
    with pytest.raises(IRError, match="one type"):
        infer_types(node, [TensorType(("tokens", 5), F32), TensorType(("tokens", 6), F32)])


@pytest.mark.parametrize("shape", [(1, 16), (7, 64), (2, 3, 24)])
def test_add_rms_norm_normalises_the_sum_and_returns_it(shape):
    x, residual, weight = rand(*shape, seed=1), rand(*shape, seed=2), rand(shape[-1], seed=3)
    eps = 1e-5
    s = x.double() + residual.double()
    want = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    for fn in (OPS["add_rms_norm"].reference, resolve_kernel("cpu.add_rms_norm")):
        normed, summed = fn(x, residual, weight, eps=eps)
        assert torch.equal(summed, x + residual)
        torch.testing.assert_close(normed.double(), want, rtol=1e-5, atol=1e-5)


def test_add_rms_norm_type_rule():
    node = Graph().make_node("add_rms_norm", ["x", "r", "w"], [], {"eps": 1e-6})
    x = TensorType(("tokens", 8), F32)
    assert infer_types(node, [x, x, TensorType((8,), F32)]) == [x, x]
    with pytest.raises(IRError, match="one type"):
        infer_types(node, [x, TensorType((1, 8), F32), TensorType((8,), F32)])
    with pytest.raises(IRError, match="weight"):
        infer_types(node, [x, x, TensorType((4,), F32)])


# -- fuse_swiglu ----------------------------------------------------------------------------------------
def test_fuse_swiglu_alone_makes_two_input_swiglus(lowered):
    graph = lowered.copy()
    record = run_passes(graph, ["fuse_swiglu"])["fuse_swiglu"]
    assert record.matches == 2 and record.details == {"swiglu": 2, "packed": 0, "repacked": 0}
    swiglus = [n for n in graph.nodes if n.op == "swiglu"]
    assert [len(n.inputs) for n in swiglus] == [2, 2]
    assert not {"silu", "mul"} & set(graph.op_counts())
    assert_same_logits(lowered, graph)


def test_fuse_swiglu_reads_a_fused_gate_up_packed_and_drops_its_split(lowered):
    graph = lowered.copy()
    record = run_passes(graph, ["fuse_gate_up", "fuse_swiglu"])["fuse_swiglu"]
    assert record.matches == 2 and record.details["packed"] == 2
    producers = graph.producers()
    for node in (n for n in graph.nodes if n.op == "swiglu"):
        assert len(node.inputs) == 1 and producers[node.inputs[0]].op == "linear"
    assert "split" not in graph.op_counts()
    assert_same_logits(lowered, graph)


def test_swiglu_before_gate_up_fusion_is_repacked_by_a_second_run(lowered):
    graph = lowered.copy()
    records = PassManager([get_pass(n) for n in ("fuse_swiglu", "fuse_gate_up")], PassContext(quiet=True)).run(graph)
    assert records[1].matches == 2      # fuse_gate_up finds gate/up through the two-input swiglu
    again = run_passes(graph, ["fuse_swiglu"])["fuse_swiglu"]
    assert again.matches == 2 and again.details == {"swiglu": 0, "packed": 2, "repacked": 2}
    assert "split" not in graph.op_counts()
    assert_same_logits(lowered, graph)


def small_graph(b_shape):
    """silu(a) * b with b of `b_shape` (a broadcasting mul when it is [8])."""
    g = Graph("small")
    g.add_input("a", TensorType(("tokens", 8), F32))
    g.add_input("b", TensorType(b_shape, F32))
    silu = g.make_node("silu", ["a"], [TensorType(("tokens", 8), F32)])
    mul = g.make_node("mul", [silu.out.name, "b"], [TensorType(("tokens", 8), F32)])
    g.nodes += [silu, mul]
    g.outputs = [mul.out.name]
    return g


def test_a_broadcasting_mul_is_no_swiglu_and_an_operand_order_swap_is():
    broadcast = small_graph((8,))
    assert run_passes(broadcast, ["fuse_swiglu"])["fuse_swiglu"].matches == 0
    swapped = small_graph(("tokens", 8))
    swapped.nodes[1].inputs.reverse()
    assert run_passes(swapped, ["fuse_swiglu"])["fuse_swiglu"].matches == 1
    a, b = rand(3, 8, seed=4), rand(3, 8, seed=5)
    [out] = interpret(swapped, {"a": a, "b": b}).values()
    torch.testing.assert_close(out.double(), silu64(a) * b.double())


# -- fuse_rms_norm ----------------------------------------------------------------------------------------
def test_fuse_rms_norm_fuses_every_residual_add_into_the_next_norm(lowered):
    graph = lowered.copy()
    record = run_passes(graph, ["fuse_rms_norm"])["fuse_rms_norm"]
    assert record.matches == 4      # 2 layers: after attention, after the MLP (into the next or final norm)
    counts = graph.op_counts()
    assert counts["add_rms_norm"] == 4 and counts["rms_norm"] == 1 and "add" not in counts
    fused = [n for n in graph.nodes if n.op == "add_rms_norm"]
    # each add_rms_norm's sum is the residual the next one adds to
    for a, b in zip(fused, fused[1:]):
        assert a.outputs[1].name in b.inputs
    assert_same_logits(lowered, graph)


def test_a_sum_read_by_two_norms_fuses_into_one_and_feeds_the_other():
    gen = torch.Generator().manual_seed(6)
    g = Graph("two-norms")
    t = TensorType(("tokens", 8), F32)
    g.add_input("x", t)
    g.add_input("r", t)
    for name in ("w1", "w2"):
        g.add_param(name, TensorType((8,), F32), torch.randn(8, generator=gen))
    add = g.make_node("add", ["x", "r"], [t])
    norms = [g.make_node("rms_norm", [add.out.name, w], [t], {"eps": 1e-6}) for w in ("w1", "w2")]
    g.nodes += [add, *norms]
    g.outputs = [n.out.name for n in norms] + [add.out.name]
    fused = g.copy()
    assert run_passes(fused, ["fuse_rms_norm"])["fuse_rms_norm"].matches == 1
    assert fused.op_counts() == {"add_rms_norm": 1, "rms_norm": 1}
    feeds = {"x": torch.randn(5, 8, generator=gen), "r": torch.randn(5, 8, generator=gen)}
    for got, want in zip(interpret(fused, feeds).values(), interpret(g, feeds).values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_multi_output_nodes_round_trip_and_get_a_slot_per_output(lowered):
    graph = lowered.copy()
    run_passes(graph, ["fuse_qkv", "fuse_rms_norm"])
    assert Graph.from_json(graph.to_json()).to_json() == graph.to_json()
    plan = build_plan(graph, "cpu", 32)
    for node in (n for n in graph.nodes if n.op in ("split", "add_rms_norm")):
        slots = [plan.memory.slot_of[v.name] for v in node.outputs]
        assert len(set(slots)) == len(slots)    # live together at the node's step
