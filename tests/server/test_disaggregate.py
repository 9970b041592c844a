"""`llmc serve --disaggregate prefill:P,decode:D`: a router and engine processes joined over gloo, queried
with the openai client. Outputs equal one engine's (greedy, seeded, streamed, under preemption on the
decode engine, with speculation there), each handoff reports its KV bytes, the prefill engine's prefix
cache serves repeated prompts, aborted requests leave no KV block held on either engine, and an engine
that exits or hangs ends its requests with an error within a bounded time rather than a hang."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
from conftest import API_KEY, Served, free_port, start_serve, stop_serve, wait_healthy
from llmc_cli import error_line, llmc_in_process

from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.disaggregate.group import Roles
from llmc.runtime.server.disaggregate.metrics import DisaggregateMetrics
from llmc.runtime.server.disaggregate.router import Router
from llmc.runtime.server.engine_loop import Job
from llmc.runtime.server.protocol import ApiError
from llmc.runtime.structured_output import StructuredOutputsParams
from llmc.tools.bench_http import format_http_bench

BLOCK_BYTES = 16 * 512   # tiny-llama: 512 KV bytes a token, 16 tokens a block
KV = "256KiB"            # 32 blocks an engine: a few long decodes at once preempt on the decode engine
PROMPT = "Once upon a time"


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    return [3 + (salt * 7919 + i * 131) % 500 for i in range(n)]


@pytest.fixture(scope="module")
def split(compiled):
    served = start_serve(compiled, "--disaggregate", "prefill:1,decode:1", "--kv-memory", KV)
    yield served
    stop_serve(served)


def engines(served: Served) -> list[str]:
    return sorted(dict(labels)["engine"] for (name, labels) in served.metrics() if name == "llmc:engine_up")


def wait_for(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def all_blocks_free(served: Served) -> bool:
    return all(served.metric("llmc:engine_kv_free_blocks", engine=e) == served.metric("llmc:engine_kv_blocks", engine=e)
               > 0 for e in engines(served))


def test_greedy_outputs_equal_one_engines_streamed_whole_and_under_preemption(split, offline):
    preempted = split.metric("llmc:num_preemptions_total")
    prompts = [prompt_ids(40 + 30 * i, i) for i in range(6)]
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))

    def complete(p):
        return split.client.completions.create(model="tiny", prompt=p, max_tokens=120, temperature=0,
                                               extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(6) as pool:   # 6 x up to 17 blocks: more than the decode engine's 32
        replies = list(pool.map(complete, prompts))
    assert [r.choices[0].text for r in replies] == [e.outputs[0].text for e in expected]
    assert all(r.usage.completion_tokens == 120 for r in replies)
    wait_for(lambda: split.metric("llmc:num_preemptions_total") > preempted, "a preemption on the decode engine")

    chat = [{"role": "user", "content": "Hi there"}]
    reference = offline.chat(chat, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    chunks = split.client.chat.completions.create(model="tiny", messages=chat, max_tokens=12, temperature=0,
                                                  stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference


def test_seeded_samples_logprobs_and_grammars_carry_over_the_handoff_and_n2_runs_whole(split, offline):
    regex = r"[0-9]{2}:[0-9]{2}"
    reply = split.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=5,
                                            extra_body={"guided_regex": regex})
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                                                       structured_outputs=StructuredOutputsParams(regex=regex)))
    assert reply.choices[0].text == expected[0].outputs[0].text and re.fullmatch(regex, reply.choices[0].text)
    for n in (1, 2):
        ask = dict(model="tiny", prompt=PROMPT, max_tokens=10, n=n, logprobs=2, seed=7, temperature=1.0)
        reply = split.client.completions.create(**ask)
        expected = offline.generate(PROMPT, SamplingParams(max_tokens=10, n=n, logprobs=2, seed=7, temperature=1.0))
        assert [c.text for c in reply.choices] == [o.text for o in expected[0].outputs]
        for choice, out in zip(reply.choices, expected[0].outputs):
            assert choice.logprobs.token_logprobs == pytest.approx(
                [step[t].logprob for t, step in zip(out.token_ids, out.logprobs)], abs=1e-5)


def test_each_handoff_reports_its_kv_bytes_and_transfer_time(split):
    before = split.metrics()
    split.client.completions.create(model="tiny", prompt=prompt_ids(40, 99), max_tokens=4, temperature=0)
    after = split.metrics()

    def grew(name):
        key = (name, (("model_name", "tiny"),))
        return after.get(key, 0.0) - before.get(key, 0.0)
    assert grew("llmc:kv_transfer_request_bytes_count") == 1 == grew("llmc:kv_transfer_seconds_count")
    assert grew("llmc:kv_transfer_bytes_total") == 3 * BLOCK_BYTES   # 40 prompt tokens: 3 blocks
    assert 0 < grew("llmc:kv_transfer_seconds_sum") < 5


def test_bench_url_reports_kv_transfer_percentiles_per_request(split, capfd):
    code, out, _ = llmc_in_process(capfd, "bench", "--url", split.url, "--api-key", API_KEY, "-n", 3,
                                   "--input-len", 40, "--output-len", 3, "--json")
    assert code == 0
    t = json.loads(out)["kv_transfer"]
    assert t["requests"] == 3 and t["bytes"]["mean"] == 3 * BLOCK_BYTES   # each 40 tokens: 3 blocks
    # interpolated within the bucket that holds 24 KiB (2^14.5 .. 2^15 bytes)
    assert 2 ** 14.5 <= t["bytes"]["p50"] <= t["bytes"]["p95"] <= t["bytes"]["p99"] <= 2 ** 15
    assert 0 < t["ms"]["p50"] <= t["ms"]["p99"] < 5e3
    assert "KV transfer       3 requests" in format_http_bench(json.loads(out))


def test_a_repeated_prompt_hits_both_prefix_caches_and_sends_only_the_blocks_decode_lacks(split):
    prompt = prompt_ids(100, 77)   # 6 full blocks and one of 4 tokens
    sent = split.metric("llmc:kv_transfer_bytes_total")
    first = split.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert split.metric("llmc:kv_transfer_bytes_total") == sent + 7 * BLOCK_BYTES
    wait_for(lambda: split.metric("llmc:engine_requests", engine="prefill-0") == 0, "the prefill engine's report")
    hits = split.metric("llmc:prefix_cache_hits_total")
    again = split.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    wait_for(lambda: split.metric("llmc:prefix_cache_hits_total") >= hits + 96, "96 prefix-cache hits (6 blocks)")
    # the decode engine kept the first one's 6 full blocks cached: only the partial one travels
    assert split.metric("llmc:kv_transfer_bytes_total") == sent + 8 * BLOCK_BYTES


def test_a_prefix_the_decode_engine_evicted_is_sent_after_its_answer(split):
    """The router expects the decode engine to hold a prompt's prefix it was sent before and the prefill
    engine sends only the blocks after it at once; the decode engine evicted them meanwhile, says so,
    and they follow."""
    prompt = prompt_ids(100, 55)   # 6 full blocks and one of 4 tokens
    first = split.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    for salt in range(4):   # 4 x 10 blocks through the decode engine's 32: the 6 cached ones are evicted
        split.client.completions.create(model="tiny", prompt=prompt_ids(150, 60 + salt), max_tokens=2)
    wait_for(lambda: split.metric("llmc:engine_requests", engine="decode-0") == 0, "the decode engine's report")
    sent = split.metric("llmc:kv_transfer_bytes_total")
    again = split.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    wait_for(lambda: split.metric("llmc:kv_transfer_bytes_total") > sent, "the transfer's report")
    assert split.metric("llmc:kv_transfer_bytes_total") == sent + 7 * BLOCK_BYTES


def test_aborted_requests_free_every_kv_block_on_both_engines(split):
    wait_for(lambda: all_blocks_free(split), "both engines' blocks free before")
    aborted = split.metric("llmc:request_success_total", finished_reason="abort")
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def leave_after(chunks: int, salt: int) -> None:
        body = {"model": "tiny", "prompt": prompt_ids(60 + 40 * salt, salt), "max_tokens": 300,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{split.url}/v1/completions", json=body, headers=headers, timeout=30) as reply:
            lines = reply.iter_lines()
            for _ in range(chunks):
                assert next(lines).startswith("data: ")
                next(lines)   # the blank line after each event

    def leave_before_the_first_token(salt: int) -> None:
        body = {"model": "tiny", "prompt": prompt_ids(400, salt), "max_tokens": 50}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{split.url}/v1/completions", json=body, headers=headers, timeout=0.02)
    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(leave_after, 1 + i % 3, i) for i in range(6)]
        jobs += [pool.submit(leave_before_the_first_token, 10 + i) for i in range(2)]
        for job in jobs:
            job.result()
    split.wait_metric("llmc:num_requests_running", 0)
    # the streams that had a token were in an engine (the others may have left while queued, uncounted)
    assert split.metric("llmc:request_success_total", finished_reason="abort") >= aborted + 6
    wait_for(lambda: all_blocks_free(split), "both engines' blocks free after the aborts")


def test_bad_disaggregate_values_are_one_line_errors(compiled, capfd):
    for value, says in (("prefill:0,decode:1", "prefill needs a whole number of engines >= 1"),
                        ("prefill:1,encode:1", "unknown role 'encode'"), ("prefill:1", "no decode engines"),
                        ("prefill:1,prefill:2", "prefill is given twice")):
        code, _, err = llmc_in_process(capfd, "serve", compiled, "--port", free_port(), "--disaggregate", value)
        assert code == 2 and says in error_line(err), err
    code, _, err = llmc_in_process(capfd, "serve", compiled, "--port", free_port(), "--disaggregate",
                                   "prefill:1,decode:1", "--semantic-cache-threshold", "0.9")
    assert code == 2 and error_line(err).startswith("--semantic-cache-threshold does not combine with "
                                                    "--disaggregate: its embeddings are the served model's")


def test_ttft_slo_refuses_what_the_least_loaded_prefill_engine_would_start_late():
    roles = Roles(2, 1)
    router = Router(roles, None, DisaggregateMetrics("tiny", roles), max_queue=8, max_num_seqs=4, ttft_slo_ms=100)

    def job(tokens: int) -> Job:
        return Job(f"r{tokens}", "u", 0, None, list(range(tokens)), SamplingParams(max_tokens=1), 2048, loop=None)
    router.submit(job(50))   # nothing measured yet: taken
    for rank in roles.prefill_ranks:   # 1 ms a prompt token, 10 ms a step
        router._on_stats(rank, {"free_blocks": 8, "blocks": 8, "running": 0, "waiting": 0,
                                "seconds_per_token": 1e-3, "step_seconds": 0.01})
    router.submit(job(60))   # half the 50 queued, then its own 60: 85 ms + 10 ms
    with pytest.raises(ApiError) as late:
        router.submit(job(40))   # half the 110 queued, then 40: 105 ms
    assert late.value.status == 429 and "105 ms, is over --ttft-slo-ms 100" in late.value.message
    assert late.value.headers == {"Retry-After": "1"}


class Unheard(Job):
    def deliver(self, update) -> None:
        pass   # no client


def routed_to(router: Router, tokens: list[int], rid: str) -> tuple[int, int]:
    """Submit a greedy request for `tokens` and route it (as the router thread would); its engines."""
    router.submit(Unheard(rid, "u", 0, None, tokens, SamplingParams(max_tokens=1), 2048, loop=None))
    with router._cond:
        router._route_queued()
    r = router._routed[rid]
    return r.prefill, r.decode


def test_prefix_affinity_routes_a_shared_prefix_to_its_holder_unless_that_one_is_overloaded():
    roles = Roles(2, 2)   # prefill ranks 1, 2; decode ranks 3, 4
    router = Router(roles, None, DisaggregateMetrics("tiny", roles), max_queue=64, max_num_seqs=16)
    shared = prompt_ids(100, 1)   # 6 full blocks
    assert routed_to(router, shared, "a") == (1, 3)      # all idle: the first of each role
    assert routed_to(router, prompt_ids(20, 2), "x") == (2, 4)   # the least loaded
    # the same 6 blocks and a new tail: to their holders, though both roles' loads tie or favour the others
    router._load[4] -= 1
    assert routed_to(router, shared + prompt_ids(30, 3), "b") == (1, 3)

    def hits(role):
        return router.metrics.registry.get_sample_value("llmc:prefix_affinity_hits_total",
                                                        {"model_name": "tiny", "role": role})
    assert hits("prefill") == hits("decode") == 1
    # decode-0 now runs more than max_num_seqs / 8 = 2 requests beyond decode-1; prefill-0 has 230 prompt
    # tokens in prefill against prefill-1's 20: more than the 96 its cache saves
    router._load[3] += 3
    assert routed_to(router, shared, "c") == (2, 4)
    assert router.metrics.registry.get_sample_value("llmc:prefix_affinity_overloaded_total",
                                                    {"model_name": "tiny", "role": "prefill"}) == 1
    # now both decode engines hold it: the less loaded of them, a hit
    assert routed_to(router, shared, "d")[1] == 4 and hits("decode") == 2
    # a gone engine holds nothing
    router._engine_gone(4, "exited")
    assert routed_to(router, shared, "e")[1] == 3


def test_a_repeated_long_prefix_lands_on_the_engines_that_hold_it_and_moves_one_block(compiled):
    served = start_serve(compiled, "--disaggregate", "prefill:2,decode:2", "--kv-memory", "1MiB")
    try:
        def stream(salt: int):
            chunks = served.client.completions.create(model="tiny", prompt=prompt_ids(5, salt), max_tokens=400,
                                                      stream=True, extra_body={"ignore_eos": True})
            next(iter(chunks))
            return chunks
        shared = prompt_ids(100, 77)   # 6 full blocks and one of 4 tokens
        sent = served.metric("llmc:kv_transfer_bytes_total")
        x = stream(1)   # decoding on decode-0 while the rest runs (its 400 tokens take longer)
        first = served.client.completions.create(model="tiny", prompt=shared, max_tokens=8, temperature=0)
        y = stream(2)   # on decode-1, which took `first` as the idler: least-loaded alone would now pick decode-0
        again = served.client.completions.create(model="tiny", prompt=shared, max_tokens=8, temperature=0)
        assert again.choices[0].text == first.choices[0].text
        # x and y 1 block each, `first` 7; `again` went to decode-1, which holds the 6 full blocks: 1 (not 7)
        wait_for(lambda: served.metric("llmc:kv_transfer_bytes_total") >= sent + 10 * BLOCK_BYTES, "4 transfers")
        assert served.metric("llmc:kv_transfer_bytes_total") == sent + 10 * BLOCK_BYTES
        assert served.metric("llmc:prefix_affinity_hits_total", role="decode") == 1
        assert served.metric("llmc:prefix_affinity_hits_total", role="prefill") == 1
        x.close()
        y.close()
        wait_for(lambda: all_blocks_free(served), "every engine's blocks free after the streams left")
    finally:
        stop_serve(served)


HUNG_S = 3   # LLMC_COLLECTIVE_TIMEOUT in the tests below: an engine silent this long is taken for hung


def engine_process(served: Served, rank: int) -> psutil.Process:
    return next(p for p in psutil.Process(served.proc.pid).children() if f"--rank={rank}" in p.cmdline())


def test_speculating_decode_engine_and_a_hung_one_ends_its_requests_within_the_deadline(compiled, offline,
                                                                                        monkeypatch):
    monkeypatch.setenv("LLMC_COLLECTIVE_TIMEOUT", str(HUNG_S))
    served = start_serve(compiled, "--disaggregate", "prefill:1,decode:1", "--kv-memory", KV,
                         "--speculative", "ngram", "--ttft-slo-ms", 60_000)   # an SLO no request here misses
    try:
        # tiny-llama's 200 greedy tokens after PROMPT repeat themselves enough for n-gram drafts
        reply = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, temperature=0,
                                                 extra_body={"ignore_eos": True})
        expected = offline.generate(PROMPT, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        assert reply.choices[0].text == expected[0].outputs[0].text
        wait_for(lambda: served.metric("llmc:spec_decode_num_drafts_total") > 0, "the decode engine's drafts")

        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(served.client.completions.create, model="tiny", prompt=prompt_ids(30, 5),
                                max_tokens=400, extra_body={"ignore_eos": True})
            stream = iter(served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, stream=True,
                                                           extra_body={"ignore_eos": True}))
            next(stream)
            decode = engine_process(served, 2)
            decode.suspend()   # alive, answering nothing
            started = time.monotonic()
            with pytest.raises(openai.APIError, match=f"decode-0 \\(rank 2\\) sent nothing for {HUNG_S} s"):
                for _ in stream:
                    pass
            with pytest.raises(openai.InternalServerError, match="sent nothing"):
                whole.result()
        assert time.monotonic() - started < HUNG_S + 5
        decode.wait(timeout=10)   # the router killed it
        assert served.metric("llmc:engine_up", engine="decode-0") == 0
        assert httpx.get(f"{served.url}/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
        assert refused.value.status_code == 503 and "no decode engine" in refused.value.message
        wait_for(lambda: served.metric("llmc:engine_kv_free_blocks", engine="prefill-0")
                 == served.metric("llmc:engine_kv_blocks", engine="prefill-0") > 0, "the prefill engine's blocks free")
    finally:
        stop_serve(served)


def start_ranks(artifact, roles: str, world: int) -> tuple[Served, list[subprocess.Popen]]:
    """Every rank of a disaggregated server started apart, as torchrun starts them (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT: the cross-machine path, on one machine); rank 0 serves, once healthy."""
    port, rendezvous = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "llmc.runtime.server.disaggregate", str(artifact),
                               "--disaggregate", roles, "--port", str(port), "--kv-memory", KV,
                               "--served-model-name", "tiny", "--api-key", API_KEY],
                              env={**os.environ, "LLMC_COLLECTIVE_TIMEOUT": str(HUNG_S), "RANK": str(r),
                                   "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(rendezvous)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                              text=True)
             for r in range(world)]
    try:
        wait_healthy(f"http://127.0.0.1:{port}", procs[0])
    except BaseException:
        stop_ranks(procs)
        raise
    return Served(f"http://127.0.0.1:{port}", "tiny", procs[0]), procs


def stop_ranks(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_torchrun_ranks_serve_and_an_engine_that_hangs_or_exits_ends_its_requests_with_an_error(compiled, offline):
    """Under torchrun the router cannot kill a hung engine: the prefill engine drops the KV it holds for it."""
    served, procs = start_ranks(compiled, "prefill:1,decode:2", 4)
    try:
        shared = prompt_ids(100, 3)
        reply = served.client.completions.create(model="tiny", prompt=shared, max_tokens=12, temperature=0)
        expected = offline.generate({"prompt_token_ids": shared}, SamplingParams(max_tokens=12, temperature=0))
        assert reply.choices[0].text == expected[0].outputs[0].text   # decode-0 (both idle) holds its prefix now

        stream = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=480, stream=True,
                                                  extra_body={"ignore_eos": True})
        next(iter(stream))
        procs[2].send_signal(signal.SIGSTOP)   # with both idle, the router picked the first decode engine
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:   # by prefix affinity to decode-0 too: their KV waits for it
            stuck = [pool.submit(served.client.completions.create, model="tiny", prompt=shared, max_tokens=5)
                     for _ in range(2)]
            with pytest.raises(openai.APIError, match=f"sent nothing for {HUNG_S} s"):
                for _ in stream:
                    pass
            for job in stuck:
                with pytest.raises(openai.InternalServerError, match="decode-0 \\(rank 2\\) sent nothing"):
                    job.result()
        assert time.monotonic() - started < HUNG_S + 5
        assert served.metric("llmc:engine_up", engine="decode-0") == 0
        wait_for(lambda: served.metric("llmc:kv_transfer_dropped_total") >= 1, "the prefill engine's drop")
        assert served.metric("llmc:engine_kv_unsent_bytes", engine="prefill-0") == 0
        assert served.metric("llmc:engine_kv_free_blocks", engine="prefill-0") == served.metric(
            "llmc:engine_kv_blocks", engine="prefill-0") > 0
        reply = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5,   # on the other one
                                                 extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 5 and httpx.get(f"{served.url}/health").status_code == 200

        procs[1].send_signal(signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{served.url}/health").status_code == 503, "/health saying 503")
        with pytest.raises(openai.APIStatusError) as refused:
            served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
        assert refused.value.status_code == 503 and "no prefill engine" in refused.value.message

        procs[0].send_signal(signal.SIGTERM)   # the router drains, then tells the engine left to stop
        assert procs[0].wait(timeout=30) == 0 and procs[3].wait(timeout=30) == 0
        log = procs[0].stderr.read()
        assert "prefill-0 (rank 1) exited" in log and "no prefill engine is left" in log
    finally:
        stop_ranks(procs)
        procs[0].stderr.close()
