"""A pass declares itself in one class: name, stage, typed options, lossy flag, needs. A toy
pass registered here (as a new module in passes/ would be) is listed by `llmc passes`, placed
by its stage with `--add-pass`, configured with typed `--pass-option` values, and dumped and
recorded like every other pass; bad option values fail once, naming pass, option and choices."""

import json
from dataclasses import dataclass

import pytest
from llmc_cli import llmc_in_process

from llmc.compiler.options import CompileOptions
from llmc.compiler.pipeline import pass_configs
from llmc.compiler.targets import get_target
from llmc.passes.base import PASSES, Pass, PassResult, Stage
from llmc.passes.lowering import LOWERING
from llmc.passes.options import PassOptions, option
from llmc.passes.registry import register_pass


class ScaleNorms(Pass):
    """Toy pass: multiplies every rms_norm weight by `factor` (a real, checkable rewrite)."""
    name = "toy_scale_norms"
    description = "multiply rms_norm weights by a factor (test only)"
    stage = Stage.FUSE

    @dataclass(frozen=True)
    class Options(PassOptions):
        factor: float = option(1.0, "what each rms_norm weight is multiplied by", low=0.0, strict=True)
        mode: str = option("all", "which norms", choices=("all", "final"))

    def run(self, graph, ctx):
        norms = [n for n in graph.nodes if n.op in ("rms_norm", "add_rms_norm")]
        for node in norms:
            weight = node.inputs[-1]
            graph.weights[weight] = graph.weights[weight] * self.options.factor
        return PassResult(len(norms), bool(norms), {"factor": self.options.factor})


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(PASSES, ScaleNorms.name, ScaleNorms)
    register_pass(ScaleNorms)   # checks the declaration; already in PASSES under its own name
    return ScaleNorms


def test_the_toy_pass_is_listed_with_stage_options_lossy_flag_and_needs(toy, capsys):
    code, out, err = llmc_in_process(capsys, "passes", "--json")
    assert code == 0, err
    listed = {p["name"]: p for p in json.loads(out)}
    entry = listed["toy_scale_norms"]
    assert entry["stage"] == "fuse" and entry["lossy"] is False and entry["needs"] == []
    assert [(o["name"], o["type"], o["default"]) for o in entry["options"]] == [
        ("factor", "float", 1.0), ("mode", "str", "all")]
    assert entry["options"][1]["choices"] == ["all", "final"]
    for p in listed.values():
        assert {"name", "stage", "options", "lossy", "needs"} <= set(p)
    assert listed["quantize_int4"]["lossy"] and listed["quantize_int4"]["needs"] == ["calibration"]
    assert listed["lower"]["stage"] == "lower" and listed["lower"]["required"]
    code, text, _ = llmc_in_process(capsys, "passes")
    assert code == 0 and "toy_scale_norms  [fuse]" in text and "toy_scale_norms.factor=1.0" in text


def test_add_pass_places_it_by_stage_after_the_fusions_and_before_final_cleanup(toy):
    configs = pass_configs(get_target("cpu"), CompileOptions(add=["toy_scale_norms:factor=2"], quant="int8"))
    names = [c.name for c in configs]
    assert names[:len(LOWERING)] == LOWERING
    assert names.index("fuse_attention") < names.index("toy_scale_norms") < len(names) - 1
    assert names[-1] == "dce" and names.index("quantize_int8") == len(LOWERING)
    assert configs[names.index("toy_scale_norms")].options.factor == 2.0


def test_compile_runs_dumps_and_records_the_toy_pass_with_typed_options(toy, tmp_path, capsys):
    dump, out = tmp_path / "ir", tmp_path / "toy.llmc"
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "-o", out, "-q", "--add-pass", "toy_scale_norms",
                                   "--pass-option", "toy_scale_norms.factor=3", "--dump-ir", dump)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    record = next(p for p in manifest["pipeline"] if p["name"] == "toy_scale_norms")
    assert record["options"] == {"factor": 3.0, "mode": "all"} and record["stage"] == "fuse"
    assert record["matches"] > 0 and record["details"] == {"factor": 3.0}
    assert [r["name"] for r in manifest["lowering"]] == LOWERING
    dumped = sorted(p.name for p in dump.iterdir() if "toy_scale_norms" in p.name)
    assert len(dumped) == 2 and dumped[0].endswith(".after.txt")


@pytest.mark.parametrize("value, message", [
    ("abc", "pass 'toy_scale_norms': option factor='abc' is not a valid float"),
    ("0", "pass 'toy_scale_norms': option factor=0.0 must be above 0"),
])
def test_a_bad_option_value_is_one_line_naming_pass_and_option(toy, tmp_path, capsys, value, message):
    out = tmp_path / "bad.llmc"
    code, stdout, err = llmc_in_process(capsys, "compile", "tiny-llama", "-o", out, "--add-pass", "toy_scale_norms",
                                        "--pass-option", f"toy_scale_norms.factor={value}")
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_a_choice_option_lists_the_allowed_values(toy, tmp_path, capsys):
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "-o", tmp_path / "x.llmc",
                                   "--add-pass", "toy_scale_norms:mode=some")
    assert code == 2 and "option mode='some' is unknown; choose one of all, final" in err


def test_lowering_steps_cannot_be_disabled(tmp_path, capsys):
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "-o", tmp_path / "x.llmc",
                                   "--disable-pass", "drop_batch_dim")
    assert code == 2 and "lowering step every compile needs" in err
