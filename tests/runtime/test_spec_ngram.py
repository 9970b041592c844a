"""Prompt lookup proposes what followed the latest earlier occurrence of the longest suffix, as a
plain-Python search over every n and every position finds it."""

import numpy as np
import pytest

from llmc.runtime.ngram_proposer import TokenHistory, propose_ngram
from llmc.runtime.sequence import Sequence


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest match first; it ends before the last token
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("seed", range(30))
def test_lookup_matches_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6, rng.integers(1, 80)).tolist()  # a small alphabet: many matches
    k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    max_n = min_n + int(rng.integers(0, 4))
    assert propose_ngram(np.array(tokens), k, min_n, max_n) == reference(tokens, k, min_n, max_n)


def test_history_follows_a_growing_sequence():
    seq = Sequence([5, 6, 7, 8])
    history = TokenHistory(seq)
    for token in [5, 6, *range(300)]:
        seq.append_token(token)
        assert history.sync().tolist() == seq.token_ids
    assert propose_ngram(history.sync(), 3, 1, 4) == reference(seq.token_ids, 3, 1, 4)
