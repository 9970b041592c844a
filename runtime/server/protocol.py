"""The OpenAI request bodies the server takes (`/v1/completions`, `/v1/chat/completions`) with
vLLM's extra sampling fields, and their translation into `SamplingParams`. Unknown fields are
refused, not ignored: a field the server would silently drop changes what the user gets."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmc.errors import RuntimeLlmcError
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.structured_output import StructuredOutputError, StructuredOutputsParams

# vLLM's default --max-logprobs: the most top logprobs one token may ask for.
MAX_LOGPROBS = 20


class ApiError(Exception):
    """An error the server answers in OpenAI's envelope: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The envelope of every error (for the OpenAPI schema; ApiError.body() writes it)."""
    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: str = Field(pattern="^text$")
    text: str


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute in pydantic: kept under another name
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON under a schema."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (the fields of its StructuredOutputsParams)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    priority: int = 0   # as llmc's engine: higher runs first
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)   # vLLM's; not with stream
    logit_bias: dict[str, float] | None = None   # OpenAI's: token id (as a string) -> bias in [-100, 100]
    bad_words: list[str] | None = None
    # constrained decoding: OpenAI's response_format, vLLM's guided_* fields and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    semantic_cache: bool = False   # llmc's: may be answered with the result of a request close in meaning

    def structured_outputs_spec(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's constraint and the field it came in (for a 400's param); at most one field."""
        given = {name: spec for name, spec in (("response_format", self._response_format_spec()),
                                               ("structured_outputs", self._structured_outputs_spec()),
                                               *self._guided_specs()) if spec is not None}
        if len(given) > 1:
            raise ApiError(400, f"{' and '.join(given)} both constrain the output; give one of them",
                           param=list(given)[1])
        if not given:
            return None, None
        field, spec = next(iter(given.items()))
        try:
            return StructuredOutputsParams(**spec), field
        except StructuredOutputError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None

    def _response_format_spec(self) -> dict | None:
        form = self.response_format
        if form is None or form.type == "text":
            return None
        if form.type == "json_object":
            return {"json_object": True}
        if form.json_schema is None or not form.json_schema.json_schema:
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema, a JSON schema",
                           param="response_format.json_schema")
        return {"json": form.json_schema.json_schema}

    def _structured_outputs_spec(self) -> dict | None:
        if self.structured_outputs is None:
            return None
        fields = self.structured_outputs.model_dump(exclude_defaults=True, by_alias=True)
        return fields

    def _guided_specs(self):
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                yield field, {key: getattr(self, field), "whitespace_pattern": self.guided_whitespace_pattern}

    def sampling_fields(self) -> dict:
        """The SamplingParams fields this request sets (the rest keep their defaults)."""
        given = {name: getattr(self, name) for name in (
            "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
            "min_p", "ignore_eos", "repetition_penalty", "min_tokens", "stop_token_ids",
            "include_stop_str_in_output", "skip_special_tokens", "logit_bias", "bad_words", "prompt_logprobs")}
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError(400, "prompt_logprobs are not given with stream=true (as vLLM); ask for them without "
                                "streaming", param="prompt_logprobs")
        given["structured_outputs"] = self.structured_outputs_spec()[0]
        return {k: v for k, v in given.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None   # only as n: every sample drawn is returned

    def one_prompt(self) -> tuple[str | None, list[int] | None]:
        """(text, token ids) of the request's single prompt."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} prompts; this server takes one prompt per "
                                    "request: send one request per prompt", param="prompt")
            prompt = prompt[0]
        return (prompt, None) if isinstance(prompt, str) else (None, prompt)

    def sampling_params(self) -> SamplingParams:
        return _checked_params(self.sampling_fields() | {"max_tokens": self.max_tokens, "logprobs": self.logprobs},
                               {})


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call an assistant message made (sent back in the conversation that answers it)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[ContentPart] | None = None   # None: an assistant message of tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None   # a "tool" message: the call it answers

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (only an assistant message of tool_calls may leave it out)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict:
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None   # accepted; "required" may make several calls either way

    def conversation(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        """Without a length limit the reply may run to the end of the context (as vLLM)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return _checked_params(self.sampling_fields() | {"max_tokens": limit, "logprobs": logprobs},
                               {"max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None
                                else "max_tokens", "logprobs": "top_logprobs"})


def _checked_params(fields: dict, api_names: dict) -> SamplingParams:
    """SamplingParams from a request's fields; its refusal becomes a 400 naming the request's field."""
    try:
        return SamplingParams(**fields)
    except RuntimeLlmcError as e:
        found = re.search(r"SamplingParams\.(\w+)", str(e))
        name = found.group(1) if found else None
        message = str(e).replace("SamplingParams.", "")
        if name in api_names:
            message = message.replace(name, api_names[name])
            name = api_names[name]
        raise ApiError(400, message, param=name) from None
