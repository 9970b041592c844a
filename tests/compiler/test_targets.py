"""Targets carry datasheet facts and a default pipeline of registered passes."""

import json

import pytest

from llmc.compiler.ir import DTYPE_BYTES
from llmc.compiler.pipeline import describe_target, full_pipeline
from llmc.compiler.targets import PRECISION_DTYPES, TARGETS, Target, get_target, host_memory_bytes
from llmc.errors import TargetError
from llmc.passes.base import build_pipeline

GiB = 2**30
NAMES = ["cpu", "cpu-bf16", "h100-fp8", "h100-bf16", "a100-bf16", "a100-int8", "rtx4090-int4", "orin-int4"]
GPU_NAMES = NAMES[2:]


def test_all_targets_are_listed():
    assert list(TARGETS) == NAMES
    assert all(get_target(name) is TARGETS[name] for name in NAMES)


def test_unknown_target_lists_valid_ones():
    with pytest.raises(TargetError, match="unknown target 'h200'; valid targets: cpu, cpu-bf16, h100-fp8, .*orin-int4"):
        get_target("h200")


def test_get_target_passes_a_target_through():
    assert get_target(TARGETS["cpu"]) is TARGETS["cpu"]


def test_cpu_target_is_ready_with_cleanup_then_fusions():
    cpu = get_target("cpu")
    cpu.check_ready()
    assert cpu.device == "cpu" and cpu.compile_ready
    assert cpu.default_pipeline[:3] == ["remove_noops", "fold_constants", "dce"]
    assert {"fuse_qkv", "fuse_gate_up", "fuse_swiglu", "fuse_rms_norm", "fuse_attention"} <= set(cpu.default_pipeline)
    assert cpu.default_pipeline[-1] == "dce"
    assert [p.name for p in build_pipeline(cpu.default_pipeline)] == cpu.default_pipeline
    assert cpu.memory_bytes == host_memory_bytes() > 0


def test_cpu_bf16_target_casts_to_bf16_before_the_cpu_fusions():
    bf16, cpu = get_target("cpu-bf16"), get_target("cpu")
    bf16.check_ready()
    assert bf16.device == "cpu" and bf16.weight_ir_dtype == bf16.activation_ir_dtype == "bfloat16"
    assert [p for p in bf16.default_pipeline if p != "cast_bf16"] == cpu.default_pipeline
    assert [p.name for p in build_pipeline(full_pipeline(bf16))] == bf16.default_pipeline


@pytest.mark.parametrize("name", GPU_NAMES)
def test_gpu_targets_are_ready_with_registered_passes(name):
    target = get_target(name)
    target.check_ready()
    assert target.device == "cuda" and target.compile_ready and target.activation_ir_dtype == "bfloat16"
    assert target.default_pipeline[0] == "remove_noops" and target.default_pipeline[-1] == "dce"
    assert "cast_bf16" in target.default_pipeline
    names = [p.name for p in build_pipeline(full_pipeline(target))]
    if target.default_kv_cache:   # the KV-cache pass comes last, after the target's own pipeline
        assert names.pop() == "quantize_kv_cache"
    assert names[-len(target.default_pipeline):] == target.default_pipeline


@pytest.mark.parametrize("name, memory_gib, bandwidth, arch, dtype, peak", [
    ("h100-fp8", 80, 3.35e12, "sm_90", "fp8", 1979.0),
    ("h100-bf16", 80, 3.35e12, "sm_90", "bf16", 989.0),
    ("a100-bf16", 80, 2.039e12, "sm_80", "bf16", 312.0),
    ("a100-int8", 80, 2.039e12, "sm_80", "int8", 624.0),
    ("rtx4090-int4", 24, 1.008e12, "sm_89", "int4", 1321.2),
    ("orin-int4", 64, 204.8e9, "sm_87", "int8", 85.0),
])
def test_datasheet_facts(name, memory_gib, bandwidth, arch, dtype, peak):
    t = get_target(name)
    assert (t.memory_bytes, t.bandwidth_bytes_per_s, t.arch) == (memory_gib * GiB, bandwidth, arch)
    assert t.peak_tflops[dtype] == peak


def test_precision_names_match_ir_dtypes_and_fp8_support():
    for t in TARGETS.values():
        assert t.weight_ir_dtype in DTYPE_BYTES and t.activation_ir_dtype in DTYPE_BYTES
        assert t.compute_dtype in t.peak_tflops
        assert t.supports_fp8 == (t.name.startswith("h100") or t.name.startswith("rtx4090"))
    assert get_target("h100-fp8").weight_ir_dtype == "float8_e4m3fn"
    assert set(PRECISION_DTYPES) >= {"fp32", "bf16", "fp8", "int8", "int4"}


def test_to_dict_is_json_and_round_trips():
    for t in TARGETS.values():
        d = json.loads(json.dumps(t.to_dict()))
        assert Target(**d) == t
        assert d["default_pipeline"] == t.default_pipeline


def test_describe_is_one_line_of_facts():
    line = describe_target(get_target("h100-fp8"))
    assert "\n" not in line
    assert line.startswith("h100-fp8: ")
    for fact in ("sm_90", "80 GiB", "3350.0 GB/s", "1979 fp8 TFLOPS", "; ready"):
        assert fact in line
    assert "624 int8 TOPS" in describe_target(get_target("a100-int8"))


def test_targets_are_hashable_and_immutable():
    cpu = get_target("cpu")
    assert {cpu: 1}[cpu] == 1
    with pytest.raises(AttributeError):
        cpu.name = "gpu"
