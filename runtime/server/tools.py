"""Tool calls in /v1/chat/completions: which tools a request offers and how it lets the model use
them (`tool_choice`), the constraint a forced choice puts on the output, and the parse of the output
into OpenAI's `tool_calls`.

As vLLM: with `tool_choice` naming a function the output is that function's arguments, generated under
its parameters' JSON schema; with "required" it is a JSON array of {"name", "parameters"} calls under
a schema allowing the offered functions; with "auto" the model writes freely and calls in the Hermes
format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the one the templates of Qwen, Hermes
and SmolLM3 teach) are parsed out of its text; "none" offers no tool. A model whose chat template never
reads `tools` cannot be told about them, so tools sent to it are a 400."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from llmc.errors import RuntimeLlmcError
from llmc.runtime.server.protocol import ApiError, FunctionDef, NamedToolChoice, ToolDef

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolPlan:
    """How one request uses its tools: `mode` "auto" | "required" | "named"; `schema` the JSON schema a
    forced choice constrains the output to; `function` the named function."""
    mode: str
    tools: list[dict]
    schema: dict | None = None
    function: str | None = None

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content left, tool calls) of a finished output."""
        if self.mode == "named":
            return None, [self._call(self.function, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            return None, [self._call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                          for c in items]
        return self._hermes(text)

    def _hermes(self, text: str) -> tuple[str | None, list[dict]]:
        calls = []
        for body in _HERMES_CALL.findall(text):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []   # not a well-formed call: the text stays content
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(self._call(name, arguments))
        if not calls:
            return text, []
        rest = _HERMES_CALL.sub("", text).strip()
        return rest or None, calls

    def _call(self, name: str, arguments: str) -> dict:
        """One call, with an id of its own (each choice's calls are parsed once)."""
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}


OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream:
    """"auto" tool calls read from a streamed output as it comes: text outside <tool_call> blocks goes
    out as content (what may yet begin a block, and trailing whitespace, held back), each block as one
    call once its closing tag arrives; whitespace next to a call is dropped, as the whole-output parse
    strips it. A block that is not a well-formed call goes out as content (the whole-output parse keeps
    all text as content then: a stream cannot take back the calls it sent)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.buffer, self.calls, self.after_call = plan, "", 0, False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls) that can go out now, after `text`."""
        self.buffer += text
        content, calls = "", []
        while True:
            if self.after_call:   # whitespace after a call is dropped until other text comes
                self.buffer = self.buffer.lstrip()
                self.after_call = not self.buffer
            start = self.buffer.find(OPEN)
            end = self.buffer.find(CLOSE, start) if start >= 0 else -1
            if end < 0:
                break
            left, parsed = self.plan.calls(self.buffer[start:end + len(CLOSE)])
            before = self.buffer[:start]
            content += (before.rstrip() if parsed else before) + (left or "")
            self.buffer, self.after_call = self.buffer[end + len(CLOSE):], bool(parsed)
            for call in parsed:
                calls.append({"index": self.calls, **call})
                self.calls += 1
        held = start if start >= 0 else len(self.buffer) - _partial_tag(self.buffer)
        ready = len(self.buffer[:held].rstrip())
        content, self.buffer = content + self.buffer[:ready], self.buffer[ready:]
        return content, calls

    def finish(self) -> str:
        """The content still held at the end (an unclosed block is content)."""
        rest, self.buffer = self.buffer, ""
        return rest.rstrip() if self.calls else rest


def _partial_tag(text: str) -> int:
    """How many trailing characters of `text` may be the start of <tool_call>."""
    return next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])), 0)


def tool_plan(tools: list[ToolDef] | None, tool_choice, template: str | None) -> ToolPlan | None:
    """The request's plan (None: no tools offered, or tool_choice "none"); a 400 for a choice naming no
    offered function, or tools sent to a model whose chat template takes none."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise ApiError(400, "tool_choice needs tools: offer the functions it may call", param="tool_choice")
    if not tools or tool_choice == "none":
        return None
    if not template or not re.search(r"\btools\b", template):
        raise ApiError(400, "tools: the served model's chat template does not take tools (it never reads "
                            "`tools`), so the model cannot be told about them; send the request without tools, "
                            "or serve a model whose template supports them", param="tools", code="tools_unsupported")
    functions = {t.function.name: t.function for t in tools}
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in functions:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not among the tools offered "
                                f"({', '.join(functions)})", param="tool_choice")
        return ToolPlan("named", dumped, _parameters(functions[name]), name)
    if tool_choice == "required":
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": name}, "parameters": _parameters(f)}}
                 for name, f in functions.items()]
        return ToolPlan("required", dumped, {"type": "array", "minItems": 1, "items": {"anyOf": calls}})
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", dumped)
    raise ApiError(400, f"tool_choice {tool_choice!r} is not one of none, auto, required or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")


def checked_tools(tools, template: str, where: str) -> list[dict]:
    """Python's tools (LLM.chat): OpenAI's function dicts, checked as the server checks them, for a
    template that reads `tools`; a RuntimeLlmcError naming the problem otherwise."""
    if not re.search(r"\btools\b", template):
        raise RuntimeLlmcError(f"tools: the chat template of {where} does not take tools (it never reads "
                               "`tools`); call chat() without them, or use a model whose template supports them")
    try:
        parsed = TypeAdapter(list[ToolDef]).validate_python(tools)
    except ValidationError as e:
        first = e.errors()[0]
        place = ".".join(str(p) for p in first["loc"])
        raise RuntimeLlmcError(f"tools[{place}]: {first['msg']}; pass a list of "
                               "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}") from None
    return [t.model_dump(exclude_none=True) for t in parsed]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content left, OpenAI tool calls) of a model's text: its Hermes `<tool_call>` blocks parsed."""
    return ToolPlan("auto", []).calls(text)


def _parameters(function: FunctionDef) -> dict:
    return function.parameters or {"type": "object", "properties": {}}


def template_message(message: dict) -> dict:
    """A message as chat templates read it: tool calls' arguments as objects where they parse."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    shown = []
    for call in calls:
        function = dict(call.get("function", {}))
        try:
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        except (json.JSONDecodeError, TypeError):
            pass
        shown.append({**call, "function": function})
    return {**message, "tool_calls": shown}
