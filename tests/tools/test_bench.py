"""The serving benchmark: workloads are reproducible, an engine run reports sane
throughput, latency and KV figures, the HF baseline runs the artifact's own weights, the
plot is a PNG, and `llmc bench --json` carries every figure it promises."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from llmc.cli import cli
from llmc.compiler.frontends import load_model
from llmc.errors import RuntimeLlmcError
from llmc.runtime.engine import Engine, EngineConfig
from llmc.tools.bench import (
    Workload,
    hf_model_from_artifact,
    median_run,
    run_engine,
    run_engine_repeated,
    run_hf_baseline,
)
from llmc.tools.bench_plot import plot_bench

VOCAB = 512


@pytest.fixture(scope="module")
def engine(artifact):
    return Engine(artifact, EngineConfig(kv_memory="4MiB"))


@pytest.fixture(scope="module")
def engine_run(engine):
    workload = Workload(8, input_len=16, output_len=6, input_spread=0.5, output_spread=0.5, seed=3)
    requests = workload.build(VOCAB)
    return requests, run_engine(engine, requests, progress=False)


def test_workload_is_reproducible_and_within_its_bounds():
    spec = dict(num_requests=40, input_len=50, output_len=20, input_spread=0.4, output_spread=0.5,
                prefix_len=16, qps=8.0)
    first, again = Workload(**spec, seed=1).build(VOCAB), Workload(**spec, seed=1).build(VOCAB)
    assert first == again
    assert first != Workload(**spec, seed=2).build(VOCAB)
    prefix = first[0]["prompt_token_ids"][:16]
    for r in first:
        ids = r["prompt_token_ids"]
        assert ids[:16] == prefix and all(0 <= t < VOCAB for t in ids)
        assert 30 <= len(ids) <= 70 and 10 <= r["max_tokens"] <= 30
    arrivals = [r["arrival"] for r in first]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert len({len(r["prompt_token_ids"]) for r in first}) > 5  # the spread is used
    assert {r["arrival"] for r in Workload(num_requests=5, qps=math.inf).build(VOCAB)} == {0.0}


@pytest.mark.parametrize("bad", [dict(num_requests=0), dict(input_spread=1.0), dict(qps=0.0)])
def test_workload_rejects_bad_settings(bad):
    with pytest.raises(RuntimeLlmcError, match="bench"):
        Workload(**bad)


def test_run_engine_reports_sane_numbers(engine, engine_run):
    requests, result = engine_run
    assert result.requests_per_s > 0 and result.output_tokens_per_s > 0
    assert sum(n for _, n in result.timeline) == sum(r["max_tokens"] for r in requests)
    assert result.output_tokens_per_s == pytest.approx(
        sum(r["max_tokens"] for r in requests) / result.total_seconds)
    assert len(result.ttft_s) == len(requests)
    assert len(result.itl_s) == sum(r["max_tokens"] - 1 for r in requests)
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        p = getattr(result, name)
        assert 0 < p["p50"] <= p["p95"] <= p["p99"], name
    assert 0 <= result.kv_waste < 1 and 0 < result.peak_kv_usage <= 1
    assert result.preemptions == 0 and 0 <= result.prefix_hit_rate <= 1
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_hf_model_from_artifact_reproduces_the_engine_logits(engine):
    model = hf_model_from_artifact(engine)
    ids = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        hf_logits = model(ids[None]).logits[0]
        source_logits = load_model("tiny-llama").module(ids[None]).logits[0]
    ours = engine.executor.run_values({"input_ids": ids, "positions": torch.arange(23),
                                       "logits_indices": torch.arange(23)})["logits"]
    torch.testing.assert_close(hf_logits, ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hf_logits, source_logits, atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeLlmcError, match="no parameter 'lm_head'"):
        engine.executor.weight("lm_head")


def test_hf_baseline_runs_the_workload(engine, engine_run):
    requests, _ = engine_run
    result = run_hf_baseline(hf_model_from_artifact(engine), requests, pad_id=0,
                             eos_token_ids=engine.eos_token_ids, batch_size=4, progress=False)
    assert result.requests_per_s > 0 and result.output_tokens_per_s > 0
    assert result.output_tokens_per_s == pytest.approx(
        sum(r["max_tokens"] for r in requests) / result.total_seconds)
    assert 0 < result.ttft_ms["p50"] <= result.ttft_ms["p99"]


def test_plot_bench_writes_a_png(engine_run, tmp_path):
    _, result = engine_run
    path = tmp_path / "bench.png"
    plot_bench(result, str(path), baseline=result)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_cli_bench_json_has_every_figure(artifact, tmp_path):
    plot = tmp_path / "x.png"
    res = CliRunner().invoke(cli, ["bench", str(artifact), "-n", "4", "--input-len", "8", "--output-len", "4",
                                   "--kv-memory", "4MiB", "--json", "--baseline", "hf", "--plot", str(plot)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert {"p50", "p95", "p99"} <= set(report[name]), name
        assert report[name]["p50"] <= report[name]["p95"] <= report[name]["p99"]
    assert report["requests_per_s"] > 0 and report["output_tokens_per_s"] > 0
    assert 0 <= report["kv_waste"] < 1 and 0 <= report["prefix_hit_rate"] <= 1
    assert report["preemptions"] == 0
    assert report["baseline"]["output_tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(
        report["output_tokens_per_s"] / report["baseline"]["output_tokens_per_s"])
    assert report["workload"]["num_requests"] == 4
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_repeated_runs_each_start_from_an_empty_prefix_cache(engine):
    requests = Workload(1, input_len=40, output_len=3, seed=4).build(VOCAB)
    again = [run_engine(engine, requests, progress=False) for _ in range(2)]
    assert again[1].prefix_hit_rate > 0      # run twice as it is, the second run finds the first's prompt
    runs = run_engine_repeated(engine, requests, 3, progress=False)
    assert runs[0].prefix_hit_rate > 0 and [r.prefix_hit_rate for r in runs[1:]] == [0.0, 0.0]
    assert len({json.dumps(r.token_ids, sort_keys=True) for r in runs}) == 1
    assert median_run(runs).output_tokens_per_s == sorted(r.output_tokens_per_s for r in runs)[1]


def test_cli_bench_repeat_reports_the_median_run_of_ours_and_of_the_baseline(artifact):
    res = CliRunner().invoke(cli, ["bench", str(artifact), "-n", "2", "--input-len", "8", "--output-len", "3",
                                   "--kv-memory", "4MiB", "--repeat", "3", "--baseline", "hf", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    ours, base = report["repeats"]["output_tokens_per_s"], report["repeats"]["baseline_output_tokens_per_s"]
    assert len(ours) == len(base) == 3
    assert report["output_tokens_per_s"] == sorted(ours)[1]
    assert report["baseline"]["output_tokens_per_s"] == sorted(base)[1]
    res = CliRunner().invoke(cli, ["bench", str(artifact), "-n", "1", "--input-len", "8", "--output-len", "3",
                                   "--kv-memory", "4MiB", "--repeat", "2"])
    assert res.exit_code == 0 and "repeats           2 runs, the median shown" in res.stdout


def test_cli_bench_repeat_runs_another_artifact_baseline_as_often_and_refuses_speculation(artifact, capsys):
    from llmc.cli import main

    res = CliRunner().invoke(cli, ["bench", str(artifact), "-n", "1", "--input-len", "8", "--output-len", "3",
                                   "--kv-memory", "4MiB", "--repeat", "2", "--baseline", str(artifact), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert len(report["repeats"]["baseline_output_tokens_per_s"]) == 2
    assert report["baseline"]["output_tokens_per_s"] == max(report["repeats"]["baseline_output_tokens_per_s"])
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(artifact), "-n", "1", "--kv-memory", "4MiB", "--repeat", "2", "--speculative", "ngram"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--repeat does not combine with --speculative" in err and len(err.strip().splitlines()) == 1


def test_cli_bench_table(artifact):
    res = CliRunner().invoke(cli, ["bench", str(artifact), "-n", "2", "--input-len", "8", "--output-len", "3",
                                   "--kv-memory", "4MiB"])
    assert res.exit_code == 0, res.output
    assert "output tokens/s" in res.stdout and "preemptions 0" in res.stdout


def test_cli_bench_bad_qps_is_a_one_line_error(artifact, capsys):
    from llmc.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(artifact), "-n", "1", "--qps", "fast", "--kv-memory", "4MiB"])
    assert exit_info.value.code == 2
    assert "--qps 'fast' is not a number" in capsys.readouterr().err


def test_percentiles_are_ordered_on_skewed_samples():
    from llmc.runtime.metrics import percentiles
    samples = np.random.default_rng(5).lognormal(size=200).tolist()
    p = percentiles(samples, 1e3)
    assert p["p50"] <= p["p95"] <= p["p99"] <= max(samples) * 1e3
    assert p["p50"] == pytest.approx(float(np.median(samples)) * 1e3)
    assert percentiles([])["p50"] is None


def test_cli_bench_a_quantised_build_against_its_fp32_build_and_hf(artifact, tmp_path):
    """A quantised build is benchmarked against its fp32 build on the same workload, in one run;
    against HF, the baseline runs its weights dequantised to fp32 and says so."""
    import llmc
    int8 = llmc.compile("tiny-llama", output=tmp_path / "int8.llmc", quant="int8")
    args = ["bench", str(int8), "-n", "3", "--input-len", "8", "--output-len", "4", "--kv-memory", "4MiB"]
    res = CliRunner().invoke(cli, args + ["--json", "--baseline", str(artifact)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["baseline"]["name"] == str(artifact) and report["baseline"]["output_tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(
        report["output_tokens_per_s"] / report["baseline"]["output_tokens_per_s"])
    res = CliRunner().invoke(cli, args + ["--baseline", str(artifact)])
    assert res.exit_code == 0 and "ours / baseline" in res.stdout
    res = CliRunner().invoke(cli, args + ["--baseline", "hf"])
    assert res.exit_code == 0 and "baseline          hf (fp32, dequantised int8 weights)" in res.stdout


def test_hf_baseline_finds_quantised_linears_inside_onnx_runtime_segments(tmp_path):
    """`--kernels ort` (and `auto` where it picks ORT) folds the quantised linears into ort.segment
    steps: the baseline still dequantises every one of them."""
    import llmc
    from llmc.codegen.plan import Plan
    from llmc.tools.hf_baseline import baseline_name, dequantised_weights

    path = llmc.compile("tiny-llama", output=tmp_path / "int8-ort.llmc", quant="int8", kernels="ort")
    plan = Plan.from_json((path / "plan.json").read_text())
    assert {s.kernel for s in plan.steps} >= {"ort.segment"}
    from safetensors.torch import load_file
    stored = load_file(path / "weights.safetensors")
    weights, replaced = dequantised_weights(plan, stored.__getitem__)
    quantised = {n.removesuffix(".qweight") for n in plan.params if n.endswith(".qweight")}
    assert set(weights) == quantised and quantised
    assert baseline_name(plan) == "hf (fp32, dequantised int8 weights)"


def test_hf_baseline_rebuilds_a_pruned_and_fused_artifact(tmp_path):
    """Layer, head and FFN pruning change the shapes the source HF config states, and layer
    pruning leaves gaps in the layer numbers: the baseline rebuilds the pruned model as compiled."""
    import llmc
    path = llmc.compile("tiny-llama", output=tmp_path / "pruned.llmc", prune="layers:1,heads:0.5,ffn:0.25",
                        calib_samples=2, calib_seq_len=24)
    engine = Engine(path, EngineConfig(kv_memory="4MiB"))
    assert engine.model["num_layers"] == 1
    model = hf_model_from_artifact(engine)
    assert model.config.num_hidden_layers == 1 and model.config.num_key_value_heads == engine.model["num_kv_heads"]
    ids = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        hf_logits = model(ids[None]).logits[0]
    ours = engine.executor.run_values({"input_ids": ids, "positions": torch.arange(17),
                                       "logits_indices": torch.arange(17)})["logits"]
    torch.testing.assert_close(hf_logits, ours, atol=1e-5, rtol=1e-5)
