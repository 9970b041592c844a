"""The liveness memory planner: slots are shared only by values that are never live together."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmc.codegen.memory_plan import MemoryPlan, assign_slots, plan_memory, value_lifetimes
from llmc.compiler.ir import Graph, TensorType
from llmc.errors import TargetError

from tiny_llama import build_tiny_llama


def live_sets(graph: Graph) -> list[set[str]]:
    """For each step, the activations live at it, worked out straight from the node list."""
    produced = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    end = len(graph.nodes) - 1
    last = dict(produced)
    for i, n in enumerate(graph.nodes):
        for name in n.inputs:
            if name in produced:
                last[name] = max(last[name], i)
    for name in graph.outputs:
        last[name] = end
    return [{v for v in produced if produced[v] <= step <= last[v]} for step in range(end + 1)]


def test_peak_is_below_naive_for_tiny_llama(tiny_llama):
    plan = plan_memory(tiny_llama, max_tokens=64)
    assert plan.naive_bytes == sum(v.type.nbytes({"tokens": 64}) for n in tiny_llama.nodes for v in n.outputs)
    assert plan.peak_bytes == sum(plan.slot_bytes)
    assert plan.peak_bytes < plan.naive_bytes / 4


def test_no_two_live_values_share_a_slot(tiny_llama):
    plan = plan_memory(tiny_llama, max_tokens=16)
    assert set(plan.slot_of) == {v.name for n in tiny_llama.nodes for v in n.outputs}
    for step, live in enumerate(live_sets(tiny_llama)):
        slots = [plan.slot_of[v] for v in live]
        assert len(slots) == len(set(slots)), f"step {step}: live values share a slot"


def test_each_slot_is_sized_for_its_largest_value(tiny_llama):
    plan = plan_memory(tiny_llama, max_tokens=16)
    for slot, size in enumerate(plan.slot_bytes):
        members = plan.values_in(slot)
        assert members
        assert size == max(16 * tiny_llama.type_of(v).shape[-1] * 4 for v in members)


def test_other_symbolic_dims_are_bounded_by_max_tokens():
    plan = plan_memory(build_tiny_llama(select_rows=True), max_tokens=16)
    assert plan.value_bytes["last_rows"] == 16 * 32 * 4
    bound = plan_memory(build_tiny_llama(select_rows=True), 16, dims={"rows": 2})
    assert bound.value_bytes["logits"] == 2 * 50 * 4


def test_peak_scales_with_max_tokens(tiny_llama):
    assert plan_memory(tiny_llama, 32).peak_bytes == 2 * plan_memory(tiny_llama, 16).peak_bytes


def test_elementwise_chain_needs_two_slots():
    g = Graph("chain")
    g.add_input("x", TensorType(("tokens", 8), "float32"))
    prev = "x"
    for i in range(6):
        n = g.make_node("silu", [prev], [TensorType(("tokens", 8), "float32")], name=f"s{i}")
        g.nodes.append(n)
        prev = n.out.name
    g.outputs = [prev]
    plan = plan_memory(g, max_tokens=4)
    assert plan.slot_bytes == [4 * 8 * 4, 4 * 8 * 4]
    assert plan.naive_bytes == 6 * 4 * 8 * 4
    # the output lives to the end, so nothing defined after it may share its slot
    assert plan.lifetimes["s5"] == (5, 5)


def test_graph_output_lives_to_the_end():
    steps = [(["x"], ["a"]), (["a"], ["b"]), (["b"], ["c"]), (["c"], ["d"])]
    spans = value_lifetimes(steps, outputs=["a", "d"])
    assert spans == {"a": (0, 3), "b": (1, 2), "c": (2, 3), "d": (3, 3)}


def test_unused_value_lives_only_at_its_step():
    assert value_lifetimes([(["x"], ["a", "a.1"]), (["a"], ["b"])], ["b"])["a.1"] == (0, 0)


def test_round_trips_through_dict(tiny_llama):
    plan = plan_memory(tiny_llama, 8)
    back = MemoryPlan.from_dict(plan.to_dict())
    assert back == plan
    assert back.to_dict() == plan.to_dict()


def test_rejects_non_positive_max_tokens(tiny_llama):
    with pytest.raises(TargetError, match="max_tokens"):
        plan_memory(tiny_llama, 0)


@st.composite
def intervals(draw):
    n = draw(st.integers(1, 30))
    spans, sizes = {}, {}
    for i in range(n):
        start = draw(st.integers(0, 20))
        spans[f"v{i}"] = (start, start + draw(st.integers(0, 6)))
        sizes[f"v{i}"] = draw(st.integers(1, 1000))
    return spans, sizes


@settings(max_examples=150, deadline=None)
@given(intervals())
def test_assign_slots_never_overlaps_and_never_exceeds_naive(case):
    spans, sizes = case
    slot_of, slot_bytes = assign_slots(spans, sizes)
    for a in spans:
        assert slot_bytes[slot_of[a]] >= sizes[a]
        for b in spans:
            if a < b and slot_of[a] == slot_of[b]:
                assert spans[a][1] < spans[b][0] or spans[b][1] < spans[a][0]
    assert sum(slot_bytes) <= sum(sizes.values())
    # values alive at one step each need a slot of their own
    busiest = max(sum(s <= t <= e for s, e in spans.values()) for t in range(27))
    assert len(slot_bytes) >= busiest
