"""tiny-llama compiled for every GPU target: a static Triton plan whose steps record the kernels
they launch, an artifact that stores and hashes each kernel source once, byte-identical rebuilds,
`llmc inspect --kernels`, `--autotune` without a GPU, and failed GPU compiles leaving nothing."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from llmc_cli import llmc_in_process

import llmc
from llmc import SamplingParams
from llmc.codegen.autotune import NO_GPU, default_configs
from llmc.codegen.kernel_sources import kernel_file
from llmc.codegen.plan import Plan
from llmc.codegen.triton import triton_elementwise
from llmc.codegen.triton.triton_configs import row_config
from llmc.codegen.triton.triton_render import render_kernel
from llmc.compiler.artifact import read_artifact, sha256_file
from llmc.compiler.inspect import kernel_report
from llmc.compiler.targets import TARGETS
from llmc.errors import ArtifactError, TargetError
from llmc.runtime.kernel_check import verify_kernels

GPU_TARGETS = [name for name, t in TARGETS.items() if t.device == "cuda"]
FAST = dict(calib_samples=2, calib_seq_len=16, max_num_batched_tokens=64)
# AWQ's scale search alone takes ~25 s on tiny-llama here; int4-rtn makes the same int4 plan, and
# the AWQ pipeline itself is built in test_targets.py
QUANT_OVERRIDE = {"rtx4090-int4": "int4-rtn"}
SCHEMES = {"h100-fp8": "fp8", "a100-int8": "w8a8", "rtx4090-int4": "int4", "orin-int4": "int4"}


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path_factory.getbasetemp() / "llmc-cache"))


def compile_tiny(target: str, output: Path, **options) -> Path:
    return llmc.compile("tiny-llama", target=target, output=output, quant=QUANT_OVERRIDE.get(target),
                        **FAST, **options)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-targets")
    return {t: compile_tiny(t, root / f"{t}.llmc") for t in GPU_TARGETS + ["cpu"]}


def read_plan(path: Path) -> Plan:
    return Plan.from_json((path / "plan.json").read_text())




@pytest.mark.parametrize("target", GPU_TARGETS)
def test_every_gpu_target_compiles_tiny_llama_into_a_triton_plan(compiled, target):
    path = compiled[target]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["target"]["name"] == target and manifest["model"]["kv_dtype"] == \
        ("float8_e4m3fn" if target == "h100-fp8" else "bfloat16")   # h100-fp8 quantises the KV cache too
    plan = read_plan(path)
    assert all(s.kernel.startswith("triton.") for s in plan.steps)
    assert plan.type_of("logits").dtype == "float32"
    ops = {s.kernel.removeprefix("triton.") for s in plan.steps}
    assert {"flash_attention", "add_rms_norm", "swiglu", "rms_norm"} <= set(plan.meta["kernels"]["triton_ops"])
    assert set(plan.meta["kernels"]["triton_ops"]) | set(plan.meta["kernels"]["torch_ops"]) == ops
    float_weights = {t["dtype"] for n, t in plan.types.items() if n in plan.params and "float" in t["dtype"]}
    assert "bfloat16" in float_weights
    qlinears = [s for s in plan.steps if s.kernel == "triton.qlinear"]
    assert {s.attrs["scheme"] for s in qlinears} == ({SCHEMES[target]} if target in SCHEMES else set())
    assert all(s.attrs["kernels"] for s in qlinears)
    assert plan.meta["autotune"]["tuned"] is False


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_recorded_kernels_match_a_fresh_render_and_the_hashed_files(compiled, target):
    path = compiled[target]
    plan = read_plan(path)
    index = json.loads((path / "kernels.json").read_text())
    manifest_files = json.loads((path / "manifest.json").read_text())["files"]
    records = {r["sha256"]: r for s in plan.steps for r in s.attrs.get("kernels", [])}
    assert sorted(e["sha256"] for e in index) == sorted(records)
    stored = sorted(p.name for p in (path / "kernels").iterdir())
    assert stored == sorted(kernel_file(r) for r in records.values())
    for entry in index:
        source = render_kernel(entry["template"], entry["name"], entry["constants"]).source
        assert hashlib.sha256(source.encode()).hexdigest() == entry["sha256"]
        assert (path / entry["file"]).read_text() == source
        assert manifest_files[entry["file"]] == sha256_file(path / entry["file"])
        assert entry["steps"] == [s.node for s in plan.steps
                                  if entry["sha256"] in {r["sha256"] for r in s.attrs.get("kernels", [])}]
    assert manifest_files["kernels.json"] == sha256_file(path / "kernels.json")
    art = read_artifact(path)
    verify_kernels(plan, art.kernels, path)


def test_a_tampered_kernel_source_fails_the_hash_check(compiled, tmp_path):
    path = shutil.copytree(compiled["h100-bf16"], tmp_path / "copy.llmc")
    victim = sorted((path / "kernels").iterdir())[0]
    victim.write_text(victim.read_text() + "\nprint('hello')\n")
    with pytest.raises(ArtifactError, match=f"kernels/{victim.name} fails its sha256 check"):
        read_artifact(path)


def test_cpu_artifacts_carry_no_kernels(compiled):
    path = compiled["cpu"]
    assert not (path / "kernels").exists() and not (path / "kernels.json").exists()
    assert "kernels" not in read_plan(path).meta and "autotune" not in read_plan(path).meta


def test_a_rebuild_is_byte_identical(compiled, tmp_path):
    again = compile_tiny("a100-int8", tmp_path / "again.llmc")

    def files(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
                if p.is_file() and p.name != "timings.json"}
    first, second = files(compiled["a100-int8"]), files(again)
    assert sorted(first) == sorted(second) and any(name.startswith("kernels/") for name in first)
    assert [n for n in first if first[n] != second[n]] == []


def test_inspect_kernels_lists_template_constants_sha_and_launches(compiled, capfd):
    path = compiled["h100-fp8"]
    code, out, err = llmc_in_process(capfd, "inspect", path, "--kernels")
    assert code == 0, err
    report = kernel_report(path)
    assert out.startswith(f"artifact {path} (target h100-fp8): {len(report['kernels'])} Triton kernels")
    assert "torch runs " in out and "launch configs: the target's defaults; autotune: not requested" in out
    lines = out.splitlines()
    for k in report["kernels"]:
        [i] = [i for i, line in enumerate(lines) if line.strip().startswith(k["file"].removeprefix("kernels/"))]
        steps = len(k["steps"])
        assert k["template"] in lines[i] and k["sha256"][:12] in lines[i]
        assert f"launched by {steps} step{'s' if steps != 1 else ''}" in lines[i]
        assert all(f"{name}={value}" in lines[i + 1] for name, value in k["constants"].items())

    code, out, _ = llmc_in_process(capfd, "inspect", path, "--kernels", "--json")
    assert code == 0 and json.loads(out) == json.loads(json.dumps(report))

    gemm = next(k for k in report["kernels"] if k["template"] == "dequant_gemm.py.j2")
    for name in (gemm["file"], gemm["file"].removeprefix("kernels/").removesuffix(".py")):
        code, out, _ = llmc_in_process(capfd, "inspect", path, "--kernels", "--source", name)
        assert code == 0 and out == (path / gemm["file"]).read_text()
    code, out, _ = llmc_in_process(capfd, "inspect", path, "--kernels", "--source", "swiglu")
    assert code == 0 and "def swiglu(" in out


@pytest.mark.parametrize("args, fragments", [
    (["--kernels", "--source", "paged_decode"], ["'paged_decode' names several kernels", "paged_decode-"]),
    (["--kernels", "--source", "nope"], ["'nope' is no kernel of it", "swiglu-"]),
    (["--source", "swiglu"], ["--source NAME", "--kernels"]),
])
def test_inspect_kernels_mistakes_are_one_line_errors(compiled, capfd, args, fragments):
    code, out, err = llmc_in_process(capfd, "inspect", compiled["h100-bf16"], *args)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("llmc: error: ") and all(f in line for f in fragments)


def test_inspect_kernels_of_a_cpu_artifact_says_it_has_none(compiled, capfd):
    code, out, _ = llmc_in_process(capfd, "inspect", compiled["cpu"], "--kernels")
    assert code == 0 and "launches no Triton kernels" in out


def test_autotune_without_a_gpu_says_so_once_and_records_the_defaults(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    output = tmp_path / "tuned.llmc"
    code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "--target", "h100-bf16", "-o", output,
                                   "--autotune", "--calib-samples", "2", "--calib-seq-len", "16")
    assert code == 0, err
    assert [line for line in err.splitlines() if "autotun" in line] == [
        f"llmc: {NO_GPU}; the plan records the target's default launch configs"]
    meta = read_plan(output).meta["autotune"]
    assert meta == {"tuned": False, "reason": NO_GPU,
                    "configs": {f: c.to_dict() for f, c in sorted(default_configs("h100-bf16").items())}}


def test_a_failed_gpu_compile_leaves_nothing(tmp_path, capfd, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "--target", "h100-bf16", "-o",
                                   out_dir / "m.llmc", "--pass-option", "cast_bf16.dtype=float8")
    assert code == 2 and "cast_bf16" in err and "dtype='float8'" in err and len(err.splitlines()) == 1
    assert list(out_dir.iterdir()) == []

    # a row too long for the target's RMSNorm kernel fails at planning, after every pass ran
    narrow = type(row_config("h100"))(warp_elements=256, max_warps=16, swiglu_block=1024, rotary_heads=4, max_row=32)
    monkeypatch.setattr(triton_elementwise, "row_config", lambda target: narrow)
    triton_elementwise.render_rms_norm.cache_clear()
    try:
        with pytest.raises(TargetError, match=r"node \S+: no Triton kernel for this rms_norm .*64 features"):
            compile_tiny("h100-bf16", out_dir / "m.llmc")
    finally:
        triton_elementwise.render_rms_norm.cache_clear()
    assert list(out_dir.iterdir()) == []


def test_an_fp8_artifact_runs_in_the_interpreter_launching_only_recorded_kernels(compiled):
    model = llmc.load(compiled["h100-fp8"], device="cpu", check_kernels=True, kv_memory="4MiB")
    outs = model.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12]}],
                          SamplingParams(max_tokens=3, temperature=0.0))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
