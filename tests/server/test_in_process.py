"""The server app under uvicorn in this process, where the tests reach into its engine: a step that
fails answers 500 and frees its request, a client that leaves has its KV blocks freed before the
engine's next step, and a request predicted to miss --ttft-slo-ms is refused at once."""

import asyncio
import threading
import time

import httpx
import openai
import pytest
from conftest import API_KEY, KV_MEMORY, InProcessServer

import llmc
from llmc.runtime.sampling_params import SamplingParams

BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture
def llm(compiled):
    return llmc.load(compiled, kv_memory=KV_MEMORY, threads=1)


def all_blocks_free(engine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.requests


def test_a_failing_engine_step_is_a_500_and_the_server_goes_on(llm):
    engine, execute = llm.engine, llm.engine.runner.execute
    faults = [RuntimeError("injected kernel fault")]

    def failing_once(*args, **kwargs):
        if faults:
            raise faults.pop()
        return execute(*args, **kwargs)
    engine.runner.execute = failing_once
    with InProcessServer(llm) as served:
        with pytest.raises(openai.InternalServerError) as caught:
            served.client.completions.create(model="tiny", prompt="Once", max_tokens=4)
        assert caught.value.status_code == 500
        assert "injected kernel fault" in caught.value.body["message"] and "aborted" in caught.value.body["message"]
        assert all_blocks_free(engine)
        after = served.client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0)
        assert after.usage.completion_tokens == 4
        assert served.metric("llmc:request_success_total", finished_reason="abort") == 1


def test_a_disconnected_stream_frees_its_kv_blocks_within_one_engine_step(llm):
    engine, server = llm.engine, InProcessServer(llm)
    core, step = server.app.state.core, engine.step
    abort, aborted, steps_after_abort = core.abort, threading.Event(), []

    def abort_and_mark(request_id):
        abort(request_id)
        aborted.set()

    def counted_step():
        if aborted.is_set():
            steps_after_abort.append(len(engine.requests))
        return step()
    core.abort, engine.step = abort_and_mark, counted_step
    with server as served:
        with httpx.stream("POST", f"{served.url}/v1/completions", json=BODY,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
        assert aborted.wait(30)
        deadline = time.monotonic() + 30
        while not all_blocks_free(engine):
            assert time.monotonic() < deadline, "the request's blocks were not freed"
            time.sleep(0.01)
    # the step that may have begun as the abort came in; none after it
    assert len(steps_after_abort) <= 1


def test_a_request_predicted_to_miss_the_ttft_slo_is_a_429_at_once(llm):
    with InProcessServer(llm, ttft_slo_ms=0.001) as served:
        first = served.client.completions.create(model="tiny", prompt="Once", max_tokens=2)   # nothing measured yet
        assert first.usage.completion_tokens == 2
        with pytest.raises(openai.RateLimitError) as caught:
            served.client.completions.create(model="tiny", prompt="Once", max_tokens=2)
        assert caught.value.status_code == 429
        assert int(caught.value.response.headers["Retry-After"]) >= 1
        assert "--ttft-slo-ms 0.001" in caught.value.body["message"]


def test_200_concurrent_streams_each_get_their_offline_greedy_text_and_free_every_block(llm, offline):
    prompts = [f"Request {i}: once upon a time" for i in range(200)]
    lengths = [4 + i % 9 for i in range(200)]
    expected = [out.outputs[0].text for out in
                offline.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])]

    async def stream(client, prompt, max_tokens):
        chunks = [c async for c in await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)]
        assert len({c.id for c in chunks}) == 1
        assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
        return "".join(c.choices[0].text for c in chunks)

    async def all_streams(url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*(stream(client, p, n) for p, n in zip(prompts, lengths)))

    with InProcessServer(llm) as served:
        texts = asyncio.run(all_streams(served.url))
        assert texts == expected
        assert all_blocks_free(llm.engine)
        assert served.metric("llmc:request_success_total", finished_reason="length") == 200


def test_ngram_speculation_keeps_the_greedy_text_and_the_draft_counters_follow_the_engine(compiled, offline):
    prompt = "one two three one two three one two three one two"
    expected = offline.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text
    speculating = llmc.load(compiled, kv_memory=KV_MEMORY, threads=1, speculative="ngram")
    with InProcessServer(speculating) as served:
        reply = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        spec = speculating.engine.metrics.speculative
        assert reply.choices[0].text == expected
        assert spec.num_drafts > 0
        assert served.metric("llmc:spec_decode_num_drafts_total") == spec.num_drafts
        assert served.metric("llmc:spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
        assert served.metric("llmc:spec_decode_num_accepted_tokens_total") == spec.num_accepted_tokens
