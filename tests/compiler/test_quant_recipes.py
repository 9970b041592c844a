"""--quant recipes become typed pass configs in the quantize stage: before the cleanup passes,
replacing a target's own quantisation; target presets pick one when the user names none;
conflicting flags are refused with a PassError before anything is loaded."""

import pytest

from llmc.compiler.options import CompileOptions
from llmc.compiler.pipeline import full_pipeline, pass_configs
from llmc.compiler.recipes import QUANT_RECIPES, quant_passes
from llmc.compiler.targets import TARGETS, get_target
from llmc.errors import PassError

CLEANUP = ["remove_noops", "fold_constants", "dce"]


def chosen(target: str, **options) -> list[str]:
    """name:key=value specs of the passes after lowering."""
    return [c.spec() for c in pass_configs(get_target(target), CompileOptions(**options)) if c.origin != "lowering"]


def names(target: str, **options) -> list[str]:
    return [spec.split(":")[0] for spec in chosen(target, **options)]


@pytest.mark.parametrize("quant, group_size, expected", [
    ("int8", None, [("quantize_int8", {})]),
    ("int4-rtn", None, [("quantize_int4", {"method": "rtn", "group_size": 128})]),
    ("int4-gptq", 64, [("quantize_int4", {"method": "gptq", "group_size": 64})]),
    ("int4-awq", 32, [("quantize_int4", {"method": "awq", "group_size": 32})]),
    ("fp8", None, [("quantize_fp8", {})]),
    ("w8a8", None, [("smoothquant", {}), ("quantize_w8a8", {"all_linears": True})]),
])
def test_each_recipe_names_its_passes_with_typed_options(quant, group_size, expected):
    configs = quant_passes(quant, group_size)
    assert [c.name for c in configs] == [name for name, _ in expected]
    for config, (_, options) in zip(configs, expected):
        assert {k: config.options.to_dict()[k] for k in options} == options
        assert config.stage.label == "quantize"


def test_recipes_go_before_the_cleanup_passes_of_the_cpu_target():
    specs = chosen("cpu", quant="int4-rtn", group_size=32)
    assert specs == ["quantize_int4:group_size=32"] + full_pipeline(get_target("cpu"))
    assert specs[1:1 + len(CLEANUP)] == CLEANUP
    configs = pass_configs(get_target("cpu"), CompileOptions(quant="int4-rtn", group_size=32))
    config = next(c for c in configs if c.name == "quantize_int4")
    assert config.options.group_size == 32 and config.instantiate().lossy


def test_a_recipe_replaces_the_quantisation_a_target_carries():
    entries = names("a100-int8", quant="int8")
    assert entries.count("quantize_int8") == 1 and "smoothquant" not in entries
    assert entries.index("quantize_int8") < entries.index("remove_noops")


def test_targets_apply_their_default_recipe_only_without_quant_or_passes():
    assert chosen("a100-int8")[:2] == ["smoothquant", "quantize_w8a8:all_linears=true"]
    assert "quantize_w8a8" not in names("a100-int8", passes="dce")
    assert names("cpu") == list(get_target("cpu").default_pipeline)
    for target in TARGETS.values():
        assert target.default_quant is None or target.default_quant in QUANT_RECIPES


def test_explicit_quant_passes_and_quant_conflict():
    with pytest.raises(PassError, match="give one or the other"):
        names("cpu", passes="quantize_int8,dce", quant="int4-rtn")


@pytest.mark.parametrize("opts, message", [
    ({"quant": "int8", "group_size": 64}, "--group-size applies to int4"),
    ({"group_size": 64}, "--group-size needs --quant"),
    ({"quant": "int4-rtn", "group_size": 100}, "--quant: pass 'quantize_int4': option group_size=100 is unknown"),
])
def test_unsupported_flag_combinations_are_pass_errors(opts, message):
    with pytest.raises(PassError, match=message):
        names("cpu", **opts)


def test_unknown_quant_is_a_pass_error():
    with pytest.raises(PassError, match="int4-rtn"):
        quant_passes("int3")


def test_h100_fp8_quantises_the_kv_cache_to_fp8_unless_told_otherwise():
    h100 = get_target("h100-fp8")
    assert chosen("h100-fp8")[-1] == "quantize_kv_cache:dtype=fp8"
    assert full_pipeline(h100)[-1] == "quantize_kv_cache:dtype=fp8"
    assert chosen("h100-fp8", kv_cache="int8")[-1] == "quantize_kv_cache"
    assert "quantize_kv_cache" not in names("h100-fp8", kv_cache="none")
    assert "quantize_kv_cache" not in names("h100-bf16")
