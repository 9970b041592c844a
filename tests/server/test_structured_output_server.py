"""Structured outputs through `llmc serve` and the `openai` client: OpenAI's response_format (a
JSON schema, any JSON object, `beta.chat.completions.parse` with a pydantic model), vLLM's guided_*
fields and structured_outputs; a bad schema, regex, choice or grammar is a 400 in OpenAI's envelope
naming the field and the problem; logit_bias and bad_words reach the sampler."""

import json
import re
from typing import Annotated

import jsonschema
import openai
import pytest
from conftest import start_serve, stop_serve
from pydantic import BaseModel, Field

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Give me a city"}]
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population", "capital"],
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                       "population": {"type": "integer", "minimum": 0, "maximum": 99999},
                       "capital": {"type": "boolean"}}}


class City(BaseModel):
    name: str = Field(max_length=10)
    rank: int = Field(ge=1, le=9)
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)


@pytest.fixture(scope="module")
def served(compiled):
    served = start_serve(compiled)
    yield served
    stop_serve(served)


def chat(served, **kw):
    return served.client.chat.completions.create(model="tiny", messages=CHAT, **{"max_tokens": 150, **kw})


def test_response_format_json_schema_validates(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for seed in (1, 2, 3):
        reply = chat(served, response_format=fmt, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)


def test_streamed_json_schema_reply_validates(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    chunks = chat(served, response_format=fmt, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), CITY)


def test_beta_parse_with_a_pydantic_model(served):
    reply = served.client.beta.chat.completions.parse(model="tiny", messages=CHAT, response_format=City,
                                                      max_tokens=200, temperature=1.0, seed=4)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City) and 1 <= parsed.rank <= 9


def test_response_format_json_object_gives_an_object(served):
    reply = chat(served, response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")   # cut by max_tokens, an object all the same so far


def test_vllm_guided_fields_on_completions(served):
    def complete(**extra):
        return served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=150, temperature=1.0,
                                                seed=5, extra_body=extra).choices[0].text

    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", complete(guided_regex=r"[0-9]{2}:[0-9]{2}"))
    assert complete(guided_choice=["left", "right"]) in ("left", "right")
    assert re.fullmatch(r"(yes|no)!", complete(guided_grammar='root ::= ("yes" | "no") "!"'))
    jsonschema.validate(json.loads(complete(guided_json=CITY)), CITY)


def test_vllm_structured_outputs_field(served):
    reply = chat(served, temperature=1.0, seed=6, extra_body={"structured_outputs": {"choice": ["a1", "b2"]}})
    assert reply.choices[0].message.content in ("a1", "b2")
    reply = chat(served, temperature=0, extra_body={"structured_outputs": {"json": CITY}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)


@pytest.mark.parametrize("extra, param, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "Invalid type"),
    ({"guided_json": '{"type": '}, "guided_json", "Expecting value"),
    ({"guided_regex": "([a-z"}, "guided_regex", "structured_outputs.regex cannot be compiled"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "Rule 'missing' not found"),
    ({"guided_choice": []}, "guided_choice", "must be a non-empty list of strings"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain the output"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema.schema"),
    ({"logit_bias": {"5": 500}}, "logit_bias", "[-100, 100]"),
])
def test_bad_constraints_are_400s_naming_the_problem(served, extra, param, problem):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(served, temperature=0, extra_body=extra)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param
    assert problem in error["message"], error["message"]


def test_the_server_keeps_serving_after_refusals(served):
    with pytest.raises(openai.BadRequestError):
        chat(served, extra_body={"guided_regex": "(("})
    assert chat(served, temperature=0, max_tokens=4).choices[0].finish_reason in ("stop", "length")


def test_logit_bias_and_bad_words_reach_the_sampler(served, offline):
    forced = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                              logit_bias={"42": 100})
    assert forced.choices[0].text == offline.tokenizer.decode([42] * 4)
    free = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    word = free.choices[0].text.split()[0]
    banned = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                              extra_body={"bad_words": [word]})
    assert banned.choices[0].text != free.choices[0].text


def test_prompt_logprobs_on_completions_and_chat(served, offline):
    ids = offline.tokenizer(PROMPT)["input_ids"]
    reply = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                             extra_body={"prompt_logprobs": 1})
    steps = reply.model_extra.get("prompt_logprobs") or reply.choices[0].model_extra["prompt_logprobs"]
    assert steps[0] is None and len(steps) == len(ids)
    for token, step in zip(ids[1:], steps[1:]):
        entry = step[str(token)]
        assert entry["logprob"] <= 0 and entry["decoded_token"] == offline.tokenizer.decode([token])
    chat_reply = chat(served, temperature=0, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat_reply.model_extra["prompt_logprobs"][0] is None
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        chat(served, stream=True, extra_body={"prompt_logprobs": 0})


def test_vllm_request_metrics_count_what_was_served(served):
    before = served.metric("llmc:request_generation_tokens_count")
    reply = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5
    served.wait_metric("llmc:request_generation_tokens_count", before + 1)
    for name in ("request_prompt_tokens", "time_per_output_token_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert served.metric(f"llmc:{name}_count") >= 1, name
