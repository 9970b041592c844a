"""Prompt lookup (Saxena 2023, vLLM's n-gram proposer): the drafts are the tokens that followed the
latest earlier occurrence of the sequence's longest suffix (min_n to max_n tokens) found in its own
prompt and output. Answers that quote their prompt (extraction, summaries, code edits) get long
runs of kept drafts for the price of a few array comparisons."""

from __future__ import annotations

import numpy as np

from llmc.runtime.sequence import Sequence


class TokenHistory:
    """A sequence's token ids as a growing int64 array, so a lookup does not convert the list anew
    (the list only grows)."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.array = np.empty(256, dtype=np.int64)
        self.length = 0

    def sync(self) -> np.ndarray:
        token_ids = self.seq.token_ids
        n = len(token_ids)
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length:n] = token_ids[self.length:n]
        self.length = n
        return self.array[:n]


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix of `tokens` with
    min_n <= n <= max_n tokens; [] when no suffix of min_n tokens occurred before."""
    return lookup(tokens, k, min_n, max_n)[0]


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """propose_ngram's drafts and the length n of the suffix they matched (0: none)."""
    found, n = candidates(tokens, k, min_n, max_n, 1)
    return (found[0] if found else []), n


def candidates(tokens: np.ndarray, k: int, min_n: int, max_n: int, count: int) -> tuple[list[list[int]], int]:
    """Up to `count` distinct continuations (up to k tokens each) of earlier matches of a suffix of
    `tokens`: the longest suffix's matches first, latest first, then shorter ones'; and the length of
    the longest suffix matched (0: none, and no continuations)."""
    length = len(tokens)
    if length <= min_n or k <= 0:
        return [], 0
    # run[i]: how many of the suffix's last tokens match the tokens ending at i (up to max_n);
    # a match must end before the last token, leaving at least one token to propose
    matched = np.ones(length - 1, dtype=bool)
    run = np.zeros(length - 1, dtype=np.int64)
    for j in range(min(max_n, length - 1)):
        matched[:j] = False
        matched[j:] &= tokens[:length - 1 - j] == tokens[length - 1 - j]
        run += matched
    ends = np.flatnonzero(run >= min_n)
    if not len(ends):
        return [], 0
    found: list[list[int]] = []
    for end in ends[np.lexsort((-ends, -run[ends]))][:8 * count]:
        continuation = tokens[end + 1:end + 1 + k].tolist()
        if continuation not in found:
            found.append(continuation)
            if len(found) == count:
                break
    return found, int(run[ends].max())


class NgramProposer:
    """Drafts for each sequence from its own tokens; keeps one TokenHistory per sequence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.histories: dict[int, TokenHistory] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [found[0] if found else [] for found, _ in self.lookups(seqs, ks)]

    def lookups(self, seqs: list[Sequence], ks: list[int], count: int = 1) -> list[tuple[list[list[int]], int]]:
        """(up to `count` candidate continuations, matched suffix length) per sequence."""
        return [candidates(self._history(s).sync(), k, self.min_n, self.max_n, count) for s, k in zip(seqs, ks)]

    def _history(self, seq: Sequence) -> TokenHistory:
        history = self.histories.get(seq.seq_id)
        if history is None:
            history = self.histories[seq.seq_id] = TokenHistory(seq)
        return history

    def forget_finished(self) -> None:
        for seq_id in [i for i, h in self.histories.items() if h.seq.is_finished]:
            del self.histories[seq_id]
