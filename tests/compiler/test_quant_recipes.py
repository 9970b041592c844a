"""--quant recipes become passes before the cleanup passes, replacing a target's own
quantisation; target presets pick one when the user names none; conflicting flags are
refused with a PassError before anything is loaded."""

import pytest

from llmc.compiler.pipeline import CompileOptions, pipeline_entries
from llmc.compiler.quant_recipes import QUANT_RECIPES, insert_quant_passes, quant_pass_specs
from llmc.compiler.targets import TARGETS, get_target
from llmc.errors import PassError
from llmc.passes.registry import build_pipeline

CLEANUP = ["remove_noops", "fold_constants", "dce"]


@pytest.mark.parametrize("quant, group_size, specs", [
    ("int8", None, ["quantize_int8"]),
    ("int4-rtn", None, ["quantize_int4:method=rtn:group_size=128"]),
    ("int4-gptq", 64, ["quantize_int4:method=gptq:group_size=64"]),
    ("int4-awq", 32, ["quantize_int4:method=awq:group_size=32"]),
    ("fp8", None, ["quantize_fp8"]),
    ("w8a8", None, ["smoothquant", "quantize_w8a8:all_linears=true"]),
])
def test_each_recipe_names_its_passes(quant, group_size, specs):
    assert quant_pass_specs(quant, group_size) == specs


def test_recipes_go_before_the_cleanup_passes_of_the_cpu_target():
    opts = CompileOptions(quant="int4-rtn", group_size=32)
    entries = pipeline_entries(get_target("cpu"), opts)
    assert entries == ["quantize_int4:method=rtn:group_size=32"] + get_target("cpu").default_pipeline
    assert entries[1:1 + len(CLEANUP)] == CLEANUP
    passes = build_pipeline(entries)
    assert passes[0].options["group_size"] == 32 and passes[0].lossy


def test_a_recipe_replaces_the_quantisation_a_target_carries():
    entries = pipeline_entries(get_target("a100-int8"), CompileOptions(quant="int8"))
    assert entries.count("quantize_int8") == 1 and "smoothquant" not in entries
    assert entries.index("quantize_int8") < entries.index("remove_noops")


def test_targets_apply_their_default_recipe_only_without_quant_or_passes():
    a100 = get_target("a100-int8")
    assert pipeline_entries(a100, CompileOptions())[:2] == ["smoothquant", "quantize_w8a8:all_linears=true"]
    assert "quantize_w8a8" not in pipeline_entries(a100, CompileOptions(passes="dce"))
    assert pipeline_entries(get_target("cpu"), CompileOptions()) == get_target("cpu").default_pipeline
    for target in TARGETS.values():
        assert target.default_quant is None or target.default_quant in QUANT_RECIPES


def test_explicit_quant_passes_and_quant_conflict():
    with pytest.raises(PassError, match="give one or the other"):
        insert_quant_passes(["quantize_int8", "dce"], ["quantize_int4:method=rtn"], explicit=True)


@pytest.mark.parametrize("opts, message", [
    (CompileOptions(quant="int8", group_size=64), "--group-size applies to int4"),
    (CompileOptions(group_size=64), "--group-size needs --quant"),
])
def test_unsupported_flag_combinations_are_pass_errors(opts, message):
    with pytest.raises(PassError, match=message):
        pipeline_entries(get_target("cpu"), opts)


def test_unknown_quant_is_a_pass_error():
    with pytest.raises(PassError, match="int4-rtn"):
        quant_pass_specs("int3")


def test_h100_fp8_quantises_the_kv_cache_to_fp8_unless_told_otherwise():
    h100 = get_target("h100-fp8")
    assert pipeline_entries(h100, CompileOptions())[-1] == "quantize_kv_cache:dtype=fp8"
    assert h100.full_pipeline()[-1] == "quantize_kv_cache:dtype=fp8"
    assert pipeline_entries(h100, CompileOptions(kv_cache="int8"))[-1] == "quantize_kv_cache:dtype=int8"
    assert "quantize_kv_cache" not in " ".join(pipeline_entries(h100, CompileOptions(kv_cache="none")))
    assert "quantize_kv_cache" not in " ".join(pipeline_entries(get_target("h100-bf16"), CompileOptions()))
