"""Constrained decoding: a request's structured-output spec (JSON schema, any JSON, regex, choice,
EBNF/GBNF or Lark grammar) compiled by llguidance into a matcher whose token mask the sampler applies
to the request's logits every step, and which then consumes the token drawn.

llguidance rather than xgrammar (both measured on this CPU with SmolLM2's 49,152-token vocabulary and a
nested schema): llguidance fills a mask in ~26 us a step where xgrammar takes ~2 us, both far under a
decode step (~5 ms); but llguidance builds its lexer lazily (2 ms a schema against xgrammar's 11 ms, and
no eager blow-up on a huge schema), bounds compile and mask time and memory with explicit fuel limits
(LLParserLimits), takes GBNF and Lark as well as JSON schema, regex and choice, needs no other package,
and reports a bad spec as a message rather than an exception from C++."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from llmc.errors import RuntimeLlmcError

# Grammars kept compiled, by spec (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256
# A spec longer than this is refused before it is compiled (a schema of a megabyte is not a schema).
MAX_SPEC_CHARS = 256 * 1024
# llguidance's bounds on one compile and one mask step: fuel is ~50k units a millisecond when a
# grammar is built and ~14k a millisecond in a step; a lexer state costs 1-2 kB, so 50,000 of them
# cap a matcher's memory near 100 MB.
LIMITS = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
          "max_lexer_states": 50_000, "max_grammar_size": 200_000, "verbose_errors": False}

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(RuntimeLlmcError):
    """A spec that cannot constrain generation: bad JSON schema, regex, choice or grammar."""


@dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON schema: dict, JSON text or a
    pydantic model class), `regex`, `choice` (a list of strings), `grammar` (EBNF/GBNF or Lark) and
    `json_object=True` (any JSON object)."""
    json: dict | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False   # JSON without whitespace between tokens
    whitespace_pattern: str | None = None  # JSON: a regex for the whitespace allowed between tokens

    def __post_init__(self):
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()   # a pydantic model
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(f"structured_outputs need exactly one of {', '.join(_KINDS)}; "
                                        f"got {', '.join(given) or 'none'}")
        self._check_types()

    def _check_types(self):
        if self.json is not None and not isinstance(self.json, (dict, str)):
            _refuse("json", "must be a JSON schema: a dict, its JSON text or a pydantic model class", self.json)
        for name in ("regex", "grammar", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                _refuse(name, "must be a string", getattr(self, name))
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            _refuse("choice", "must be a non-empty list of strings", self.choice)
        if self.json_object not in (None, True, False):
            _refuse("json_object", "must be True, False or None", self.json_object)
        if not isinstance(self.disable_any_whitespace, bool):
            _refuse("disable_any_whitespace", "must be True or False", self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar (property order matters: it is the order generated)."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return self.kind, text, self.disable_any_whitespace, self.whitespace_pattern

    @classmethod
    def of(cls, value) -> StructuredOutputsParams | None:
        """A StructuredOutputsParams from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                _refuse(unknown[0], f"is not a field (the fields: {', '.join(cls.__dataclass_fields__)})",
                        value[unknown[0]])
            return cls(**value)
        raise StructuredOutputError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams or a "
                                    f"dict of its fields, got {type(value).__name__}")


def _refuse(name, rule, value):
    shown = repr(value)
    raise StructuredOutputError(f"structured_outputs.{name} {rule}, got {shown[:80]}")


class GrammarCompiler:
    """Compiles specs against one tokenizer, once per distinct spec (an LRU cache shared by threads:
    the server compiles on its request thread, the engine then finds the grammar here)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = GRAMMAR_CACHE_SIZE):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh matcher at the start of `spec`'s grammar."""
        return self.compile(spec).deep_copy()

    def compile(self, spec: StructuredOutputsParams):
        """The pristine matcher of `spec` (cached); a StructuredOutputError naming the problem."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        import llguidance  # llguidance: only requests with structured outputs

        text = spec.key()[1]
        if len(text) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"structured_outputs.{spec.kind} is {len(text)} characters long, over the "
                                        f"limit of {MAX_SPEC_CHARS}; shorten it")
        grammar = _grammar(spec)
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise StructuredOutputError(f"structured_outputs.{spec.kind} cannot be compiled: "
                                        f"{_first_line(matcher.get_error())}")
        return matcher

    def tokenizer(self):
        """llguidance's view of the tokenizer (built once: ~0.3 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf  # llguidance.hf: ~0.6 s (transformers' tokenizers)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_ids)
            return self._ll_tokenizer


def _grammar(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar text for `spec`."""
    from llguidance import LLMatcher, grammar_from  # llguidance: only requests with structured outputs

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, not {type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(spec))
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return grammar_from("regex" if kind == "regex" else "grammar", getattr(spec, kind))
    except ValueError as e:
        raise StructuredOutputError(f"structured_outputs.{kind} cannot be compiled: {_first_line(str(e))}") from None


def _json_options(spec: StructuredOutputsParams) -> dict:
    # strict: a keyword llguidance does not implement (uniqueItems) is refused with its name, not left
    # unenforced (a lenient compile let 15 of 20 outputs of a uniqueItems schema repeat an item)
    if spec.whitespace_pattern is not None:
        return {"whitespace_pattern": spec.whitespace_pattern, "lenient": False}
    # flexible whitespace lets a small model fill a string's worth of newlines; one space at most
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False, "lenient": False}
    return {"whitespace_pattern": r"[ ]?", "lenient": False}


def _first_line(message: str) -> str:
    """The reason on one line (llguidance's messages may span several)."""
    return " ".join(line.strip() for line in message.strip().splitlines())[:300] or "(no reason given)"


@torch.inference_mode()   # the runner's logits are inference tensors: changed in place only in this mode
def apply_grammar_masks(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Set to -inf, in place, the logits of the tokens each matcher does not allow next.
    logits: [batch, vocab]; rows[j] is the row of matchers[j]."""
    vocab = logits.shape[1]
    words = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.int32)
    for j, matcher in enumerate(matchers):
        row = words[j]
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    # bit i of a little-endian bitmask is token i
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    blocked = torch.from_numpy(allowed == 0).to(logits.device)
    for j, i in enumerate(rows):   # row views: an index_put over the rows costs 3x as much
        logits[i].masked_fill_(blocked[j], float("-inf"))


def grammar_drafts(matcher, drafts: list[int]) -> list[int]:
    """The leading speculative drafts the grammar accepts from the matcher's state (it is left as is)."""
    return list(drafts[:matcher.validate_tokens(list(drafts))])


@torch.inference_mode()
def mask_draft_rows(logits: torch.Tensor, matcher, drafts: list[int]) -> None:
    """Mask a speculating sequence's verification rows in place: logits [1 + k, vocab], row j under the
    grammar after drafts[:j] (each draft one grammar_drafts kept); the matcher is rolled back after."""
    consumed = 0
    for j in range(len(drafts) + 1):
        apply_grammar_masks(logits, [j], [matcher])
        if j < len(drafts) and not matcher.is_stopped() and matcher.consume_token(drafts[j]):
            consumed += 1
    matcher.rollback(consumed)


def consume(matcher, token: int) -> None:
    """Advance `matcher` past the token drawn under its mask (a stopped matcher takes EOS again)."""
    if not matcher.is_stopped():
        matcher.consume_token(token)
