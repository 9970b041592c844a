"""The values of one request as a user gives them (prompt text, token ids, sampling params,
priority), checked before the engine takes the request; each refusal names the request."""

from __future__ import annotations

import operator

from llmc.errors import RuntimeLlmcError
from llmc.runtime.sampling_params import SamplingParams


def prompt_text(prompt, where: str) -> str:
    """`prompt` if it is a str of valid Unicode (no lone surrogates), else a RuntimeLlmcError."""
    if not isinstance(prompt, str):
        raise RuntimeLlmcError(f"{where} is {shown(prompt)}; a prompt is a str or "
                               "{'prompt_token_ids': [int, ...]}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RuntimeLlmcError(f"{where} is not valid Unicode text: a lone surrogate "
                               f"{prompt[e.start]!r} at character {e.start}; pass text that "
                               "encodes as UTF-8") from None
    return prompt


def token_ids(ids, vocab_size: int, where: str) -> list[int]:
    """`ids` as a list of Python ints in [0, vocab_size); refuses bools, floats and strings
    (int(5.7) would silently become 5)."""
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
        raise RuntimeLlmcError(f"{where}.prompt_token_ids is {shown(ids)}; pass a list of token ids")
    out = []
    for i, t in enumerate(ids):
        try:
            value = None if isinstance(t, bool) else operator.index(t)
        except TypeError:
            value = None
        if value is None:
            raise RuntimeLlmcError(f"{where}.prompt_token_ids[{i}] is {shown(t)}, not an integer "
                                   "token id; pass ints")
        if not 0 <= value < vocab_size:
            raise RuntimeLlmcError(f"{where}.prompt_token_ids[{i}] is {value}, outside the vocabulary "
                                   f"[0, {vocab_size}); pass ids the model's tokenizer gives")
        out.append(value)
    return out


def sampling_params(params, where: str) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise RuntimeLlmcError(f"{where}: sampling params are {shown(params)}; pass "
                               "llmc.SamplingParams(...)")
    try:
        return params.validate()
    except RuntimeLlmcError as e:
        raise RuntimeLlmcError(f"{where}: {e}") from None


def priority(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuntimeLlmcError(f"{where}: priority is {shown(value)}; pass an int")
    return value


def shown(value) -> str:
    """'a <type> (<repr, cut at 40 characters>)', for error messages."""
    text, kind = repr(value), type(value).__name__
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({text})"
