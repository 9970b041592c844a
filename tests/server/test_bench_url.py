"""`llmc bench --url` drives a running server with the bench workload: every request arrives and
makes its full length, and the report has the offline bench's latency figures."""

import json

from conftest import API_KEY, KV_MEMORY, InProcessServer
from llmc_cli import error_line, llmc_in_process

import llmc


def test_bench_url_sends_the_whole_workload_and_reports_latencies(compiled, capsys):
    llm = llmc.load(compiled, kv_memory=KV_MEMORY, threads=1)
    with InProcessServer(llm) as served:
        code, out, err = llmc_in_process(capsys, "bench", "--url", served.url, "--api-key", API_KEY, "-n", 12,
                                         "--input-len", 10, "--output-len", 5, "--qps", 50, "--json")
        assert code == 0, err
        result = json.loads(out)
        assert result["output_tokens"] == 12 * 5
        assert served.metric("llmc:generation_tokens_total") == 12 * 5
        assert served.metric("llmc:request_success_total", finished_reason="length") == 12
    assert result["model"] == "tiny" and result["workload"]["qps"] == "50"
    for figure in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < result[figure]["p50"] <= result[figure]["p99"]


def test_bench_url_reports_long_and_short_requests_apart(compiled, capsys):
    llm = llmc.load(compiled, kv_memory=KV_MEMORY, threads=1)
    with InProcessServer(llm) as served:
        code, out, err = llmc_in_process(capsys, "bench", "--url", served.url, "--api-key", API_KEY, "-n", 12,
                                         "--input-len", 8, "--long-input-len", 200, "--long-fraction", 0.25,
                                         "--output-len", 4, "--qps", 40, "--json")
        assert code == 0, err
        result = json.loads(out)
        served_prompt_tokens = served.metric("llmc:prompt_tokens_total")
    classes = result["classes"]
    assert classes["long"]["requests"] + classes["short"]["requests"] == 12 and classes["long"]["requests"] >= 1
    # the server saw exactly the prompts the classes say: 200 tokens a long one, 8 a short one
    assert served_prompt_tokens == 200 * classes["long"]["requests"] + 8 * classes["short"]["requests"]
    for c in classes.values():
        assert 0 < c["ttft_ms"]["p50"] <= c["ttft_ms"]["p99"] and 0 < c["tpot_ms"]["p50"] <= c["tpot_ms"]["p99"]


def test_a_mixed_workload_needs_both_options(compiled, capsys):
    code, _, err = llmc_in_process(capsys, "bench", "--url", "http://127.0.0.1:9", "--long-fraction", 0.5)
    assert code == 2 and "--long-fraction (in [0, 1]) and --long-input-len go together" in error_line(err)


def test_bench_needs_an_artifact_or_a_url_not_both(compiled, capsys):
    code, _, err = llmc_in_process(capsys, "bench", "-n", 1)
    assert code == 2 and "needs ARTIFACT" in error_line(err)
    code, _, err = llmc_in_process(capsys, "bench", compiled, "--url", "http://127.0.0.1:9")
    assert code == 2 and "give one of them" in error_line(err)
