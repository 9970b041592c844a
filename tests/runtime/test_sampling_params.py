"""SamplingParams validation and normalisation, and the result types' to_dict()."""

import json

import pytest

from llmc.errors import RuntimeLlmcError
from llmc.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmc.runtime.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, [], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.greedy


@pytest.mark.parametrize("top_k", [0, None, -1])
def test_top_k_zero_none_and_minus_one_mean_disabled(top_k):
    assert SamplingParams(top_k=top_k).top_k == -1


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []


@pytest.mark.parametrize("kwargs", [{"temperature": 0}, {"temperature": 0.0}, {"top_k": 1},
                                    {"temperature": 0.5, "top_k": 1}])
def test_greedy_when_temperature_zero_or_top_k_one(kwargs):
    assert SamplingParams(**kwargs).greedy


@pytest.mark.parametrize("kwargs, message", [
    ({"top_p": 1.5}, "SamplingParams.top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "SamplingParams.top_p must be in (0, 1], got 0.0"),
    ({"temperature": -0.1}, "SamplingParams.temperature must be in [0, inf), got -0.1"),
    ({"temperature": float("nan")}, "SamplingParams.temperature must be in [0, inf)"),
    ({"min_p": 1.2}, "SamplingParams.min_p must be in [0, 1], got 1.2"),
    ({"repetition_penalty": 0.0}, "SamplingParams.repetition_penalty must be in (0, inf)"),
    ({"presence_penalty": 2.5}, "SamplingParams.presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3}, "SamplingParams.frequency_penalty must be in [-2, 2], got -3"),
    ({"top_k": -2}, "SamplingParams.top_k must be -1, 0 or None (disabled) or an integer >= 1"),
    ({"top_k": 2.5}, "SamplingParams.top_k must be"),
    ({"n": 0}, "SamplingParams.n must be an integer >= 1, got 0"),
    ({"max_tokens": 0}, "SamplingParams.max_tokens must be an integer >= 1 or None, got 0"),
    ({"min_tokens": -1}, "SamplingParams.min_tokens must be an integer >= 0, got -1"),
    ({"min_tokens": 20, "max_tokens": 10}, "SamplingParams.min_tokens must be <= max_tokens (10)"),
    ({"logprobs": -1}, "SamplingParams.logprobs must be an integer >= 0 or None, got -1"),
    ({"seed": "7"}, "SamplingParams.seed must be an integer or None, got '7'"),
    ({"stop": ["ok", ""]}, "SamplingParams.stop must hold non-empty strings, got ''"),
    ({"stop_token_ids": [3, -1]}, "SamplingParams.stop_token_ids must hold integers >= 0"),
    ({"ignore_eos": 1}, "SamplingParams.ignore_eos must be True or False, got 1"),
    ({"stop": 5}, "SamplingParams.stop must be a string, a list of strings or None, got 5"),
    ({"stop": {"a"}}, "SamplingParams.stop must be a string, a list of strings or None"),
    ({"stop_token_ids": 5}, "SamplingParams.stop_token_ids must be a list of integers or None, got 5"),
    ({"temperature": "hot"}, "SamplingParams.temperature must be a number, got 'hot'"),
])
def test_invalid_field_names_the_field_and_range(kwargs, message):
    with pytest.raises(RuntimeLlmcError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_boundary_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, temperature=0.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, top_k=1, max_tokens=None, min_tokens=5, logprobs=0)


def test_request_metrics_latencies():
    m = RequestMetrics(arrival_time=10.0, first_token_time=10.25, finished_time=11.25,
                       num_prompt_tokens=7, num_generated_tokens=5)
    assert m.ttft == pytest.approx(0.25)
    assert m.tpot == pytest.approx(0.25)  # 1.0 s over 4 tokens after the first
    assert m.e2e == pytest.approx(1.25)
    running = RequestMetrics(arrival_time=3.0)
    assert (running.ttft, running.tpot, running.e2e) == (None, None, None)


def test_request_output_to_dict_is_json_ready():
    completion = CompletionOutput(index=0, text=" world", token_ids=[11, 12],
                                  cumulative_logprob=-1.5,
                                  logprobs=[{11: Logprob(-0.5, 1, " wor")},
                                            {12: Logprob(-1.0, 2, "ld"), 9: Logprob(-0.7, 1, "x")}],
                                  finish_reason="stop", stop_reason="\n")
    out = RequestOutput("req-1", "hello", [1, 2], [completion], finished=True,
                        metrics=RequestMetrics(1.0, 2.0, 4.0, 2, 3))
    d = out.to_dict()
    assert d["outputs"][0]["logprobs"][1][9] == {"logprob": -0.7, "rank": 1, "decoded_token": "x"}
    assert d["outputs"][0]["finish_reason"] == "stop" and completion.finished()
    assert d["metrics"]["tpot"] == pytest.approx(1.0)
    assert json.loads(json.dumps(d))["outputs"][0]["text"] == " world"
