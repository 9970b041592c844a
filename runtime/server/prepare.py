"""A request body made into what the engine takes (prompt token ids and sampling params), on a
worker thread: chat templates and tokenisers take time that grows with the prompt (seconds for
megabytes), and on the event loop that time would stall every other request and /health; so do
grammars of structured outputs, compiled here (once per distinct spec: the engine finds them cached). Here too
the prompt is checked against the context before it is tokenised (limits.PromptBound), `n` is
capped, and `max_tokens` is clamped to what the context leaves (as vLLM does)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from llmc.errors import RuntimeLlmcError
from llmc.runtime import request_values
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.limits import PromptBound
from llmc.runtime.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from llmc.runtime.server.tools import ToolPlan, template_message, tool_plan
from llmc.runtime.structured_output import StructuredOutputError, StructuredOutputsParams


@dataclass
class Prepared:
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None = None   # a chat request's tools and how they may be called


class RequestPreparer:
    """Prepares requests one at a time on its own thread, with its own tokenizer: a Rust tokenizer
    used from two threads at once can fail "Already borrowed"."""

    def __init__(self, engine, max_n: int):
        self.engine, self.max_n = engine, max_n
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.bound = PromptBound(self.tokenizer)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="llmc-prepare")

    async def completion(self, body: CompletionRequest) -> Prepared:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._completion, body)

    async def chat(self, body: ChatCompletionRequest) -> Prepared:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._chat, body)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _completion(self, body: CompletionRequest) -> Prepared:
        params = self._compiled(body, self._capped(body.sampling_params()))
        if body.best_of is not None and body.best_of != params.n:
            raise ApiError(400, f"best_of {body.best_of} differs from n {params.n}: llmc returns every sample it "
                                "draws, so best_of must equal n or be left out", param="best_of")
        text, ids = body.one_prompt()
        if ids is None:
            ids = self._encoded(text, "prompt")
        return self._prepared(text, ids, params, "prompt")

    def _chat(self, body: ChatCompletionRequest) -> Prepared:
        params = self._capped(body.sampling_params())
        plan = tool_plan(body.tools, body.tool_choice, str(getattr(self.tokenizer, "chat_template", None) or ""))
        if plan is not None and plan.schema is not None:
            if params.structured_outputs is not None:
                raise ApiError(400, f"tool_choice {plan.mode!r} constrains the output to a tool call, and so does "
                                    f"{body.structured_outputs_spec()[1]}; give one of them", param="tool_choice")
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=plan.schema))
        params = self._compiled(body, params, "tools" if plan is not None else None)
        text = self._rendered(body.conversation(), plan.tools if plan is not None else None)
        prepared = self._prepared(text, self._encoded(text, "messages"), params, "messages")
        prepared.tools = plan
        return prepared

    def _capped(self, params: SamplingParams) -> SamplingParams:
        if params.n > self.max_n:
            raise ApiError(400, f"n {params.n} is over this server's limit of {self.max_n} choices per request "
                                "(--max-n); ask for fewer or send several requests", param="n")
        return params

    def _compiled(self, body, params: SamplingParams, tools_field: str | None = None) -> SamplingParams:
        """Compile the request's grammar (a bad one is a 400 naming its field and the problem)."""
        if params.structured_outputs is not None:
            try:
                self.engine.grammars.compile(params.structured_outputs)
            except StructuredOutputError as e:
                field = body.structured_outputs_spec()[1] or tools_field
                raise ApiError(400, f"{field}: {e}", param=field, code="invalid_structured_output") from None
        return params

    def _rendered(self, conversation: list[dict], tools: list[dict] | None = None) -> str:
        """The conversation through the model's chat template. The template is the model's, but what
        makes it fail is the conversation (a `raise_exception` on roles, a loop the sandbox stops), so
        a failure is the request's 400."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "the served model has no chat template; use /v1/completions", param="messages")
        try:
            return self.tokenizer.apply_chat_template([template_message(m) for m in conversation], tools=tools,
                                                      tokenize=False, add_generation_prompt=True)
        except Exception as e:   # jinja2's TemplateError and SecurityError, the sandbox's OverflowError, ...
            raise ApiError(400, f"messages: the model's chat template refused this conversation "
                                f"({type(e).__name__}: {str(e)[:200]})", param="messages",
                           code="chat_template_error") from None

    def _encoded(self, text: str, field: str) -> list[int]:
        context = self.engine.max_model_len
        try:
            text = request_values.prompt_text(text, field)
        except RuntimeLlmcError as e:
            raise ApiError(400, str(e), param=field) from None
        self.bound.check(text, context, context, field)
        return self.tokenizer(text)["input_ids"]

    def _prepared(self, text: str | None, ids: list[int], params: SamplingParams, field: str) -> Prepared:
        """The checked prompt ids (a prompt longer than the context is a 400 with both lengths) and
        params whose max_tokens is at most what the context leaves after the prompt."""
        context = self.engine.max_model_len
        if len(ids) > context:   # before each id is checked: a list of millions takes seconds
            raise ApiError(400, f"{field}: prompt of {len(ids)} tokens is longer than the model's context of "
                                f"{context} tokens; shorten the prompt", param=field, code="context_length_exceeded")
        try:
            ids = self.engine.prompt_ids(None, ids, field)
        except RuntimeLlmcError as e:
            code = "context_length_exceeded" if "longer than the model's context" in str(e) else None
            raise ApiError(400, str(e), param=field, code=code) from None
        # the engine samples a token from the last position even when the prompt fills the context
        room = max(self.engine.max_model_len - len(ids), 1)
        if params.min_tokens > room:
            raise ApiError(400, f"min_tokens {params.min_tokens} is more than the {room} tokens the model's "
                                f"context of {self.engine.max_model_len} leaves after the prompt of {len(ids)} "
                                "tokens", param="min_tokens", code="context_length_exceeded")
        if params.max_tokens is None or params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        return Prepared(text, ids, params)
