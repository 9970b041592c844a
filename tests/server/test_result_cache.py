"""The result cache of `llmc serve --result-cache SIZE`: a repeated determined request (greedy, or
seeded) gets the identical response from the cache, whole or streamed, in milliseconds; a request
differing in any field that shapes its output misses; undetermined requests bypass it; the cache
stays under its byte bound however many results it is offered, and forgets them after its TTL."""

import statistics
import time
import tracemalloc

import httpx
import pytest
from conftest import API_KEY, InProcessServer, start_serve, stop_serve

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.outputs import CompletionOutput, RequestOutput
from llmc.runtime.server.engine_loop import SampleDelta
from llmc.runtime.server.result_cache import CachedResult, ResultCache, make_result_cache

# Seeded (not greedy), so that temperature and the sampling filters change the output too.
BASE = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.8, "seed": 7}
CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6,
             "temperature": 0}
# A chat template that names the tools (not their parameters): a changed schema leaves the prompt as it was.
TOOL_TEMPLATE = ("{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                 "<|im_end|>\n{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                 "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


@pytest.fixture(scope="module")
def served(compiled):
    served = start_serve(compiled, "--result-cache", "4MiB")
    yield served
    stop_serve(served)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=f"{served.url}/v1", headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as client:
        yield client


def post(http, body: dict, route: str = "completions") -> httpx.Response:
    response = http.post(f"/{route}", json=body)
    assert response.status_code == 200, response.text
    return response


def answer(response: httpx.Response) -> dict:
    """The response without what differs between two answers to the same request."""
    return {k: v for k, v in response.json().items() if k not in ("id", "created")}


def events(response: httpx.Response) -> list:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [{k: v for k, v in httpx.Response(200, content=line).json().items() if k not in ("id", "created")}
            for line in lines[:-1]]


def test_a_repeated_greedy_request_is_answered_identically_from_the_cache_in_under_5_ms(served, http):
    body = {**BASE, "prompt": "The cache test", "temperature": 0, "max_tokens": 24}
    hits = served.metric("llmc:result_cache_hits_total")
    first = post(http, body)
    assert first.headers["x-cache"] == "miss"
    took = []
    for _ in range(30):
        started = time.perf_counter()
        again = post(http, body)
        took.append(time.perf_counter() - started)
        assert again.headers["x-cache"] == "hit"
        assert answer(again) == answer(first) and again.json()["id"] != first.json()["id"]
    # round trips over loopback: an upper bound on the server's time
    print(f"cache hit round trip: median {statistics.median(took) * 1e3:.2f} ms, max {max(took) * 1e3:.2f} ms")
    assert statistics.median(took) < 0.005
    assert served.metric("llmc:result_cache_hits_total") == hits + 30


def test_the_openai_client_reads_the_cached_response_and_its_header(served):
    ask = dict(model="tiny", prompt="Client side", max_tokens=5, temperature=0)
    first = served.client.completions.with_raw_response.create(**ask)
    again = served.client.completions.with_raw_response.create(**ask)
    assert (first.headers["x-cache"], again.headers["x-cache"]) == ("miss", "hit")
    assert again.parse().choices[0].text == first.parse().choices[0].text
    assert again.parse().usage == first.parse().usage


@pytest.mark.parametrize("route,base,change", [
    ("completions", BASE, {"prompt": "Once upon a tim"}),
    ("completions", BASE, {"n": 2}),
    ("completions", BASE, {"temperature": 0.9}),
    ("completions", BASE, {"top_p": 0.5}),
    ("completions", BASE, {"top_k": 5}),
    ("completions", BASE, {"min_p": 0.1}),
    ("completions", BASE, {"seed": 8}),
    ("completions", BASE, {"presence_penalty": 0.5}),
    ("completions", BASE, {"frequency_penalty": 0.5}),
    ("completions", BASE, {"repetition_penalty": 1.2}),
    ("completions", BASE, {"stop": ["e"]}),
    ("completions", BASE, {"stop_token_ids": [5]}),
    ("completions", BASE, {"max_tokens": 5}),
    ("completions", BASE, {"min_tokens": 3}),
    ("completions", BASE, {"ignore_eos": True}),
    ("completions", BASE, {"logprobs": 2}),
    ("completions", BASE, {"include_stop_str_in_output": True}),
    ("completions", BASE, {"skip_special_tokens": False}),
    ("completions", BASE, {"logit_bias": {"5": 3.0}}),
    ("completions", BASE, {"bad_words": ["the"]}),
    ("completions", BASE, {"prompt_logprobs": 1}),
    ("completions", BASE, {"structured_outputs": {"regex": "[a-z]+"}}),
    ("completions", BASE, {"guided_choice": ["yes", "no"]}),
    ("completions", BASE, {"response_format": {"type": "json_object"}}),
    ("chat", CHAT_BASE, {"messages": [{"role": "user", "content": "Hi there!"}]}),
    ("chat", CHAT_BASE, {"max_completion_tokens": 5}),
    ("chat", CHAT_BASE, {"logprobs": True}),
    ("chat", CHAT_BASE, {"logprobs": True, "top_logprobs": 2}),
    ("chat", CHAT_BASE, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
])
def test_a_request_differing_in_one_field_misses(served, http, route, base, change):
    path = "chat/completions" if route == "chat" else "completions"
    post(http, base, path)
    assert post(http, base, path).headers["x-cache"] == "hit"
    varied = post(http, {**base, **change}, path)
    assert varied.headers["x-cache"] == "miss"
    assert post(http, {**base, **change}, path).headers["x-cache"] == "hit"


@pytest.mark.parametrize("change", [
    {"tools": [{"type": "function", "function": {"name": "get_time", "parameters": CITY}}]},
    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {**CITY, "required": []}}}]},
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tool_choice": "none"},
])
def test_a_request_differing_in_its_tools_misses(compiled, change):
    llm = llmc.load(compiled, kv_memory="16MiB", threads=1)
    llm.engine.tokenizer.chat_template = TOOL_TEMPLATE
    with InProcessServer(llm, result_cache="1MiB") as served:
        ask = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=12, temperature=0,
                   tools=[TOOL])
        create = served.client.chat.completions.with_raw_response.create
        assert [create(**ask).headers["x-cache"] for _ in range(2)] == ["miss", "hit"]
        assert [create(**ask | change).headers["x-cache"] for _ in range(2)] == ["miss", "hit"]


def test_fields_that_do_not_change_the_output_still_hit(served, http):
    body = {**BASE, "prompt": "Unkeyed fields"}
    post(http, body)
    for change in ({"user": "someone"}, {"priority": 3}, {"stream_options": {"include_usage": True}}):
        assert post(http, {**body, **change}).headers["x-cache"] == "hit"


def test_a_streamed_hit_gives_the_same_chunks_with_usage(served, http):
    body = {**CHAT_BASE, "messages": [{"role": "user", "content": "Stream me"}], "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}}
    first = post(http, body, "chat/completions")
    again = post(http, body, "chat/completions")
    assert (first.headers["x-cache"], again.headers["x-cache"]) == ("miss", "hit")
    assert again.headers["content-type"].startswith("text/event-stream")
    assert events(again) == events(first)
    assert events(again)[-1]["usage"]["completion_tokens"] == 10
    whole = post(http, {**body, "stream": False}, "chat/completions")
    assert whole.headers["x-cache"] == "hit"   # a stream's result answers the whole request too
    assert whole.json()["choices"][0]["message"]["content"] == "".join(
        e["choices"][0]["delta"].get("content", "") for e in events(first) if e["choices"])


def test_a_whole_result_answers_a_stream_with_the_openai_client(served):
    ask = dict(model="tiny", prompt="Whole then streamed", max_tokens=8, temperature=0)
    whole = served.client.completions.create(**ask)
    chunks = list(served.client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage == whole.usage


def test_undetermined_requests_bypass_the_cache(served, http):
    misses, hits = served.metric("llmc:result_cache_misses_total"), served.metric("llmc:result_cache_hits_total")
    body = {**BASE, "prompt": "Unseeded"}
    del body["seed"]
    for _ in range(2):
        assert "x-cache" not in post(http, body).headers
    assert served.metric("llmc:result_cache_misses_total") == misses
    assert served.metric("llmc:result_cache_hits_total") == hits
    assert served.metric("llmc:result_cache_bytes") > 0


def test_the_cache_is_off_by_default(compiled):
    with InProcessServer(llmc.load(compiled, kv_memory="16MiB", threads=1)) as served:
        ask = dict(model="tiny", prompt="Off", max_tokens=3, temperature=0)
        for _ in range(2):
            assert "x-cache" not in served.client.completions.with_raw_response.create(**ask).headers
        assert served.metric("llmc:result_cache_misses_total") == served.metric("llmc:result_cache_hits_total") == 0


def result(i: int, tokens: int = 16) -> CachedResult:
    """A distinct finished result of `tokens` generated tokens, as the server stores one."""
    ids = [i + t for t in range(tokens)]
    out = RequestOutput(f"cmpl-{i}", None, [i, i + 1, i + 2], [CompletionOutput(0, f"text {i} " * 4, ids, None,
                                                                                 None, "length")], True)
    return CachedResult(out, [SampleDelta(0, f"text {i} ", ids[:8], None), SampleDelta(0, "", ids[8:], None,
                                                                                       "length")])


def test_memory_stays_under_the_bound_with_10000_distinct_requests():
    bound = 512 << 10
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = ResultCache(bound)
        for i in range(10_000):
            assert cache.put(i.to_bytes(32, "big"), result(i))
            assert cache.bytes <= bound
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < len(cache) < 10_000
    assert held <= bound, f"the cache holds {held} bytes, over its bound of {bound}"
    assert cache.get((9_999).to_bytes(32, "big")).output.request_id == "cmpl-9999"
    assert cache.get((0).to_bytes(32, "big")) is None


def test_the_least_recently_used_result_goes_first():
    one = ResultCache(10)._cost(b"k" * 32, __import__("pickle").dumps(result(0)))
    cache = ResultCache(3 * one + 10)
    for i in range(3):
        cache.put(bytes([i]) * 32, result(0))
    cache.get(bytes([0]) * 32)
    cache.put(bytes([3]) * 32, result(0))
    assert [cache.get(bytes([i]) * 32) is not None for i in range(4)] == [True, False, True, True]


def test_a_result_over_the_bound_is_not_kept_and_ttl_expires_entries():
    assert not ResultCache(100).put(b"k" * 32, result(0))
    now = [0.0]
    cache = ResultCache(1 << 20, ttl=10, clock=lambda: now[0])
    cache.put(b"k" * 32, result(0))
    now[0] = 9.5
    assert cache.get(b"k" * 32) is not None
    now[0] = 10.5
    assert cache.get(b"k" * 32) is None and cache.bytes == 0 and len(cache) == 0


@pytest.mark.parametrize("size,ttl,message", [
    ("lots", None, "cannot read 'lots' as a size"),
    (None, 5, "--result-cache-ttl needs --result-cache"),
    ("1MiB", -1, "must be a positive number of seconds"),
])
def test_bad_cache_options_are_refused_with_the_reason(size, ttl, message):
    with pytest.raises(RuntimeLlmcError, match=message):
        make_result_cache(size, ttl)
