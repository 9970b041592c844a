"""The pass manager runs, verifies, times and instruments passes; pipelines parse from CLI text."""

import json
from dataclasses import dataclass

import pytest
import torch

from llmc.compiler.ir import Graph, TensorType
from llmc.errors import IRError, PassError
from llmc.passes.base import (
    PASSES,
    Pass,
    PassContext,
    PassManager,
    PassResult,
    build_pipeline,
    format_bytes,
    get_pass,
    parse_pass_options,
    register_pass,
)
from llmc.passes.options import PassOptions, option

CLEANUP = ["remove_noops", "fold_constants", "dce"]


def small_graph() -> Graph:
    """x -> linear(w) -> silu -> output, plus a dead linear on w_dead."""
    g = Graph("small")
    g.add_input("x", TensorType(("tokens", 8), "float32"))
    g.add_param("w", TensorType((16, 8), "float32"), torch.randn(16, 8))
    g.add_param("w_dead", TensorType((4, 8), "float32"), torch.randn(4, 8))
    h = g.make_node("linear", ["x", "w"], [TensorType(("tokens", 16), "float32")])
    dead = g.make_node("linear", ["x", "w_dead"], [TensorType(("tokens", 4), "float32")])
    y = g.make_node("silu", [h.out.name], [TensorType(("tokens", 16), "float32")])
    g.nodes += [h, dead, y]
    g.outputs = [y.out.name]
    return g


class DropFirstNode(Pass):
    """Deletes the first node without rewiring its users: leaves a dangling value."""
    name = "drop_first_node"

    def run(self, graph, ctx):
        graph.nodes.pop(0)
        return PassResult(1, True)


class CountNodes(Pass):
    name = "count_nodes"

    @dataclass(frozen=True)
    class Options(PassOptions):
        scale: int = option(1, "multiplies the count")
        enabled: bool = option(True, "unused")
        ratio: float = option(0.5, "unused", low=0.0, high=1.0)
        ops: list[str] = option([], "unused")
        label: str = option("x", "unused")
        extra: str | None = option(None, "unused")

    def __init__(self, **options):
        super().__init__(**options)
        self.calls = 0

    def run(self, graph, ctx):
        self.calls += 1
        return PassResult(len(graph.nodes) * self.options.scale, False, {"seen": len(graph.nodes)})


def quiet_ctx(**kw) -> PassContext:
    return PassContext(quiet=True, **kw)


def test_manager_names_the_pass_that_broke_the_graph():
    g = small_graph()
    manager = PassManager([get_pass("dce"), DropFirstNode(), get_pass("remove_noops")], quiet_ctx())
    with pytest.raises(PassError, match=r"pass 'drop_first_node' left an invalid graph: "
                                        r".*input 'linear_1' is not defined before use"):
        manager.run(g)


def test_manager_refuses_an_invalid_input_graph_before_running_anything():
    g = small_graph()
    g.nodes.pop(0)
    counter = CountNodes()
    with pytest.raises(IRError, match="invalid before any pass ran"):
        PassManager([counter], quiet_ctx()).run(g)
    assert counter.calls == 0


def test_records_have_results_timing_and_op_counts():
    g = small_graph()
    records = PassManager(build_pipeline(CLEANUP), quiet_ctx()).run(g)
    assert [r.name for r in records] == CLEANUP
    dce = records[2]
    assert (dce.matches, dce.changed, dce.bytes_saved) == (1, True, 4 * 8 * 4)
    assert dce.op_counts_before == {"linear": 2, "silu": 1}
    assert dce.op_counts_after == {"linear": 1, "silu": 1}
    assert records[1].options == {"max_growth": 2.0}
    assert [r.stage for r in records] == ["simplify"] * 3
    assert all(r.seconds >= 0 for r in records)
    d = dce.to_dict()
    assert d["seconds"] == dce.seconds
    assert "seconds" not in dce.to_dict(include_timing=False)
    json.dumps([r.to_dict() for r in records])


def test_records_without_timing_are_identical_across_runs():
    runs = [[r.to_dict(include_timing=False)
             for r in PassManager(build_pipeline(CLEANUP), quiet_ctx()).run(small_graph())]
            for _ in range(2)]
    assert json.dumps(runs[0], sort_keys=True) == json.dumps(runs[1], sort_keys=True)


def test_disabled_passes_are_skipped():
    g = small_graph()
    records = PassManager(build_pipeline(CLEANUP), quiet_ctx(disabled={"dce"})).run(g)
    assert [r.name for r in records] == ["remove_noops", "fold_constants"]
    assert len(g.nodes) == 3


def test_print_ir_after_echoes_only_the_named_passes():
    lines = []
    g = small_graph()
    ctx = quiet_ctx(print_ir_after={"dce"}, echo=lines.append)
    PassManager([CountNodes(), get_pass("dce"), CountNodes()], ctx).run(g)
    assert lines == [f"// IR after dce\n{g}"]


def test_print_ir_after_all_and_unknown_names():
    lines = []
    PassManager([CountNodes(), get_pass("dce")], quiet_ctx(print_ir_after={"all"}, echo=lines.append)).run(
        small_graph())
    assert [line.splitlines()[0] for line in lines] == ["// IR after count_nodes", "// IR after dce"]
    with pytest.raises(PassError, match="--print-ir-after names unknown pass 'dcee'; valid passes: .*dce"):
        PassManager([CountNodes()], quiet_ctx(print_ir_after={"dcee"})).run(small_graph())


def test_dump_ir_writes_before_and_after_each_pass(tmp_path):
    g = small_graph()
    text_before = str(g)
    PassManager([get_pass("remove_noops"), get_pass("dce")], quiet_ctx(dump_ir=tmp_path / "ir")).run(g)
    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files == ["01_remove_noops.after.txt", "01_remove_noops.before.txt",
                     "02_dce.after.txt", "02_dce.before.txt"]
    assert (tmp_path / "ir" / "01_remove_noops.before.txt").read_text() == text_before + "\n"
    assert (tmp_path / "ir" / "02_dce.after.txt").read_text() == str(g) + "\n"
    assert "w_dead" in (tmp_path / "ir" / "02_dce.before.txt").read_text()


def test_verbose_prints_one_summary_per_pass():
    lines = []
    PassManager(build_pipeline(CLEANUP), quiet_ctx(verbose=True, echo=lines.append)).run(small_graph())
    assert [line.split(":")[0] for line in lines] == CLEANUP
    assert lines[2].startswith("dce: 1 matches, 128 B saved, ")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                     (-3 * 2**20, "-3.0 MiB"), (5 * 2**40, "5120.0 GiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_pass_must_return_a_pass_result():
    class Broken(Pass):
        name = "broken"

        def run(self, graph, ctx):
            return 3

    with pytest.raises(TypeError, match="pass 'broken' returned int"):
        PassManager([Broken()], quiet_ctx()).run(small_graph())


# -- options ---------------------------------------------------------------------------
def test_options_from_the_cli_are_coerced_to_the_default_type():
    p = CountNodes(scale="3", enabled="false", ratio="0.25", ops="linear, silu", label="7", extra="none")
    assert p.options.to_dict() == {"scale": 3, "enabled": False, "ratio": 0.25, "ops": ["linear", "silu"],
                                   "label": "7", "extra": None}
    assert CountNodes(extra="tokens").options.extra == "tokens"
    assert CountNodes().options.scale == 1


@pytest.mark.parametrize("bad, message", [
    ({"scale": True}, "scale=True is not a valid int"),
    ({"ratio": 1.5}, r"ratio=1.5 is outside \[0, 1\]"),
    ({"ratio": "nan"}, "ratio='nan' is not a valid float .a finite number."),
    ({"ops": "a" and 3}, "ops=3 is not a valid list"),
    ({"label": 7}, "label=7 is not a valid str"),
])
def test_options_are_type_checked_and_bounded_when_the_pass_is_configured(bad, message):
    with pytest.raises(PassError, match=rf"pass 'count_nodes': option {message}"):
        CountNodes(**bad)


@pytest.mark.parametrize("bad", [{"scale": "three"}, {"enabled": "maybe"}, {"ratio": "x"}])
def test_bad_option_values_name_pass_and_option(bad):
    (key, value), = bad.items()
    with pytest.raises(PassError, match=rf"pass 'count_nodes': option {key}='{value}' is not a valid"):
        CountNodes(**bad)


def test_unknown_option_lists_valid_options():
    with pytest.raises(PassError, match="'fold_constants' has no option 'growth'; valid options: max_growth"):
        get_pass("fold_constants", growth=3)
    with pytest.raises(PassError, match="pass 'dce' has no option 'x'; valid options: none"):
        get_pass("dce", x=1)


# -- registry and pipelines --------------------------------------------------------------
def test_get_pass_unknown_lists_valid_passes():
    with pytest.raises(PassError, match=r"unknown pass 'dcee'; valid passes: .*dce, .*fold_constants, "
                                        r".*remove_noops"):
        get_pass("dcee")


def test_register_pass_rejects_a_second_class_under_the_same_name():
    class Another(Pass):
        name = "dce"

        def run(self, graph, ctx):
            return PassResult(0, False)

    with pytest.raises(TypeError, match="registered twice"):
        register_pass(Another)
    assert PASSES["dce"] is not Another


def test_build_pipeline_default_replace_disable_and_options():
    assert [p.name for p in build_pipeline(CLEANUP)] == CLEANUP
    pipeline = build_pipeline(CLEANUP, passes="dce, fold_constants:max_growth=8,dce")
    assert [p.name for p in pipeline] == ["dce", "fold_constants", "dce"]
    assert pipeline[1].options.to_dict() == {"max_growth": 8.0}
    assert [p.name for p in build_pipeline(CLEANUP, disable=["fold_constants"])] == ["remove_noops", "dce"]
    configured = build_pipeline(CLEANUP, options={"fold_constants": {"max_growth": "3"}})
    assert configured[1].options.to_dict() == {"max_growth": 3.0}
    assert build_pipeline(CLEANUP, passes="") == []


def test_pass_option_flag_overrides_inline_option():
    pipeline = build_pipeline([], passes="fold_constants:max_growth=8",
                              options=parse_pass_options(["fold_constants.max_growth=5"]))
    assert pipeline[0].options.to_dict() == {"max_growth": 5.0}


@pytest.mark.parametrize("kwargs, message", [
    ({"passes": "dce,nope"}, "unknown pass 'nope'; valid passes: "),
    ({"disable": ["nope"]}, "unknown pass to disable 'nope'; valid passes: "),
    ({"passes": "dce:max_growth"}, "option 'max_growth' is not key=value"),
    ({"passes": "dce:max_growth=2"}, "pass 'dce' has no option 'max_growth'"),
    ({"options": {"fold_constants": {"max_growth": 2}}, "disable": ["fold_constants"]},
     "options given for pass 'fold_constants', which is not in the pipeline"),
    ({"options": {"nope": {}}}, "unknown pass in --pass-option 'nope'"),
])
def test_build_pipeline_errors(kwargs, message):
    with pytest.raises(PassError, match=message):
        build_pipeline(CLEANUP, **kwargs)


def test_parse_pass_options():
    assert parse_pass_options(["dce.a=1", "fold_constants.max_growth = 4", "dce.b=x=y"]) == {
        "dce": {"a": "1", "b": "x=y"}, "fold_constants": {"max_growth": "4"}}
    for bad in ["dce", "dce=1", ".a=1", "dce.=1"]:
        with pytest.raises(PassError, match="is not of the form pass.key=value"):
            parse_pass_options([bad])
