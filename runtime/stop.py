"""Decides when a sequence finishes (stop token, stop string, length) while turning its
tokens into text incrementally, as vLLM's detokenizer and stop checker do together. Both
read the tokens from the sequence; neither keeps its own copy."""

from __future__ import annotations

from collections.abc import Iterable

from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence

# Prompt tokens kept as decoding context for the first output tokens (as vLLM).
_PREFIX_CONTEXT = 5


class IncrementalDetokenizer:
    """Text of a sequence's output tokens as they are appended, decoding only a short
    window per token, the last prompt tokens giving the first window its context.

    Keeps two offsets into the sequence's ids (vLLM's detokenize_incrementally, TGI's
    decode_token): the new text is decode(ids[prefix:]) minus decode(ids[prefix:read]).
    Decoding a window instead of the lone new token gets context-dependent text right
    (SentencePiece's leading space, a character split over byte tokens: held back while
    the window ends in U+FFFD). Written here rather than taken from `tokenizers.decoders.DecodeStream`
    because that needs a fast tokenizer and cannot take the prompt as context."""

    def __init__(self, tokenizer, seq: Sequence, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.seq = seq
        self.skip_special_tokens = skip_special_tokens
        self.read_offset = seq.num_prompt_tokens
        self.prefix_offset = max(self.read_offset - _PREFIX_CONTEXT, 0)

    def decode_new(self) -> str:
        """The text completed by the tokens appended since the last call (may be "")."""
        ids = self.seq.token_ids
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return full_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        # no clean-up: it could rewrite the window's prefix and break the subtraction
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)


class StopChecker:
    """One per sequence: call `check_new_token` after each token appended to the
    sequence; it keeps the output text and says when and why the sequence finished.

    Checked in this order for each token (vLLM's v0 order): EOS (unless ignore_eos) ->
    "stop", stop_reason None (vLLM's convention for EOS); a stop_token_id -> "stop",
    stop_reason the id; a stop string in the text -> "stop", stop_reason the string, the
    text cut before it (after it with include_stop_str_in_output); max_tokens or
    max_model_len reached -> "length". Stop tokens and strings count only after
    min_tokens tokens. A stop token stays in the sequence's tokens; its text is left out
    unless include_stop_str_in_output."""

    def __init__(self, tokenizer, params: SamplingParams, seq: Sequence,
                 eos_token_id: int | Iterable[int] | None = None,
                 max_model_len: int | None = None):
        """eos_token_id: None takes the tokenizer's."""
        self.params = params
        self.seq = seq
        self.max_model_len = max_model_len
        self.eos_token_ids = _as_set(eos_token_id if eos_token_id is not None
                                     else tokenizer.eos_token_id)
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq, params.skip_special_tokens)
        self._num_checked = seq.num_output_tokens
        self.output_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # a stop string may be half-way out: streaming holds back this many characters
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._streamed = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def check_new_token(self) -> bool:
        """Checks the token just appended to the sequence; returns whether the sequence is
        now finished. With several tokens a step (speculative decoding), append and check
        them one at a time and stop at the first True."""
        assert not self.finished, "a token appended after the sequence finished"
        self._num_checked += 1
        assert self._num_checked == self.seq.num_output_tokens, "each new token is checked once"
        token_id = self.seq.last_token
        may_stop = self._num_checked > self.params.min_tokens
        if may_stop and self._check_stop_token(token_id):
            return True
        new_text = self.detokenizer.decode_new()
        self.output_text += new_text
        if may_stop and new_text and self._check_stop_strings(len(new_text)):
            return True
        self._check_length()
        return self.finished

    def abort(self):
        if not self.finished:
            self.finish_reason = "abort"

    def new_text(self) -> str:
        """Text not returned by a previous call, for streaming. While running it holds
        back the tail that could still turn out to begin a stop string."""
        end = len(self.output_text)
        if not self.finished:
            end = max(self._streamed, end - self._holdback)
        text = self.output_text[self._streamed:end]
        self._streamed = end
        return text

    def _check_stop_token(self, token_id):
        if token_id in self.eos_token_ids and not self.params.ignore_eos:
            reason = None
        elif token_id in self.params.stop_token_ids:
            reason = token_id
        else:
            return False
        if self.params.include_stop_str_in_output:
            self.output_text += self.detokenizer.decode_new()
        self.finish_reason, self.stop_reason = "stop", reason
        return True

    def _check_stop_strings(self, new_chars):
        hit = find_stop_string(self.output_text, new_chars, self.params.stop)
        if hit is None:
            return False
        stop, index = hit
        if self.params.include_stop_str_in_output:
            index += len(stop)
        self.output_text = self.output_text[:index]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _check_length(self):
        at_max_tokens = self.params.max_tokens is not None \
            and self.seq.num_output_tokens >= self.params.max_tokens
        at_max_len = self.max_model_len is not None and self.seq.num_tokens >= self.max_model_len
        if at_max_tokens or at_max_len:
            self.finish_reason = "length"


def find_stop_string(text: str, new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last `new_chars` characters of
    `text` (earlier ones were checked before), with where it starts."""
    best = None
    for stop in stops:
        start = max(len(text) - new_chars - len(stop) + 1, 0)
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[1]):
            best = (stop, index)
    return best


def _as_set(token_ids) -> set[int]:
    if token_ids is None:
        return set()
    if isinstance(token_ids, int):
        return {token_ids}
    return set(token_ids)
