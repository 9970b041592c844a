"""`--kernels auto` chooses only on timings that decide (compiler/driver/tuning/ort_timing.py, ort_timing_cache.py):
where the families' timing ranges (best to median) overlap, or the machine was busy while they ran,
the torch kernels (the default) stay, the record says why, and nothing is cached; a clear
difference on a quiet machine chooses and is cached. The timer is a stub, so this host's speed and
load play no part."""

import itertools
import json

import pytest
from llmc_cli import llmc_in_process
from timing_fakes import lowered_wins

import llmc
from llmc import cache
from llmc.compiler.driver.tuning import ort_timing, ort_timing_cache


@pytest.fixture
def judged(monkeypatch, tmp_path):
    """Timings judged by their spread, in a fresh cache, on a machine read as quiet."""
    monkeypatch.delenv(cache.TRUST_ENV, raising=False)
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ort_timing_cache, "_memo", {})
    monkeypatch.setattr(ort_timing_cache, "busy_reason", lambda record: None)
    lowered_wins(monkeypatch)
    return tmp_path / "cache" / "kernel_timings"


def _stub_timer(monkeypatch, samples: dict[str, list[float]]):
    """ort_timing._time returning each family's microseconds in turn (torch: "cpu", an ORT session: "ort")."""
    cycles = {name: itertools.cycle(us) for name, us in samples.items()}
    family = lambda fn: "cpu" if isinstance(fn, ort_timing.TorchSegment) else "ort"
    monkeypatch.setattr(ort_timing, "_time", lambda fn, inputs: next(cycles[family(fn)]))


def _segment_entries(folder) -> list[dict]:
    entries = [json.loads(p.read_text()) for p in folder.glob("*.json")] if folder.exists() else []
    return [e for e in entries if e["key"]["what"] == "ort segment"]


def _compile(tmp_path, name="a"):
    path = llmc.compile("tiny-llama", output=tmp_path / f"{name}.llmc", kernels="auto", quiet=True)
    return path, json.loads((path / "plan.json").read_text())["meta"]["kernel_choice"]


def test_overlapping_spreads_choose_nothing_and_cache_nothing(tmp_path, judged, monkeypatch, capsys):
    # ORT's best is lower, but its range (90..130 us) overlaps the torch kernels' (100..140 us)
    _stub_timer(monkeypatch, {"cpu": [100.0, 140.0, 140.0], "ort": [90.0, 130.0, 130.0]})
    path, choice = _compile(tmp_path)
    kinds = choice["measured"]["kinds"]
    assert kinds and all(kind["chosen"] == "cpu" for kind in kinds)
    timed = [kind for kind in kinds if "us" in kind]
    assert timed and all("too close to call" in kind["why"] and kind["spread"]["ort"]["decode"] > 0.3 for kind in timed)
    assert _segment_entries(judged) == []
    assert choice["timings"]["close_calls"] >= len(timed)
    code, out, _ = llmc_in_process(capsys, "inspect", path)
    assert code == 0 and "timings:" in out and "too close to call (defaults kept)" in out


def test_a_clear_difference_chooses_and_is_cached(tmp_path, judged, monkeypatch):
    _stub_timer(monkeypatch, {"cpu": [100.0, 101.0, 102.0], "ort": [50.0, 51.0, 52.0]})
    _, choice = _compile(tmp_path)
    kinds = choice["measured"]["kinds"]
    timed = [kind for kind in kinds if "us" in kind and "ORT's outputs" not in kind.get("why", "")]
    assert timed and all(kind["chosen"] == "ort" for kind in timed)
    assert len(_segment_entries(judged)) == len([k for k in choice["measured"]["kinds"] if "us" in k])
    assert all(e["measured"]["at"] and "close" not in e["measured"] for e in _segment_entries(judged))
    record = choice["timings"]
    assert record["busy"] == record["close_calls"] == 0 and record["first"] <= record["last"]


def test_timings_measured_busy_keep_the_default_and_are_not_cached(tmp_path, judged, monkeypatch):
    _stub_timer(monkeypatch, {"cpu": [100.0, 101.0, 102.0], "ort": [50.0, 51.0, 52.0]})
    monkeypatch.setattr(ort_timing_cache, "busy_reason", lambda record: "other processes took 1.9 of 2 cores")
    _, choice = _compile(tmp_path)
    assert all(kind["chosen"] == "cpu" for kind in choice["measured"]["kinds"])
    assert any("busy machine" in kind.get("why", "") for kind in choice["measured"]["kinds"])
    assert not judged.exists() or not list(judged.glob("*.json"))
    assert choice["timings"]["busy"] == choice["timings"]["measurements"]


def _whole_plan(monkeypatch, timings):
    from types import SimpleNamespace

    from llmc.compiler.driver.tuning import ort_decode_timing
    from llmc.compiler.driver.tuning.ort_plan_choice import choose_whole_plan

    monkeypatch.setattr(ort_decode_timing, "measure_plans", lambda graph, candidates: timings)
    plan = SimpleNamespace(meta={})
    return choose_whole_plan(None, plan, plan, {}, {"measured": {"kinds": []}})


def test_whole_decode_steps_too_close_or_busy_keep_the_unlowered_plan(monkeypatch):
    from llmc.compiler.driver.tuning.ort_timing_cache import Timings

    monkeypatch.delenv(cache.TRUST_ENV, raising=False)
    clear = Timings({"cpu": 300.0, "walk": 100.0}, {"cpu": 0.02, "walk": 0.02})
    assert _whole_plan(monkeypatch, clear)["chosen"] == "walk"
    close = Timings({"cpu": 110.0, "walk": 100.0}, {"cpu": 0.02, "walk": 0.2})
    verdict = _whole_plan(monkeypatch, close)
    assert verdict["chosen"] == "cpu" and "too close to call" in verdict["why"]
    busy = Timings({"cpu": 300.0, "walk": 100.0}, {}, {"busy": "other processes took 1.9 of 2 cores"})
    verdict = _whole_plan(monkeypatch, busy)
    assert verdict["chosen"] == "cpu" and "busy machine" in verdict["why"]


def test_a_decode_graph_is_not_kept_on_a_close_whole_step(monkeypatch):
    from llmc.compiler.driver.tuning.decode_graph_choice import _step_verdict
    from llmc.compiler.driver.tuning.ort_timing_cache import Timings

    monkeypatch.delenv(cache.TRUST_ENV, raising=False)
    close = Timings({"plan": 100.0, "graph": 95.0, "launches": 400.0}, {"plan": 0.01, "graph": 0.1})
    verdict = _step_verdict({}, close)
    assert verdict["chosen"] is False and "too close to call" in verdict["why"]
    assert _step_verdict({}, Timings({"plan": 100.0, "graph": 50.0, "launches": 400.0}))["chosen"] is True
