"""OpenAI response bodies and stream chunks (`text_completion`, `chat.completion`,
`chat.completion.chunk`) built from the engine's results and per-step deltas, with vLLM's extra
`stop_reason` on each choice and `usage` counted from the tokens themselves."""

from __future__ import annotations

import time

from llmc.runtime.outputs import RequestOutput
from llmc.runtime.server.tools import HermesStream


class ResponseBuilder:
    """One request's bodies: `chat` picks the chat shapes; `top_logprobs` is None without logprobs."""

    def __init__(self, request_id: str, model: str, tokenizer, chat: bool, top_logprobs: int | None):
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.chat, self.top_logprobs = chat, top_logprobs
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}   # completions' logprobs.text_offset, by choice
        self.tools = None   # a chat request's ToolPlan (tools.py), once prepared
        self._held: dict[int, str] = {}   # streamed text of "required" tool choices, parsed at the end
        self._auto: dict[int, HermesStream] = {}   # streamed "auto" tool choices, parsed as they come

    def _envelope(self, kind: str, **fields) -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, **fields}

    def body(self, out: RequestOutput) -> dict:
        """The whole (not streamed) response."""
        choices = [self._choice(o.index, o.text, o.token_ids, o.logprobs, o.finish_reason, o.stop_reason, False)
                   for o in out.outputs]
        extra = {}
        if out.prompt_logprobs is not None:   # vLLM's places: each completion choice, the chat response
            shown = prompt_logprobs(out.prompt_logprobs)
            if self.chat:
                extra["prompt_logprobs"] = shown
            else:
                choices = [{**c, "prompt_logprobs": shown} for c in choices]
        return self._envelope("chat.completion" if self.chat else "text_completion", choices=choices,
                              usage=usage(out), **extra)

    def chunk(self, delta, first: bool) -> dict:
        """One stream event for one choice's delta; `first`: the choice's first event (chat: the role)."""
        choice = self._choice(delta.index, delta.text, delta.token_ids, delta.logprobs, delta.finish_reason,
                              delta.stop_reason, True, first)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices=[choice])

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices=[],
                              usage=usage(out))

    def _choice(self, index, text, token_ids, logprobs, finish_reason, stop_reason, streamed, first=False) -> dict:
        choice = {"index": index, "logprobs": self._logprobs(index, token_ids, logprobs),
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        if not self.chat:
            return {"text": text, **choice}
        if self.tools is not None:
            return self._tool_choice(index, text, choice, streamed, first)
        if not streamed:
            return {"message": {"role": "assistant", "content": text}, **choice}
        return {"delta": ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {}),
                **choice}

    def _tool_choice(self, index: int, text: str, choice: dict, streamed: bool, first: bool) -> dict:
        """A chat choice of a request offering tools: its text parsed into tool_calls. Streamed, a named
        function's arguments come as they are generated, an auto choice's calls each as its block closes;
        a required choice (one JSON array) is held back and parsed whole at the end."""
        role = {"role": "assistant"} if first else {}
        if not streamed:
            content, calls = self.tools.calls(text)
            message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
            return {"message": message, **_finished(choice, calls)}
        if self.tools.mode == "named":
            call = {"index": 0, "function": {"arguments": text}}
            if first:
                opened = self.tools.calls("")[1][0]
                call = {"index": 0, "id": opened["id"], "type": "function",
                        "function": {"name": self.tools.function, "arguments": text}}
            return {"delta": role | ({"tool_calls": [call]} if text or first else {}), **choice}
        if self.tools.mode == "auto":
            return self._auto_delta(index, text, choice, role)
        self._held[index] = self._held.get(index, "") + text
        if choice["finish_reason"] is None:
            return {"delta": role, **choice}
        content, calls = self.tools.calls(self._held.pop(index))
        delta = role | ({"content": content} if content else {}) | (
            {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls else {})
        return {"delta": delta, **_finished(choice, calls)}

    def _auto_delta(self, index: int, text: str, choice: dict, role: dict) -> dict:
        stream = self._auto.setdefault(index, HermesStream(self.tools))
        content, calls = stream.feed(text)
        if choice["finish_reason"] is not None:
            content += stream.finish()
            choice = _finished(choice, [None] * self._auto.pop(index).calls)
        delta = role | ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        return {"delta": delta, **choice}

    def _logprobs(self, index: int, token_ids: list[int], steps) -> dict | None:
        if self.top_logprobs is None or steps is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t, step) for t, step in zip(token_ids, steps)]}
        return self._completion_logprobs(index, token_ids, steps)

    def _top(self, step: dict) -> list[tuple[int, float]]:
        """(token, logprob) of the step's top `top_logprobs` tokens, most likely first."""
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in step.items()
                        if lp.rank is not None and lp.rank <= self.top_logprobs)
        return [(tid, logprob) for _, tid, logprob in ranked]

    def _chat_entry(self, token_id: int, step: dict) -> dict:
        def entry(tid, logprob):
            text = self._token_text(tid)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {**entry(token_id, step[token_id].logprob), "top_logprobs": [entry(*t) for t in self._top(step)]}

    def _completion_logprobs(self, index: int, token_ids: list[int], steps) -> dict:
        tokens = [self._token_text(t) for t in token_ids]
        offsets, offset = [], self.text_offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [step[t].logprob for t, step in zip(token_ids, steps)],
                "top_logprobs": [{self._token_text(tid): lp for tid, lp in self._top(step)} for step in steps],
                "text_offset": offsets}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _finished(choice: dict, calls: list) -> dict:
    """A choice that ended in tool calls finishes with "tool_calls" (OpenAI's), not "stop"."""
    if calls and choice["finish_reason"] == "stop":
        return {**choice, "finish_reason": "tool_calls"}
    return choice


def prompt_logprobs(steps) -> list[dict | None]:
    """vLLM's JSON: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    return [None if step is None else {str(tid): lp.to_dict() for tid, lp in step.items()} for step in steps]


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
