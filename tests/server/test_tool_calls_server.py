"""Tool calls through `llmc serve` and the `openai` client, on tiny-llama given a chat template that
takes tools (the Hermes format, cut short for a 512-token context: tools named in the system turn, calls
as <tool_call>JSON</tool_call>):
a named tool_choice and "required" generate calls under the functions' schemas, "auto" parses the
calls the model writes, calls stream as deltas, and a conversation carrying calls and their results
goes round; a template without tools refuses tools with a 400 naming why."""

import json

import jsonschema
import openai
import pytest
from conftest import KV_MEMORY, InProcessServer
from tool_chat_template import TOOL_TEMPLATE

import llmc

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(compiled):
    llm = llmc.load(compiled, kv_memory=KV_MEMORY, threads=1)
    llm.engine.tokenizer.chat_template = TOOL_TEMPLATE
    with InProcessServer(llm) as served:
        yield served


def ask(served, **kw):
    return served.client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), tools=TOOLS,
                                                 **{"max_tokens": 120, "temperature": 0, **kw})


def test_named_tool_choice_calls_that_function_under_its_schema(served):
    reply = ask(served, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_required_makes_calls_of_offered_functions(served):
    for seed in (1, 2):
        reply = ask(served, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
        calls = reply.choices[0].message.tool_calls
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_parses_the_calls_the_model_writes(served):
    written = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC\+2"\}\}</tool_call>'
    reply = ask(served, tool_choice="auto", extra_body={"guided_regex": written})
    message = reply.choices[0].message
    assert message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_time", {"zone": "UTC+2"})]
    plain = ask(served, max_tokens=8)   # auto by default; no call written: plain content
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_a_named_call_streams_its_arguments_as_deltas(served):
    chunks = list(ask(served, stream=True, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_time" and len(deltas) > 2
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), TIME)


def test_auto_streams_each_call_as_its_block_closes(served):
    written = (r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "celsius"\}\}'
               r'</tool_call> <tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC\+1"\}\}</tool_call>')
    chunks = [c for c in ask(served, stream=True, max_tokens=200, extra_body={"guided_regex": written}) if c.choices]
    at = [i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls]
    calls = [tc for i in at for tc in chunks[i].choices[0].delta.tool_calls]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Oslo", "unit": "celsius"}), (1, "get_time", {"zone": "UTC+1"})]
    assert len(at) == 2 and at[0] < len(chunks) - 1   # the first call went out before the output ended
    assert all(c.id and c.type == "function" for c in calls)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_tool_call_round_trip(served):
    first = ask(served, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})}]
    reply = ask(served, messages=messages, tool_choice="none", max_tokens=8)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("extra, param, problem", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "give one of them"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools", "cannot be compiled"),
])
def test_bad_tool_requests_are_400s(served, extra, param, problem):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=body)
    assert caught.value.body["param"] == param and problem in caught.value.body["message"]


def test_a_template_without_tools_refuses_them_naming_why(compiled):
    llm = llmc.load(compiled, kv_memory=KV_MEMORY, threads=1)   # tiny-llama's own ChatML template
    with InProcessServer(llm) as served:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(served)
        assert caught.value.body["code"] == "tools_unsupported"
        assert "chat template does not take tools" in caught.value.body["message"]
        assert ask(served, tool_choice="none", max_tokens=4).choices[0].message.content is not None


@pytest.mark.parametrize("text, content, names", [
    ('Sure.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
     '</tool_call> done <tool_c', "Sure.done <tool_c", ["a", "b"]),
    ("plain text\n with no call  \n", "plain text\n with no call  \n", []),
    ('x <tool_call>{"name": bad}</tool_call> y', 'x <tool_call>{"name": bad}</tool_call> y', []),
])
def test_auto_calls_parse_the_same_however_the_stream_is_cut(text, content, names):
    import random

    from llmc.runtime.server.tools import HermesStream, ToolPlan
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), 8))
        stream, got, calls = HermesStream(ToolPlan("auto", [])), "", []
        for piece in (text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])):
            more, new = stream.feed(piece)
            got, calls = got + more, calls + new
        assert got + stream.finish() == content
        assert [(c["index"], c["function"]["name"]) for c in calls] == list(enumerate(names))
