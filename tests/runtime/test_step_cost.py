"""The speculative policy's price of a step of n rows, measured at load on the artifact and machine
(runtime/step_cost.py): fitted to 1 + jump + per_token (n - 1), kept per plan and machine so the next
load measures nothing, never kept when measured busy, reported by `llmc bench --speculative`."""

import json

import pytest
from llmc_cli import llmc_in_process

from llmc.runtime import speculative, step_cost
from llmc.runtime.engine import Engine, EngineConfig


@pytest.fixture(autouse=True)
def measured(monkeypatch, tmp_path):
    """The real measurement (the suite's conftest pins the fixed costs), into a fresh cache."""
    monkeypatch.setattr(speculative, "measured_step_cost", step_cost.measured_step_cost)
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))


def test_fit_interpolates_what_was_measured():
    cost = step_cost.StepCost(jump=0.25, per_token=0.125)
    fitted = step_cost.fit({n: 100.0 * cost.of(n) for n in step_cost.ROWS})
    assert all(fitted.of(n) == pytest.approx(cost.of(n), abs=1e-3) for n in range(1, 40))
    # the native program's 8 rows, then a walk: the step from 8 to 16 rows is priced as measured
    kinked = step_cost.fit({1: 100.0, 2: 110.0, 4: 130.0, 8: 170.0, 16: 500.0})
    assert kinked.of(3) == pytest.approx(1.2) and kinked.of(12) == pytest.approx(1.7 + 4 * 3.3 / 8)
    assert kinked.of(24) == pytest.approx(5.0 + 8 * 3.3 / 8)
    # a step of more rows measured cheaper than fewer (noise) costs what the fewer did
    assert step_cost.fit({1: 100.0, 2: 90.0, 4: 80.0}).of(4) == 1.0


def _engine(artifact):
    return Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=16,
                                         speculative={"method": "ngram", "num_speculative_tokens": 4}))


def test_the_engine_measures_once_per_machine_and_caches_it(artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(step_cost, "busy_reason", lambda record: None)
    first = _engine(artifact).speculator
    record = first.step_cost_record
    assert set(record["us"]) == set(step_cost.ROWS) and all(us > 0 for us in record["us"].values())
    assert first.step_cost == step_cost.fit(record["us"]) and "cached" not in record
    assert len(list((tmp_path / "cache" / "step_costs").glob("*.json"))) == 1
    second = _engine(artifact).speculator
    assert second.step_cost_record["cached"] and second.step_cost == first.step_cost
    # the policy prices k drafts at the measured cost
    n = 1 + 4
    assert second.tokens_per_cost(1.0, 4, 1) == pytest.approx(n / second.step_cost.of(n))


def test_a_busy_measurement_is_used_but_not_kept(artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(step_cost, "busy_reason", lambda record: "other work")
    spec = _engine(artifact).speculator
    assert spec.step_cost_record["busy"] == "other work"
    assert not list((tmp_path / "cache").glob("step_costs/*.json"))


def test_a_cache_too_small_keeps_the_fixed_costs(artifact, monkeypatch):
    monkeypatch.setattr(step_cost, "CONTEXT", 10**6)   # more context than the 4 MiB cache holds
    engine = _engine(artifact)
    assert engine.speculator.step_cost_record == {"fixed": "not measured on this device"}


def test_bench_reports_the_step_cost(artifact, capsys, monkeypatch):
    monkeypatch.setattr(step_cost, "busy_reason", lambda record: None)
    code, out, err = llmc_in_process(capsys, "bench", artifact, "-n", "2", "--input-len", "16", "--output-len", "8",
                                     "--speculative", "ngram", "--json", "--kv-memory", "4MiB")
    assert code == 0, err
    cost = json.loads(out)["speculative"]["step_cost"]
    assert {"jump", "per_token", "us"} <= set(cost)
