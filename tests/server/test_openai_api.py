"""`llmc serve` answers the OpenAI API as the `openai` client expects: streamed and whole results
equal offline generation, usage counts are exact, every error has its status and envelope, a
client that leaves frees its request, and the Prometheus counters add up to what was served."""

import signal
import time

import httpx
import openai
import pytest
from conftest import API_KEY, start_serve, stop_serve
from llmc_cli import error_line, llmc_in_process

from llmc.runtime.sampling_params import SamplingParams

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def served(compiled):
    served = start_serve(compiled)
    yield served
    stop_serve(served)


def test_models_lists_the_served_name(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_stream_equals_whole_reply_and_offline_chat_with_exact_usage(served, offline):
    expected = offline.chat(CHAT, SamplingParams(max_tokens=12, temperature=0))[0]
    chunks = list(served.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.outputs[0].finish_reason
    whole = served.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert streamed == whole.choices[0].message.content == expected.outputs[0].text
    assert whole.usage.total_tokens == len(expected.prompt_token_ids) + len(expected.outputs[0].token_ids)


def test_completions_n2_with_logprobs_and_seed_reproduce_offline_sampling(served, offline):
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=10, n=2, logprobs=3, seed=7, temperature=1.0)
    first, again = served.client.completions.create(**ask), served.client.completions.create(**ask)
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=10, n=2, logprobs=3, seed=7, temperature=1.0))[0]
    assert [c.text for c in first.choices] == [c.text for c in again.choices] == [o.text for o in expected.outputs]
    assert first.usage.completion_tokens == sum(len(o.token_ids) for o in expected.outputs)
    for choice, out in zip(first.choices, expected.outputs):
        assert choice.logprobs.token_logprobs == pytest.approx([step[t].logprob for t, step in
                                                                zip(out.token_ids, out.logprobs)], abs=1e-5)
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
        assert "".join(choice.logprobs.tokens) == choice.text


def test_chat_logprobs_give_the_chosen_token_and_its_alternatives(served):
    reply = served.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0,
                                                  logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:   # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def status_and_error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value.status_code, caught.value.body


@pytest.mark.parametrize("fields, param", [({"temperature": "hot"}, "temperature"), ({"top_p": 2.0}, "top_p"),
                                           ({"max_tokens": 0}, "max_tokens"), ({"best_of": 3}, "best_of"),
                                           ({"logprobs": 50}, "logprobs"), ({"n": True}, "n")])
def test_a_bad_field_is_a_400_naming_it(served, fields, param):
    status, error = status_and_error(lambda: served.client.completions.create(
        model="tiny", prompt=PROMPT, extra_body=fields))
    assert status == 400
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"


def test_chat_max_completion_tokens_is_named_when_refused(served):
    status, error = status_and_error(lambda: served.client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=-1))
    assert (status, error["param"]) == (400, "max_completion_tokens")


def test_an_unknown_model_is_a_404(served):
    status, error = status_and_error(lambda: served.client.completions.create(model="gpt-4", prompt=PROMPT))
    assert status == 404 and error["code"] == "model_not_found" and "gpt-4" in error["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_a_missing_or_wrong_api_key_is_a_401(served, headers):
    reply = httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT}, headers=headers)
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.url}/health").status_code == 200   # health and metrics need no key


def test_a_prompt_longer_than_the_context_is_a_400_with_both_lengths(served):
    status, error = status_and_error(lambda: served.client.completions.create(model="tiny", prompt=[5] * 600))
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert "600" in error["message"] and "512" in error["message"]


def test_a_client_that_disconnects_mid_stream_frees_its_request(served):
    before = served.metric("llmc:generation_tokens_total")
    aborted = served.metric("llmc:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
    served.wait_metric("llmc:num_requests_running", 0)
    assert served.metric("llmc:kv_cache_usage_perc") == 0.0
    served.wait_metric("llmc:request_success_total", aborted + 1, finished_reason="abort")
    assert served.metric("llmc:generation_tokens_total") - before < 400   # cut short, not run to the end


def test_after_n_requests_the_counters_equal_what_was_served(served):
    before = served.metrics()
    replies = [served.client.completions.create(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=3 + i,
                                                temperature=0, extra_body={"ignore_eos": True})
               for i in range(4)]
    after = served.metrics()

    def grew(name, **labels):
        key = (name, tuple(sorted({"model_name": "tiny", **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)
    assert grew("llmc:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    assert grew("llmc:generation_tokens_total") == sum(r.usage.completion_tokens for r in replies) == 3 + 4 + 5 + 6
    assert grew("llmc:request_success_total", finished_reason="length") == 4
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert grew(f"llmc:{histogram}_count") == 4
    assert grew("llmc:inter_token_latency_seconds_count") == sum(r.usage.completion_tokens - 1 for r in replies)
    assert grew("llmc:prefix_cache_queries_total") >= sum(r.usage.prompt_tokens for r in replies)
    # one histogram entry per engine step; the requests ran one after another, one sequence a step
    steps = grew("llmc:iteration_sequences_count")
    assert steps == grew("llmc:iteration_tokens_total_count") >= sum(r.usage.completion_tokens for r in replies)
    assert grew("llmc:iteration_sequences_sum") == steps


def test_serve_refuses_a_taken_port_in_one_line(compiled, served, capsys):
    port = served.url.rsplit(":", 1)[1]
    code, _, err = llmc_in_process(capsys, "serve", compiled, "--port", port)
    assert code == 2
    assert error_line(err).startswith(f"cannot listen on 127.0.0.1:{port} (")


# Last: it stops the module's server.
def test_sigterm_lets_running_requests_finish_and_refuses_new_ones(served):
    stream = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100, stream=True,
                                              extra_body={"ignore_eos": True})
    first = next(iter(stream))
    served.proc.send_signal(signal.SIGTERM)
    while httpx.get(f"{served.url}/health").status_code != 503:
        time.sleep(0.01)
    status, error = status_and_error(lambda: served.client.completions.create(model="tiny", prompt=PROMPT))
    chunks = [first, *stream]
    assert status == 503 and "shutting down" in error["message"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert served.proc.wait(timeout=60) == 0
