"""Tools from Python: LLM.chat(messages, tools=...) renders them through the chat template (as vLLM's
LLM.chat does), a call generated under a function's schema reads back with llmc.parse_tool_calls, a
conversation carrying calls and their results goes round, and tools for a template that takes none,
or malformed tools, are refused naming why."""

import json

import jsonschema
import pytest
from tool_chat_template import TOOL_TEMPLATE

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.sampling_params import SamplingParams

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
        "x-guidance": {"whitespace_flexible": False}}   # a random tiny model would fill whitespace


@pytest.fixture(scope="module")
def llm(artifact):
    llm = llmc.load(artifact, kv_memory="16MiB", threads=1)
    llm.engine.tokenizer.chat_template = TOOL_TEMPLATE
    return llm


def test_tools_are_rendered_by_the_chat_template(llm):
    assert "Tools: get_weather" in llm.apply_chat_template(ASK, TOOLS)
    assert "Tools:" not in llm.apply_chat_template(ASK)


def test_a_call_generated_under_its_schema_parses_back(llm):
    # the model writes a Hermes block, constrained to a well-formed call of the offered function
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs={
        "grammar": 'start: "<tool_call>" call "</tool_call>"\ncall: %json ' + json.dumps(CALL)})
    out = llm.chat(ASK, params, tools=TOOLS)[0].outputs[0]
    content, calls = llmc.parse_tool_calls(out.text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)
    # the call and its result go round through the template
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps({"celsius": 21})}]
    assert "<tool_call>" in llm.apply_chat_template(turn, TOOLS)
    assert llm.chat(turn, SamplingParams(temperature=0, max_tokens=4), tools=TOOLS)[0].outputs[0].token_ids


def test_tools_for_a_template_without_them_are_refused(artifact):
    plain = llmc.load(artifact, kv_memory="16MiB", threads=1)
    plain.engine.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(RuntimeLlmcError, match="does not take tools"):
        plain.chat(ASK, tools=TOOLS)


@pytest.mark.parametrize("tools, problem", [
    ([{"type": "function", "function": {"parameters": WEATHER}}], r"tools\[0.function.name\]: Field required"),
    ("get_weather", r"tools\[\]: Input should be a valid list"),
])
def test_malformed_tools_are_refused_naming_the_field(llm, tools, problem):
    with pytest.raises(RuntimeLlmcError, match=problem):
        llm.chat(ASK, tools=tools)
    with pytest.raises(RuntimeLlmcError, match="pass messages"):
        llm.generate("hi", tools=TOOLS)
