"""Kernel choices re-checked where the artifact runs (compiler/driver/tuning/run_site.py): another CPU or
thread count, or compile timings taken busy, re-time the candidates the artifact stores (the plan as
compiled, its torch form) on this machine; the cheapest runs, and the load records why."""

import json

import pytest
import torch
from llmc_cli import llmc_in_process
from timing_fakes import lowered_wins

import llmc
from llmc.codegen.plan import ORT_SEGMENT, Plan
from llmc.compiler.artifact import read_artifact
from llmc.compiler.driver.tuning import ort_decode_timing, ort_timing, run_site
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.threads import resolve_threads

HERE = run_site.machine_record(2)


@pytest.fixture(autouse=True)
def _rechecking(monkeypatch):
    """The suite's conftest turns the re-check off for every other test."""
    monkeypatch.delenv(run_site.RECHECK_ENV, raising=False)


def _compiled(root, speed: dict[str, float]):
    """tiny-llama int4 compiled under auto with these faked segment timings (us), invariance off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMC_CACHE", str(root / "cache"))
        patch.setattr(ort_timing, "measure", lambda runners, graph, seg, outputs=None: {
            name: {"decode": speed[name], "prefill": speed[name]} for name in runners})
        lowered_wins(patch)
        return llmc.compile("tiny-llama", output=root / "a.llmc", quiet=True, batch_invariant="off",
                            quant="int4-rtn", group_size=32)


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """Every segment on ONNX Runtime."""
    return _compiled(tmp_path_factory.mktemp("run_site"), {"ort": 1.0, "cpu": 2.0, "ort-int8": 3.0})


@pytest.fixture(scope="module")
def torch_kept(tmp_path_factory):
    """Every segment kept on the torch kernels."""
    return _compiled(tmp_path_factory.mktemp("run_site_torch"), {"ort": 3.0, "cpu": 1.0, "ort-int8": 3.0})


def test_segments_kept_on_torch_are_lowered_where_onnx_runtime_measures_faster(torch_kept, monkeypatch):
    """The run site builds the candidate the compile did not store (every segment in ONNX Runtime, from
    the artifact's graph and weights), runs it where it measures fastest, and it computes the torch
    plan's logits; a batch-invariant run is not offered segments whose MatMulNBits round by row count."""
    art = read_artifact(torch_kept)
    plan = _moved(Plan.from_json(art.plan_json), cpu="Another CPU")
    assert not any(s.kernel == ORT_SEGMENT for s in plan.steps)
    order = {"cpu": 5.0, "walk": 5.0, "ort": 1.0}
    monkeypatch.setattr(ort_decode_timing, "measure_plans", lambda graph, candidates: {n: order[n] for n in candidates})
    chosen, data = run_site.recheck(art, plan, resolve_threads())
    assert chosen.meta["kernel_choice"][run_site.RUN_SITE]["whole_plan"]["chosen"] == "ort"
    segments = [s for s in chosen.steps if s.kernel == ORT_SEGMENT]
    assert segments and {s.attrs["file"] for s in segments} <= set(data)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4))
    rows = torch.arange(9)
    inputs = {"input_ids": ids, "positions": rows, "logits_indices": rows}
    got = PlanExecutor(chosen, art.weights, data=data).run_values(inputs)["logits"]
    # against the torch plan on int16 activation codes (2^-16): its default int8 ones round at 2^-8
    want = PlanExecutor(plan, art.weights, q4_activations="int16").run_values(inputs)["logits"]
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    invariant, _ = run_site.recheck(art, _moved(Plan.from_json(art.plan_json), cpu="Another CPU"), resolve_threads(),
                                    invariant=True)
    assert "nothing to choose" in invariant.meta["kernel_choice"][run_site.RUN_SITE]["whole_plan"]


def _moved(plan: Plan, **machine) -> Plan:
    """`plan` as if its kernels had been chosen on another machine."""
    plan.meta["kernel_choice"]["machine"] = {**plan.meta["kernel_choice"]["machine"], **machine}
    return plan


def test_the_compile_records_the_machine_and_inspect_shows_it(lowered, capsys):
    choice = json.loads((lowered / "plan.json").read_text())["meta"]["kernel_choice"]
    assert choice["machine"] == run_site.machine_record(resolve_threads())
    code, out, _ = llmc_in_process(capsys, "inspect", lowered)
    assert code == 0 and f"chosen on {HERE['cpu']} at {resolve_threads()} threads" in out


@pytest.mark.parametrize("compiled_on, asked, why", [
    (HERE, None, None),
    ({**HERE, "cpu": "Another CPU"}, None, "chosen on 'Another CPU'"),
    ({**HERE, "threads": 8}, None, "chosen at 8 threads, running at 2"),
    (None, None, "does not record the machine"),
    (HERE, True, "asked"),
    ({**HERE, "cpu": "Another CPU"}, False, None),
])
def test_why_recheck(compiled_on, asked, why):
    choice = {"machine": compiled_on} if compiled_on else {}
    got = run_site.why_recheck(choice, HERE, asked)
    assert got is None if why is None else why in got
    assert "busy" in run_site.why_recheck({"machine": HERE, "timings": {"busy": 3}}, HERE, None)


@pytest.mark.parametrize("fastest, torch_form", [("cpu", True), ("walk", False)])
def test_another_machine_runs_what_measures_fastest_there(lowered, monkeypatch, fastest, torch_form):
    art = read_artifact(lowered)
    plan = _moved(Plan.from_json(art.plan_json), cpu="Another CPU")
    assert any(s.kernel == ORT_SEGMENT for s in plan.steps)
    order = {"cpu": 5.0, "walk": 5.0, "graph": 9.0, "ort": 7.0, fastest: 1.0}
    monkeypatch.setattr(ort_decode_timing, "measure_plans", lambda graph, candidates: {n: order[n] for n in candidates})
    lines = []
    chosen, data = run_site.recheck(art, plan, resolve_threads(), echo=lines.append)
    record = chosen.meta["kernel_choice"][run_site.RUN_SITE]
    assert record["whole_plan"]["chosen"] == fastest and "Another CPU" in record["why"] and "re-checking" in lines[0]
    assert any(s.kernel == ORT_SEGMENT for s in chosen.steps) is not torch_form
    assert set(record["dense_from"]) == set(chosen.meta["kernel_choice"]["qlinear_dispatch"]["shapes"])
    # the plan chosen computes what its kernels compute: the torch form's logits are the torch plan's
    ids = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(3))
    rows = torch.arange(7)
    logits = PlanExecutor(chosen, art.weights, data=data).run_values(
        {"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"]
    assert torch.isfinite(logits).all() and logits.shape[0] == 7


def test_a_busy_measurement_keeps_the_compiled_plan(lowered, monkeypatch):
    art = read_artifact(lowered)
    plan = _moved(Plan.from_json(art.plan_json), threads=64)
    busy = ort_decode_timing.Timings({"cpu": 1.0, "walk": 9.0, "graph": 9.0, "ort": 9.0}, {}, {"busy": "other work"})
    monkeypatch.setattr(ort_decode_timing, "measure_plans", lambda graph, candidates: busy)
    chosen, _ = run_site.recheck(art, plan, resolve_threads())
    assert chosen.steps == plan.steps
    assert "busy" in chosen.meta["kernel_choice"][run_site.RUN_SITE]["whole_plan"]["why"]


def test_the_same_machine_rechecks_nothing(lowered):
    art = read_artifact(lowered)
    plan = Plan.from_json(art.plan_json)
    assert run_site.recheck(art, plan, resolve_threads())[0] is plan


def test_load_rechecks_for_real_and_caches_the_verdict(lowered, monkeypatch, tmp_path, capfd):
    """No fakes: llmc.load(recheck_kernels=True) times the candidates on this machine, generates, and a
    second load recalls the timings (the machine's cache) instead of measuring again."""
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(run_site.RECHECK_ENV, "1")
    first = llmc.load(lowered, kv_memory="8MiB")
    record = first.engine.executor.plan.meta["kernel_choice"][run_site.RUN_SITE]
    assert record["why"] == "asked" and set(record["whole_plan"]["step_us"]) == {"cpu", "walk", "graph", "ort"}
    out = first.generate("hello", llmc.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    del first
    measured = list((tmp_path / "cache" / "kernel_timings").glob("*.json"))
    second = llmc.load(lowered, kv_memory="8MiB")
    assert second.engine.executor.plan.meta["kernel_choice"][run_site.RUN_SITE]["whole_plan"] == record["whole_plan"]
    assert sorted((tmp_path / "cache" / "kernel_timings").glob("*.json")) == sorted(measured)


def test_bench_remeasure_rechecks_and_reports(lowered, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    code, out, err = llmc_in_process(capsys, "bench", lowered, "-n", "1", "--input-len", "8", "--output-len", "2",
                                     "--json", "--remeasure", "--kv-memory", "8MiB")
    assert code == 0, err
    assert json.loads(out)["kernel_recheck"]["why"] == "asked"


def test_a_bad_setting_is_refused(lowered, monkeypatch):
    monkeypatch.setenv(run_site.RECHECK_ENV, "sometimes")
    with pytest.raises(llmc.LlmcError, match="LLMC_RECHECK_KERNELS='sometimes'"):
        llmc.load(lowered, kv_memory="8MiB")
