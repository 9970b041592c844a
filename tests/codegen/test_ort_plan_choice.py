"""`--kernels auto`'s whole-plan choice (compiler/driver/tuning/ort_plan_choice.py): with ORT segments among the layers,
whole decode steps of the unlowered cpu plan (the native decode program), the lowered plan walked and
through its decode graph are timed, and the request cost decides what the artifact holds. Timings are
faked here (ORT segment kinds faster, then each way winning the whole step) so the choice, not this
host's speed, is what is tested; the real timings of each path are test_native_decode.py's concern."""

import json

import pytest
from llmc_cli import llmc_in_process

import llmc
from llmc import SamplingParams
from llmc.codegen.native import cpu_native
from llmc.compiler.artifact import read_artifact

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels are not built here")


def _compile(root, monkeypatch, steps: dict[str, float]):
    from llmc.compiler.driver.tuning import ort_decode_timing, ort_timing

    monkeypatch.setenv("LLMC_CACHE", str(root / "cache"))
    monkeypatch.setattr(ort_timing, "measure", lambda runners, graph, seg, outputs=None: {
        name: {"decode": 1.0 if name == "ort" else 2.0, "prefill": 1.0 if name == "ort" else 2.0} for name in runners})
    timed = []
    monkeypatch.setattr(ort_decode_timing, "measure_plans",
                        lambda graph, candidates: timed.append(sorted(candidates)) or
                        {name: steps[name] for name in candidates})
    # batch invariance off: on, auto keeps these fp32-activation MatMulNBits segments on torch and offers no decode
    # graph (tests/runtime/test_batch_invariance.py)
    path = llmc.compile("tiny-llama", output=root / "int4.llmc", kernels="auto", quant="int4-rtn", group_size=32,
                        quiet=True, batch_invariant="off")
    # one timing, every way together (the walk launch by launch too, for the graph's native_first)
    assert timed == [["cpu", "graph", "launches", "walk"]]
    return path


def _greedy(path) -> list[int]:
    out = llmc.load(path, kv_memory="8MiB").generate({"prompt_token_ids": [5, 17, 99, 3, 42]},
                                                    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_the_cpu_plan_wins_when_its_decode_steps_do(tmp_path, monkeypatch, capsys):
    path = _compile(tmp_path, monkeypatch, {"cpu": 100.0, "walk": 300.0, "graph": 200.0, "launches": 400.0})
    a = read_artifact(path)
    plan = json.loads(a.plan_json)
    choice = plan["meta"]["kernel_choice"]
    assert choice["whole_plan"]["chosen"] == "cpu" and "int8_activations" not in choice
    assert "decode_graph" not in plan["meta"] and not a.data
    assert {s["kernel"] for s in plan["steps"]} >= {"cpu.qlinear", "cpu.flash_attention"}
    assert not any(s["kernel"] == "ort.segment" for s in plan["steps"])
    # prefill is priced too: 2 us a segment more in torch, against 128 x 200 us saved a request
    assert choice["whole_plan"]["prefill_extra_us"] > 0
    code, out, _ = llmc_in_process(capsys, "inspect", path)
    assert code == 0 and "whole plan: the torch kernels throughout" in out
    reference = llmc.compile("tiny-llama", output=tmp_path / "cpu.llmc", kernels="cpu", quant="int4-rtn",
                             group_size=32, quiet=True)
    assert _greedy(path) == _greedy(reference)


@pytest.mark.parametrize("graph_us,launches_us,kept", [(200.0, 400.0, "native_first"), (50.0, 400.0, "every step"),
                                                      (200.0, 150.0, None)])
def test_the_lowered_plan_keeps_its_decode_graph_where_it_beats_what_would_run(tmp_path, monkeypatch, graph_us,
                                                                              launches_us, kept):
    """The walk (with the native decode program) beats the graph: the graph stays for the steps the program
    does not take (over MAX_ROWS sequences) if it beat the walk launch by launch, which runs them otherwise;
    the graph beats the walk: it takes every decode step."""
    path = _compile(tmp_path, monkeypatch, {"cpu": 300.0, "walk": 100.0, "graph": graph_us, "launches": launches_us})
    a = read_artifact(path)
    meta = json.loads(a.plan_json)["meta"]
    assert meta["kernel_choice"]["whole_plan"]["chosen"] == ("graph" if kept == "every step" else "walk")
    record = meta["decode_graph"]
    assert record["chosen"] is (kept is not None) and ("ort/decode.onnx" in a.data) is (kept is not None)
    assert record.get("native_first", False) is (kept == "native_first")
    if kept != "every step":
        assert "plan walk's 100 us" in record["why"]
    assert any(name.startswith("ort/segment") for name in a.data)
    graph = llmc.load(path, kv_memory="8MiB", batch_invariant=False).engine.executor.decode_graph
    assert (graph is not None) is (kept is not None)
    assert llmc.load(path, kv_memory="8MiB", batch_invariant=True).engine.executor.decode_graph is None


def test_native_first_routes_small_decode_steps_to_the_program_and_large_ones_to_the_graph(tmp_path, monkeypatch):
    from llmc.runtime import native_decode
    from llmc.runtime.ort_decode import DecodeGraph

    path = _compile(tmp_path, monkeypatch, {"cpu": 300.0, "walk": 100.0, "graph": 200.0, "launches": 400.0})
    calls = []
    graph_call, run = DecodeGraph.__call__, native_decode.NativeDecode.run
    monkeypatch.setattr(DecodeGraph, "__call__", lambda self, *a: calls.append("graph") or graph_call(self, *a))
    monkeypatch.setattr(native_decode.NativeDecode, "run",
                        lambda self, *a: calls.append("program") or run(self, *a))
    llm = llmc.load(path, kv_memory="16MiB", batch_invariant=False)   # on, the decode graph is not used
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5, 17, 99]}, params)
    assert "program" in calls and "graph" not in calls
    calls.clear()
    llm.generate([{"prompt_token_ids": [5 + i, 17, 99]} for i in range(cpu_native.MAX_ROWS + 1)], params)
    assert "graph" in calls
