"""`--kernels auto`'s whole-plan choice (codegen/ort_plan_choice.py): with ORT segments among the layers,
whole decode steps of the unlowered cpu plan (the native decode program), the lowered plan walked and
through its decode graph are timed, and the request cost decides what the artifact holds. Timings are
faked here (ORT segment kinds faster, then each way winning the whole step) so the choice, not this
host's speed, is what is tested; the real timings of each path are test_native_decode.py's concern."""

import json

import pytest
from llmc_cli import llmc_in_process

import llmc
from llmc import SamplingParams
from llmc.codegen import cpu_native
from llmc.compiler.artifact import read_artifact

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels are not built here")


def _compile(root, monkeypatch, steps: dict[str, float]):
    from llmc.codegen import ort_decode_timing, ort_timing

    monkeypatch.setenv("LLMC_CACHE", str(root / "cache"))
    monkeypatch.setattr(ort_timing, "measure", lambda runners, graph, seg, outputs=None: {
        name: {"decode": 1.0 if name == "ort" else 2.0, "prefill": 1.0 if name == "ort" else 2.0} for name in runners})
    timed = []
    monkeypatch.setattr(ort_decode_timing, "measure_plans",
                        lambda graph, candidates: timed.append(sorted(candidates)) or
                        {name: steps[name] for name in candidates})
    path = llmc.compile("tiny-llama", output=root / "int4.llmc", kernels="auto", quant="int4-rtn", group_size=32,
                        quiet=True)
    assert timed == [["cpu", "graph", "walk"]]   # one timing, all three ways together
    return path


def _greedy(path) -> list[int]:
    out = llmc.load(path, kv_memory="8MiB").generate({"prompt_token_ids": [5, 17, 99, 3, 42]},
                                                    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_the_cpu_plan_wins_when_its_decode_steps_do(tmp_path, monkeypatch, capsys):
    path = _compile(tmp_path, monkeypatch, {"cpu": 100.0, "walk": 300.0, "graph": 200.0})
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


@pytest.mark.parametrize("graph_us,native_first", [(200.0, True), (50.0, False)])
def test_the_lowered_plan_keeps_its_decode_graph_for_what_the_program_does_not_take(tmp_path, monkeypatch, graph_us,
                                                                                   native_first):
    """The kinds' timings chose the decode graph (ORT faster): where the walk's native decode program beats it,
    it stays for the steps the program does not take (over MAX_ROWS sequences), which the walk runs launch by
    launch as the kinds were timed; otherwise it takes every decode step."""
    path = _compile(tmp_path, monkeypatch, {"cpu": 300.0, "walk": 100.0, "graph": graph_us})
    a = read_artifact(path)
    meta = json.loads(a.plan_json)["meta"]
    assert meta["kernel_choice"]["whole_plan"]["chosen"] == ("walk" if native_first else "graph")
    record = meta["decode_graph"]
    assert record["chosen"] and "ort/decode.onnx" in a.data and "kinds_chose" not in record
    assert record.get("native_first", False) is native_first
    if native_first:
        assert "plan walk's 100 us" in record["why"]
    assert any(name.startswith("ort/segment") for name in a.data)
    llm = llmc.load(path, kv_memory="8MiB")
    assert llm.engine.executor.decode_graph.native_first is native_first


def test_native_first_routes_small_decode_steps_to_the_program_and_large_ones_to_the_graph(tmp_path, monkeypatch):
    from llmc.runtime import native_decode
    from llmc.runtime.ort_decode import DecodeGraph

    path = _compile(tmp_path, monkeypatch, {"cpu": 300.0, "walk": 100.0, "graph": 200.0})
    calls = []
    graph_call, run = DecodeGraph.__call__, native_decode.NativeDecode.run
    monkeypatch.setattr(DecodeGraph, "__call__", lambda self, *a: calls.append("graph") or graph_call(self, *a))
    monkeypatch.setattr(native_decode.NativeDecode, "run",
                        lambda self, *a: calls.append("program") or run(self, *a))
    llm = llmc.load(path, kv_memory="16MiB")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5, 17, 99]}, params)
    assert "program" in calls and "graph" not in calls
    calls.clear()
    llm.generate([{"prompt_token_ids": [5 + i, 17, 99]} for i in range(cpu_native.MAX_ROWS + 1)], params)
    assert "graph" in calls
