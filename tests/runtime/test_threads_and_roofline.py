"""Thread control and the bench roofline: the thread count comes from --threads / threads=, else
LLMC_NUM_THREADS, else the physical cores, bad counts fail before anything loads, the engine
applies the count to torch; `llmc bench` reports decode weight-read GB/s and GEMM GFLOP/s whose
arithmetic checks out against the manifest and the run, and the machine's peaks are measured
once and cached."""

import json
import os

import psutil
import pytest
import torch
from click.testing import CliRunner

import llmc
from llmc.cli import cli, main
from llmc.errors import LlmcError
from llmc.runtime import roofline
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.threads import ENV_VAR, current_threads, resolve_threads

CPUS = os.cpu_count()


@pytest.fixture(autouse=True)
def restore_torch_threads(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_the_physical_cores_within_the_affinity_mask():
    expected = min(psutil.cpu_count(logical=False) or CPUS, len(os.sched_getaffinity(0)))
    assert resolve_threads() == expected


def test_flag_wins_over_the_environment_which_wins_over_the_default(monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(CPUS))
    assert resolve_threads() == CPUS
    assert resolve_threads(1) == 1 and resolve_threads("1") == 1


@pytest.mark.parametrize("bad", [0, -1, CPUS + 1, 1.5, True, "two", "1.0", ""])
def test_bad_counts_name_the_value_and_the_range(bad):
    with pytest.raises(LlmcError, match=f"from 1 to {CPUS}"):
        resolve_threads(bad)


@pytest.mark.parametrize("bad", ["0", str(CPUS + 1), "x"])
def test_a_bad_environment_value_is_named(monkeypatch, bad):
    monkeypatch.setenv(ENV_VAR, bad)
    with pytest.raises(LlmcError, match=f"{ENV_VAR}='{bad}'.*from 1 to {CPUS}"):
        resolve_threads()


def test_python_load_refuses_a_bad_count_before_reading_the_artifact(tmp_path):
    with pytest.raises(LlmcError, match=r"threads=0: .*from 1 to"):
        llmc.load(tmp_path / "no-such-artifact", threads=0)


@pytest.mark.parametrize("command", [["run", "-p", "hi"], ["chat"], ["bench"], ["eval"]])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_cli_refuses_a_bad_count_in_one_line_before_loading(command, how, tmp_path, monkeypatch, capsys):
    # the artifact does not exist: the thread count is checked first
    args = [command[0], str(tmp_path / "missing.llmc"), *command[1:]]
    if how == "flag":
        args += ["--threads", "0"]
    else:
        monkeypatch.setenv(ENV_VAR, "0")
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert ("--threads 0" if how == "flag" else f"{ENV_VAR}='0'") in err and f"from 1 to {CPUS}" in err


def test_the_engine_applies_its_count_to_torch(artifact):
    for n in sorted({1, CPUS}):
        engine = Engine(artifact, EngineConfig(kv_memory="1MiB", threads=n))
        assert engine.config.threads == n
        assert torch.get_num_threads() == n and current_threads() == n


def _bench_json(artifact, *extra) -> dict:
    args = ["bench", str(artifact), "-n", "1", "--input-len", "12", "--output-len", "24", "--kv-memory", "1MiB",
            "--no-prefix-caching", "--json", *extra]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_bench_roofline_arithmetic(artifact, tmp_path):
    out = _bench_json(artifact, "--bandwidth", "10", "--gemm-peak", "50", "--threads", "1")
    r = out["roofline"]
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert r["weight_bytes"] == sum(manifest["report"]["weight_bytes"].values())
    assert out["threads"] == r["threads"] == 1
    # batch 1: every step after the prefill is one decode step making one token
    assert r["decode_tokens_per_step"] == 1
    assert r["achieved_gbps"] == pytest.approx(r["weight_bytes"] * r["decode_steps_per_s"] / 1e9)
    assert r["fraction"] == pytest.approx(r["achieved_gbps"] / 10)
    assert r["gemm_fraction"] == pytest.approx(r["achieved_gflops"] / 50)
    # a decode step's wall time is most of a token's: steps/s is at least 1/TPOT, and not far above
    per_token_steps = 1000 / out["tpot_ms"]["p50"]
    assert per_token_steps * 0.99 <= r["decode_steps_per_s"] <= per_token_steps * 3
    # GEMM FLOPs: every projection weight per token run, the LM head per sampled token
    shapes = {n: t["shape"] for n, t in json.loads((artifact / "plan.json").read_text())["types"].items()}
    per_token = sum(s[0] * s[1] for n, s in shapes.items() if n.endswith("_proj.weight"))
    flops = 2 * (per_token * (12 + 23) + shapes["lm_head.weight"][0] * shapes["lm_head.weight"][1] * 24)
    assert flops / out["total_seconds"] / 1e9 <= r["achieved_gflops"] <= flops / out["total_seconds"] / 1e9 * 3
    assert not (tmp_path / "cache" / "bandwidth.json").exists()   # both figures were given


def test_bench_text_shows_threads_and_roofline(artifact):
    args = ["bench", str(artifact), "-n", "1", "--input-len", "8", "--output-len", "8", "--kv-memory", "1MiB",
            "--bandwidth", "20", "--gemm-peak", "40", "--threads", "1"]
    text = CliRunner().invoke(cli, args, catch_exceptions=False).output
    assert "threads           1" in text
    assert "MiB/token" in text and "of 20.0 GB/s" in text
    from llmc.codegen.native import cpu_native
    if cpu_native.available():   # and where the GEMVs round activations, it says so
        assert f"native kernels    {cpu_native.status()}" in text
        assert ("int16 activations" in text) == cpu_native.int16_activations()


def test_peaks_are_measured_once_and_cached_per_cpu_and_thread_count(tmp_path):
    measured = roofline.machine_figure("bandwidth_gbps", 1, lambda: roofline.measure_bandwidth(1 << 20, repeats=2))
    assert measured > 0
    path = tmp_path / "cache" / "bandwidth.json"
    key = roofline.cache_key(1)
    assert json.loads(path.read_text())[key]["bandwidth_gbps"] == measured

    def never():
        raise AssertionError("measured again")

    assert roofline.machine_figure("bandwidth_gbps", 1, never) == measured
    assert roofline.machine_figure("gemm_peak_gflops", 1, lambda: roofline.measure_gemm_peak(64, repeats=2)) > 0
    assert roofline.machine_figure("bandwidth_gbps", 2, lambda: 7.0) == 7.0   # another thread count: its own entry
    cache = json.loads(path.read_text())
    assert set(cache[key]) == {"bandwidth_gbps", "gemm_peak_gflops", "measured"} and len(cache) == 2
    assert set(cache[key]["measured"]) == {"bandwidth_gbps", "gemm_peak_gflops"}


def test_bench_reads_the_cached_peaks(artifact, tmp_path):
    path = tmp_path / "cache" / "bandwidth.json"
    path.parent.mkdir(parents=True)
    measured = {"at": "2026-01-01T00:00:00Z", "other_cores": 0.0, "cores": 2, "threads": 1, "spread": 0.01}
    path.write_text(json.dumps({roofline.cache_key(1): {"bandwidth_gbps": 12.5, "gemm_peak_gflops": 33.0, "measured": {
        "bandwidth_gbps": measured, "gemm_peak_gflops": measured}}}))
    r = _bench_json(artifact, "--threads", "1")["roofline"]
    assert (r["bandwidth_gbps"], r["gemm_peak_gflops"]) == (12.5, 33.0)


def test_gemm_count_sees_the_linears_inside_onnx_runtime_segments(tmp_path):
    # an ort plan holds its projections inside segments: the GEMM figure must count them as a torch plan's
    from llmc.codegen.plan import Plan
    plans = {k: Plan.from_dict(json.loads((llmc.compile("tiny-llama", output=tmp_path / f"{k}.llmc", kernels=k,
                                                        quiet=True) / "plan.json").read_text()))
             for k in ("cpu", "ort")}
    assert any(s.inner_steps() for s in plans["ort"].steps)
    assert roofline.gemm_weights(plans["ort"]) == roofline.gemm_weights(plans["cpu"])
    assert roofline.gemm_weights(plans["cpu"])[0] > 0


def test_the_bandwidth_probe_is_larger_than_the_last_level_cache(monkeypatch, tmp_path):
    """A probe inside the cache measures the cache: the buffer is 4x the largest cache (sysfs), at least 512 MiB."""
    llc = roofline.last_level_cache_bytes()
    assert roofline.probe_bytes() >= max(roofline.BANDWIDTH_BYTES, 4 * llc)
    assert f"probe {roofline.probe_bytes() >> 20} MiB" in roofline.cache_key(2)
    fake = tmp_path / "cpu0" / "cache"
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (fake / index).mkdir(parents=True)
        (fake / index / "size").write_text(size + "\n")
    real_path = roofline.Path
    moved = lambda p: real_path(str(p).replace("/sys/devices/system/cpu/cpu0", str(tmp_path / "cpu0")))
    monkeypatch.setattr(roofline, "Path", moved)
    assert roofline.last_level_cache_bytes() == 480 << 20
    assert roofline.probe_bytes() == 4 * (480 << 20)
