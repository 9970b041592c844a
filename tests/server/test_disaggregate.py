"""`llmc serve --disaggregate prefill:P,decode:D`: a router and engine processes joined over gloo, queried
with the openai client. Outputs equal one engine's (greedy, seeded, streamed, under preemption on the
decode engine), each handoff reports its KV bytes, the prefill engine's prefix cache serves repeated
prompts, aborted requests leave no KV block held on either engine, and an engine that exits ends its
requests with an error rather than a hang."""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import API_KEY, Served, free_port, start_serve, stop_serve, wait_healthy
from llmc_cli import error_line, llmc_in_process

from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.structured_output import StructuredOutputsParams

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


def test_a_repeated_prompt_hits_the_prefill_engines_prefix_cache(split):
    prompt = prompt_ids(100, 77)
    first = split.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    wait_for(lambda: split.metric("llmc:engine_requests", engine="prefill-0") == 0, "the prefill engine's report")
    hits = split.metric("llmc:prefix_cache_hits_total")
    again = split.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    wait_for(lambda: split.metric("llmc:prefix_cache_hits_total") >= hits + 96, "96 prefix-cache hits (6 blocks)")


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
                                   "prefill:1,decode:1", "--speculative", "ngram")
    assert code == 2 and "--speculative does not combine with --disaggregate" in error_line(err)


def start_ranks(artifact, roles: str, world: int) -> tuple[Served, list[subprocess.Popen]]:
    """Every rank of a disaggregated server started apart, as torchrun starts them (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT: the cross-machine path, on one machine); rank 0 serves, once healthy."""
    port, rendezvous = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "llmc.runtime.server.disaggregate", str(artifact),
                               "--disaggregate", roles, "--port", str(port), "--kv-memory", KV,
                               "--served-model-name", "tiny", "--api-key", API_KEY],
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous)},
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


def test_torchrun_ranks_serve_and_an_engine_that_exits_ends_its_requests_with_an_error(compiled, offline):
    served, procs = start_ranks(compiled, "prefill:1,decode:2", 4)
    try:
        reply = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        expected = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
        assert reply.choices[0].text == expected

        stream = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=480, stream=True,
                                                  extra_body={"ignore_eos": True})
        next(iter(stream))
        procs[2].send_signal(signal.SIGKILL)   # with both idle, the router picked the first decode engine
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="exited"):
            for _ in stream:
                pass
        assert time.monotonic() - started < 10
        assert served.metric("llmc:engine_up", engine="decode-0") == 0
        reply = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)   # on the other one
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
