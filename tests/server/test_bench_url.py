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


def test_bench_needs_an_artifact_or_a_url_not_both(compiled, capsys):
    code, _, err = llmc_in_process(capsys, "bench", "-n", 1)
    assert code == 2 and "needs ARTIFACT" in error_line(err)
    code, _, err = llmc_in_process(capsys, "bench", compiled, "--url", "http://127.0.0.1:9")
    assert code == 2 and "give one of them" in error_line(err)
