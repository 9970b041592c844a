"""A machine figure (runtime/roofline.py) is cached only when measured on a quiet machine with steady
samples (llmc/cache.py): one measured beside a competing load is used once and not kept; `llmc cache`
shows and clears what is kept, `llmc bench --remeasure` measures again."""

import json
import subprocess
import sys
import time

import pytest
from llmc_cli import llmc_in_process

from llmc import cache
from llmc.runtime import roofline


@pytest.fixture(autouse=True)
def judged(monkeypatch, tmp_path):
    """Measurements judged by their load and spread (the suite trusts them otherwise), in a fresh cache."""
    monkeypatch.delenv(cache.TRUST_ENV, raising=False)
    monkeypatch.delenv(cache.REMEASURE_ENV, raising=False)
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "bandwidth.json"


def _others_take(monkeypatch, cores: float):
    """Inject the reading: other processes took `cores` cores on average while a measurement ran."""
    start = time.perf_counter()
    others = lambda: cores * (time.perf_counter() - start)
    monkeypatch.setattr(cache, "busy_cpu_seconds", lambda: cache.own_cpu_seconds() + others())


def _slow(value: float, spread: float = 0.01):
    """A measurement long enough for CPU times to tell the load (llmc.cache.MIN_WINDOW_S)."""
    def measure():
        time.sleep(cache.MIN_WINDOW_S + 0.1)
        return roofline.Figure(value, spread)
    return measure


def test_a_bandwidth_measured_beside_busy_processes_is_used_once_and_not_cached(judged):
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        time.sleep(0.3)
        record = roofline.figure_record("bandwidth_gbps", 2, _slow(3.6))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert record["value"] == 3.6 and record["source"] == "measured"
    assert "other processes took" in record["not_cached"] and record["measured"]["other_cores"] > 0.5
    assert not judged.exists()


def test_an_injected_busy_reading_is_not_cached_and_a_quiet_one_is(monkeypatch, judged):
    _others_take(monkeypatch, 1.5)
    assert "not_cached" in roofline.figure_record("bandwidth_gbps", 2, _slow(3.6))
    assert not judged.exists()
    _others_take(monkeypatch, 0.0)
    quiet = roofline.figure_record("bandwidth_gbps", 2, _slow(20.0))
    assert "not_cached" not in quiet
    entry = json.loads(judged.read_text())[roofline.cache_key(2)]
    assert entry["bandwidth_gbps"] == 20.0 and entry["measured"]["bandwidth_gbps"]["other_cores"] == 0.0
    assert roofline.figure_record("bandwidth_gbps", 2, _slow(1.0))["source"] == "cache"


def test_samples_spread_too_wide_are_not_cached(monkeypatch, judged):
    _others_take(monkeypatch, 0.0)
    record = roofline.figure_record("gemm_peak_gflops", 1, _slow(50.0, spread=0.4))
    assert "spread 40%" in record["not_cached"] and not judged.exists()


def test_a_figure_cached_without_its_measured_record_is_measured_again(monkeypatch, judged):
    judged.parent.mkdir(parents=True)
    judged.write_text(json.dumps({roofline.cache_key(2): {"bandwidth_gbps": 3.6}}))   # an older llmc's, busy
    _others_take(monkeypatch, 0.0)
    assert roofline.machine_figure("bandwidth_gbps", 2, _slow(20.0)) == 20.0


def test_remeasure_ignores_and_refreshes_the_cache(monkeypatch, judged):
    _others_take(monkeypatch, 0.0)
    roofline.figure_record("bandwidth_gbps", 2, _slow(20.0))
    assert roofline.figure_record("bandwidth_gbps", 2, _slow(22.0), remeasure=True)["value"] == 22.0
    assert roofline.machine_figure("bandwidth_gbps", 2, _slow(1.0)) == 22.0


def test_busy_is_other_processes_beyond_the_cores_left_spare():
    record = {"cores": 4, "threads": 2, "other_cores": 2.4}
    assert cache.busy_reason(record) is None
    assert "2.6 of 4 cores" in cache.busy_reason({**record, "other_cores": 2.6})
    # no CPU times (a short window): the load average, which counts this process too
    assert cache.busy_reason({"cores": 2, "threads": 2, "other_cores": None, "loadavg": 2.4}) is None
    assert "load average" in cache.busy_reason({"cores": 2, "threads": 2, "other_cores": None, "loadavg": 4.0})


def test_pick_keeps_the_default_where_ranges_overlap():
    assert cache.pick({"cpu": (100, 140), "ort": (90, 130)}, ("cpu", "ort"))[0] == "cpu"
    assert cache.pick({"cpu": (100, 104), "ort": (90, 95)}, ("cpu", "ort")) == ("ort", None)
    # the fastest overlaps a later candidate only: it is still chosen over the default
    order = ("cpu", "walk", "graph")
    assert cache.pick({"cpu": (300, 310), "walk": (100, 130), "graph": (120, 125)}, order)[0] == "walk"
    assert cache.pick({"cpu": (300, 310), "walk": (130, 140), "graph": (120, 131)}, order)[0] == "walk"


def test_cache_info_shows_when_and_under_what_load_and_clear_removes_it(monkeypatch, judged, capsys):
    _others_take(monkeypatch, 0.25)
    roofline.figure_record("bandwidth_gbps", 2, _slow(20.0))
    code, out, _ = llmc_in_process(capsys, "cache", "info")
    assert code == 0 and str(judged.parent) in out
    assert "bandwidth.json" in out and "other processes at most 0.2" in out
    code, out, _ = llmc_in_process(capsys, "cache", "info", "--json")
    entries = {e["name"]: e for e in json.loads(out)["entries"]}
    assert entries["bandwidth.json"]["measured"][0]["threads"] == 2
    code, out, _ = llmc_in_process(capsys, "cache", "clear")
    assert code == 0 and "bandwidth.json" in out and not judged.exists()
    code, _, err = llmc_in_process(capsys, "cache", "clear", "weights")
    assert code == 2 and "no 'weights'" in err
