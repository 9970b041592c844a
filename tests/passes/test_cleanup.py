"""The cleanup passes remove exactly what they should and leave the graph computing the same."""

import pytest
import torch

from llmc.compiler.ir import Graph, QuantScheme, TensorType
from llmc.compiler.ops import run_reference
from llmc.errors import PassError
from llmc.passes.base import PassContext, get_pass

F32 = "float32"
INT64_MAX = 9223372036854775807


def t(*shape, dtype=F32):
    return TensorType(tuple(shape), dtype)


def evaluate(graph: Graph, feeds: dict) -> list[torch.Tensor]:
    """A tiny interpreter: run every node's reference in order."""
    env = dict(graph.weights) | feeds
    for node in graph.nodes:
        outs = run_reference(node, [env[i] for i in node.inputs])
        env.update(zip((v.name for v in node.outputs), outs))
    return [env[o] for o in graph.outputs]


def add(graph: Graph, op, inputs, out_types, **attrs):
    node = graph.make_node(op, inputs, out_types, attrs)
    graph.nodes.append(node)
    return node


def aten(graph: Graph, target, inputs, out_types, args, kwargs=None):
    return add(graph, "aten", inputs, out_types, target=target, args=args, kwargs=kwargs or {})


def run_pass(graph: Graph, name: str, **options):
    result = get_pass(name, **options).run(graph, PassContext())
    graph.verify()
    return result


def assert_same_results(before: Graph, after: Graph, feeds: dict):
    for a, b in zip(evaluate(before, feeds), evaluate(after, feeds), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


# -- remove_noops ------------------------------------------------------------------------
def noop_graph() -> Graph:
    """x: [tokens, 8] through a chain of aten no-ops and real ops mixed."""
    g = Graph("noops")
    g.add_input("x", t("tokens", 8))
    x = "x"
    aten(g, "aten._assert_tensor_metadata.default", [x], [], [{"$in": 0}], {"dtype": {"$dtype": F32}})
    x = aten(g, "aten.clone.default", [x], [t("tokens", 8)], [{"$in": 0}]).out.name
    x = aten(g, "aten.view.default", [x], [t("tokens", 8)], [{"$in": 0}, [-1, 8]]).out.name
    x = aten(g, "aten._to_copy.default", [x], [t("tokens", 8)], [{"$in": 0}],
             {"dtype": {"$dtype": F32}}).out.name
    x = aten(g, "aten.slice.Tensor", [x], [t("tokens", 8)], [{"$in": 0}, 0, 0, INT64_MAX]).out.name
    x = aten(g, "aten.slice.Tensor", [x], [t("tokens", 8)], [{"$in": 0}, 1, None, 8, 1]).out.name
    x = aten(g, "aten.mul.Tensor", [x], [t("tokens", 8)], [1.0, {"$in": 0}]).out.name
    x = aten(g, "aten.add.Tensor", [x], [t("tokens", 8)], [{"$in": 0}, 0]).out.name
    x = aten(g, "aten.dropout.default", [x], [t("tokens", 8)], [{"$in": 0}, 0.1, False]).out.name
    # real work from here on
    x = aten(g, "aten.mul.Tensor", [x], [t("tokens", 8)], [{"$in": 0}, 2.0]).out.name
    x = aten(g, "aten.slice.Tensor", [x], [t("tokens", 4)], [{"$in": 0}, 1, 0, 4]).out.name
    x = aten(g, "aten.to.dtype", [x], [t("tokens", 4, dtype="float64")],
             [{"$in": 0}, {"$dtype": "float64"}]).out.name
    x = aten(g, "aten.reshape.default", [x], [t("tokens", 2, 2, dtype="float64")],
             [{"$in": 0}, [-1, 2, 2]]).out.name
    g.outputs = [x]
    return g


def test_remove_noops_removes_exactly_the_identities():
    g = noop_graph()
    before = g.copy()
    result = run_pass(g, "remove_noops")
    assert result.matches == 9 and result.changed
    assert result.details["by_target"] == {
        "aten._assert_tensor_metadata.default": 1, "aten._to_copy.default": 1,
        "aten.add.Tensor": 1, "aten.clone.default": 1, "aten.dropout.default": 1,
        "aten.mul.Tensor": 1, "aten.slice.Tensor": 2, "aten.view.default": 1}
    assert [n.attrs["target"] for n in g.nodes] == [
        "aten.mul.Tensor", "aten.slice.Tensor", "aten.to.dtype", "aten.reshape.default"]
    assert g.nodes[0].inputs == ["x"]
    assert_same_results(before, g, {"x": torch.randn(5, 8)})


def test_remove_noops_is_idempotent():
    g = noop_graph()
    run_pass(g, "remove_noops")
    again = run_pass(g, "remove_noops")
    assert again.matches == 0 and not again.changed


def test_remove_noops_keeps_casts_and_views_that_change_the_type():
    g = Graph("casts")
    g.add_input("ids", t("tokens", dtype="int64"))
    promoted = aten(g, "aten.mul.Tensor", ["ids"], [t("tokens")], [{"$in": 0}, 1.0])
    widened = aten(g, "aten.expand.default", [promoted.out.name], [t(3, "tokens")],
                   [{"$in": 0}, [3, -1]])
    g.outputs = [widened.out.name]
    before = g.copy()
    assert run_pass(g, "remove_noops").matches == 0
    assert len(g.nodes) == 2
    assert_same_results(before, g, {"ids": torch.randint(0, 100, (6,))})


def test_remove_noops_keeps_partial_slices_and_strided_slices():
    g = Graph("slices")
    g.add_input("x", t(6, 8))
    a = aten(g, "aten.slice.Tensor", ["x"], [t(6, 8)], [{"$in": 0}, 0, 0, 5])   # mistyped on purpose
    b = aten(g, "aten.slice.Tensor", ["x"], [t(3, 8)], [{"$in": 0}, 0, 0, None, 2])
    c = aten(g, "aten.slice.Tensor", ["x"], [t(6, 8)], [{"$in": 0}, -1, 0, 8])   # full, negative dim
    d = aten(g, "aten.slice.Tensor", ["x"], [t(6, 8)], [{"$in": 0}, 0, 1])       # mistyped on purpose
    e = aten(g, "aten.slice.Tensor", ["x"], [t(6, 8)], [{"$in": 0}, 0, 0, 6, 2])  # mistyped on purpose
    g.outputs = [n.out.name for n in (a, b, c, d, e)]
    result = run_pass(g, "remove_noops")
    assert result.matches == 1
    assert [n.name for n in g.nodes] == [a.name, b.name, d.name, e.name]
    assert g.outputs == [a.out.name, b.out.name, "x", d.out.name, e.out.name]


def test_remove_noops_rewires_graph_outputs_and_keeps_used_asserts():
    g = Graph("outs")
    g.add_input("x", t(4, 8))
    alias = aten(g, "aten.alias.default", ["x"], [t(4, 8)], [{"$in": 0}])
    check = aten(g, "aten._assert_async.msg", ["x"], [t(4, 8)], [{"$in": 0}, "bad"])
    used = aten(g, "aten.mul.Tensor", ["x"], [t(4, 8)], [{"$in": 0}, 3.0])
    g.outputs = [alias.out.name, used.out.name, check.out.name]
    run_pass(g, "remove_noops")
    assert g.outputs[0] == "x"
    assert check in g.nodes  # its output is a graph output, so it stays


# -- dce ---------------------------------------------------------------------------------
def dce_graph() -> Graph:
    g = Graph("dce")
    g.add_input("x", t("tokens", 8))
    g.add_param("w", t(16, 8), torch.randn(16, 8))
    g.add_param("w_dead", t(32, 8), torch.randn(32, 8))
    g.add_param("w_never", t(4, 4), torch.randn(4, 4))
    live = add(g, "linear", ["x", "w"], [t("tokens", 16)])
    dead = add(g, "linear", ["x", "w_dead"], [t("tokens", 32)])
    add(g, "silu", [dead.out.name], [t("tokens", 32)])
    add(g, "aten", [live.out.name], [t("tokens", 16)], target="aten.add_.Tensor",
        args=[{"$in": 0}, 1.0], kwargs={}, side_effects=True)
    out = add(g, "silu", [live.out.name], [t("tokens", 16)])
    g.outputs = [out.out.name]
    return g


def test_dce_removes_dead_chain_and_prunes_its_params():
    g = dce_graph()
    before = g.copy()
    result = run_pass(g, "dce")
    assert result.matches == 2
    assert result.details == {"removed_by_op": {"linear": 1, "silu": 1}, "pruned_params": 2}
    assert result.bytes_saved == (32 * 8 + 4 * 4) * 4
    assert sorted(g.params) == ["w"] and sorted(g.weights) == ["w"]
    assert [n.op for n in g.nodes] == ["linear", "aten", "silu"]  # the side-effect node stays
    feeds = {"x": torch.randn(3, 8)}
    # Compare outputs only: the in-place node mutates its input in both graphs alike.
    assert_same_results(before, g, feeds)


def test_dce_on_clean_graph_changes_nothing():
    g = dce_graph()
    run_pass(g, "dce")
    text = str(g)
    result = run_pass(g, "dce")
    assert (result.matches, result.changed, result.bytes_saved) == (0, False, 0)
    assert str(g) == text


# -- fold_constants -----------------------------------------------------------------------
def test_fold_constants_materialises_weight_transpose_and_chains():
    g = Graph("fold")
    g.add_input("x", t("tokens", 8))
    g.add_param("w_t", t(8, 16), torch.randn(8, 16))
    g.add_param("scale", t(16, 1), torch.rand(16, 1) + 0.5)
    g.add_param("shift", t(16, 8), torch.randn(16, 8))
    w = aten(g, "aten.t.default", ["w_t"], [t(16, 8)], [{"$in": 0}])
    ws = add(g, "mul", [w.out.name, "scale"], [t(16, 8)])
    wss = add(g, "add", [ws.out.name, "shift"], [t(16, 8)])
    y = add(g, "linear", ["x", wss.out.name], [t("tokens", 16)])
    g.outputs = [y.out.name]
    before = g.copy()

    result = run_pass(g, "fold_constants")

    assert result.matches == 3
    assert result.details["folded_by_op"] == {"add": 1, "aten.t.default": 1, "mul": 1}
    assert [n.op for n in g.nodes] == ["linear"]
    assert sorted(g.params) == [wss.out.name]
    assert g.weights[wss.out.name].is_contiguous()
    assert result.bytes_saved == (8 * 16 + 16 + 16 * 8) * 4 - 3 * 16 * 8 * 4 + 2 * 16 * 8 * 4
    assert_same_results(before, g, {"x": torch.randn(5, 8)})


def test_fold_constants_leaves_broadcasts_unless_growth_is_allowed():
    def graph():
        g = Graph("bcast")
        g.add_input("x", t(64, 8))
        g.add_param("b", t(1, 8), torch.randn(1, 8))
        big = aten(g, "aten.expand.default", ["b"], [t(64, 8)], [{"$in": 0}, [64, 8]])
        g.outputs = [add(g, "add", ["x", big.out.name], [t(64, 8)]).out.name]
        return g

    g = graph()
    assert run_pass(g, "fold_constants").matches == 0
    assert len(g.nodes) == 2
    g = graph()
    before = g.copy()
    assert run_pass(g, "fold_constants", max_growth="100").matches == 1
    assert g.params[g.nodes[0].inputs[1]].type == t(64, 8)
    assert_same_results(before, g, {"x": torch.randn(64, 8)})


def test_fold_constants_skips_attention_inputs_random_and_quantised():
    g = Graph("skip")
    g.add_input("x", t(4, 8))
    for name in ("q", "k", "v"):
        g.add_param(name, t(4, 8), torch.randn(4, 8))
    g.add_param("p", t(4, 8), torch.rand(4, 8))
    g.add_param("codes", t(4, 8, dtype="int8"), torch.randint(-8, 8, (4, 8), dtype=torch.int8),
                quant=QuantScheme("rtn", 8))
    att = add(g, "attention", ["q", "k", "v"], [t(4, 8)], num_heads=2, num_kv_heads=2, head_dim=4,
              scale=0.5)
    mixed = add(g, "add", ["x", "q"], [t(4, 8)])
    noise = aten(g, "aten.bernoulli.default", ["p"], [t(4, 8)], [{"$in": 0}])
    deq = aten(g, "aten._to_copy.default", ["codes"], [t(4, 8)], [{"$in": 0}], {"dtype": {"$dtype": F32}})
    g.outputs = [n.out.name for n in (att, mixed, noise, deq)]
    # Generous growth, so only the rules for these nodes hold them back.
    result = run_pass(g, "fold_constants", max_growth=100.0)
    assert result.matches == 0 and not result.changed
    assert len(g.nodes) == 4


def test_fold_constants_reports_a_mistyped_node():
    g = Graph("bad")
    g.add_param("w", t(8, 16), torch.randn(8, 16))
    w = aten(g, "aten.t.default", ["w"], [t(8, 16)], [{"$in": 0}])
    g.outputs = [w.out.name]
    with pytest.raises(PassError, match=rf"node {w.name} \(aten\) evaluated to float32\[16, 8\]"):
        run_pass(g, "fold_constants")


def test_cleanup_pipeline_on_mixed_graph_matches_reference():
    g = noop_graph()
    g.add_param("bias", t(1, 2, 2, dtype="float64"), torch.randn(1, 2, 2, dtype=torch.float64))
    g.add_param("unused", t(1000), torch.randn(1000))
    bias2 = aten(g, "aten.mul.Tensor", ["bias"], [t(1, 2, 2, dtype="float64")], [{"$in": 0}, 3.0])
    out = add(g, "add", [g.outputs[0], bias2.out.name], [t("tokens", 2, 2, dtype="float64")])
    g.outputs = [out.out.name]
    before = g.copy()
    for name in ("remove_noops", "fold_constants", "dce"):
        run_pass(g, name)
    assert "unused" not in g.params and "bias" not in g.params
    assert len(g.nodes) == 5
    assert_same_results(before, g, {"x": torch.randn(7, 8)})


def test_dropping_contiguous_before_a_view_keeps_the_graph_runnable():
    """x.transpose(0, 1).contiguous().view(-1): once remove_noops drops the contiguous, the
    view reads a transposed input; views run as reshapes since IR values never alias."""
    g = Graph("transpose_view")
    g.add_input("x", t(3, 4))
    x = aten(g, "aten.transpose.int", ["x"], [t(4, 3)], [{"$in": 0}, 0, 1]).out.name
    x = aten(g, "aten.contiguous.default", [x], [t(4, 3)], [{"$in": 0}]).out.name
    x = aten(g, "aten.view.default", [x], [t(12)], [{"$in": 0}, [12]]).out.name
    g.outputs = [x]
    before = g.copy()
    assert run_pass(g, "remove_noops").matches == 1
    feeds = {"x": torch.randn(3, 4)}
    assert_same_results(before, g, feeds)
    torch.testing.assert_close(evaluate(g, feeds)[0], feeds["x"].T.reshape(-1))
