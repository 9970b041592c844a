"""How one request is to be sampled and when it stops: vLLM's `SamplingParams`, with
the same field names and defaults, validated when it is made."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from llmc.errors import RuntimeLlmcError
from llmc.runtime.structured_output import StructuredOutputError, StructuredOutputsParams

# Below this a temperature is treated as greedy: dividing logits by ~0 overflows (as vLLM).
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes at most an unsigned 64-bit seed; sample i draws with seed + i.
MAX_SEED = 2**64 - 1
# OpenAI's bounds on logit_bias: values in [-100, 100]; entries bounded so a request cannot make
# every step index the whole vocabulary.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORDS = 256


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = -1  # -1, 0 or None: disabled (normalised to -1)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the chosen one
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # top logprobs per prompt token; 0 = only the prompt's own token
    # constrained decoding: a JSON schema, any JSON, a regex, a choice or a grammar (structured_output.py)
    structured_outputs: StructuredOutputsParams | dict | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    bad_words: list[str] | None = None  # words never generated (as vLLM: their token sequences are blocked)
    # callables (output_token_ids, logits[vocab]) -> logits[vocab], applied to this request's rows
    logits_processors: list[Callable] | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> "SamplingParams":
        """Check every field (again: a dataclass can be changed after it is made)."""
        self._normalise()
        self._check_numbers()
        self._check_lengths()
        self._check_stops()
        self._check_processors()
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def reshapes_logits(self) -> bool:
        """Whether something beyond the sampling filters and a grammar changes this request's logits
        (a bias, bad words, processors): speculative decoding does not apply those to the rows it
        verifies, so such a request decodes one token a step."""
        return bool(self.logit_bias or self.bad_words or self.logits_processors)

    def _normalise(self):
        if self.top_k is None or (_is_int(self.top_k) and self.top_k == 0):
            self.top_k = -1
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, "a string, a list of strings or None")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "a list of integers or None")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                _fail(name, "must be a number", value)
            setattr(self, name, float(value))

    def _check_numbers(self):
        _check_range("temperature", self.temperature, 0.0, math.inf, "[0, inf)")
        _check_range("top_p", self.top_p, 0.0, 1.0, "(0, 1]", low_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                     "(0, inf)", low_open=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            _fail("top_k", "must be -1, 0 or None (disabled) or an integer >= 1", self.top_k)
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", "must be an integer or None", self.seed)
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            _fail("seed", "must lie in [0, 2**64 - 1]", self.seed)

    def _check_lengths(self):
        if not _is_int(self.n) or self.n < 1:
            _fail("n", "must be an integer >= 1", self.n)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", "must be an integer >= 1 or None", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", "must be an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                _fail(name, "must be an integer >= 0 or None", value)
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            _fail("seed", f"+ n - 1 must be at most 2**64 - 1 (sample i draws with seed + i; n is {self.n})",
                  self.seed)

    def _check_stops(self):
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", "must hold non-empty strings", s)
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _fail("stop_token_ids", "must hold integers >= 0", t)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "must be True or False", getattr(self, name))


    def _check_processors(self):
        try:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        except StructuredOutputError as e:
            raise RuntimeLlmcError(f"SamplingParams.{e}") from None
        self._check_logit_bias()
        self.bad_words = _as_list("bad_words", self.bad_words, "a list of strings or None")
        if len(self.bad_words) > MAX_BAD_WORDS:
            _fail("bad_words", f"must hold at most {MAX_BAD_WORDS} words", f"{len(self.bad_words)} words")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                _fail("bad_words", "must hold non-blank strings", word)
        self.logits_processors = _as_list("logits_processors", self.logits_processors,
                                          "a list of callables or None")
        for f in self.logits_processors:
            if not callable(f):
                _fail("logits_processors", "must hold callables (output_token_ids, logits) -> logits", f)

    def _check_logit_bias(self):
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            _fail("logit_bias", f"must hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens",
                  f"{len(self.logit_bias)} tokens")
        bias = {}
        for token, value in self.logit_bias.items():
            # OpenAI's JSON keys are strings of token ids
            token = int(token) if isinstance(token, str) and token.isdigit() else token
            if not _is_int(token) or token < 0:
                _fail("logit_bias", "keys must be token ids (integers >= 0)", token)
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                _fail("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", value)
            bias[token] = float(value)
        self.logit_bias = bias


def _as_list(name, value, shown) -> list:
    """A list of the items of `value` (None: none); a value that is no sequence is refused by name
    rather than left to list()'s TypeError."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        _fail(name, f"must be {shown}", value)
    return list(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_range(name, value, low, high, shown, low_open=False):
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        _fail(name, f"must be in {shown}", value)


def _fail(name, rule, value):
    raise RuntimeLlmcError(f"SamplingParams.{name} {rule}, got {value!r}; "
                           f"fix the request's {name}")
