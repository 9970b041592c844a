"""The server's semantic cache: a request that opts in (`"semantic_cache": true`) and is close in
meaning to an earlier one gets that one's result, above a cosine-similarity threshold. It returns
an answer to a different question, so it is only ever used when asked. A request's meaning is the
served model's own final hidden state (the LM head's input) at the last token of its text wrapped as
`This sentence : "TEXT" means in one word:"` (PromptEOL, Jiang et al. 2023, "Scaling Sentence
Embeddings with Large Language Models"): one prefill pass of that text without the KV cache, on the
prepare thread beside the engine's steps, no second model. Mean-pooled token embeddings and hidden
states ranked samples/paraphrases.json worse than chance (pairs sharing words score highest). Only
requests equal in everything but their text (model, route, sampling fields, tools, ...: `context`)
may match. The vectors live in a FAISS exact inner-product index; the oldest entry goes first once
`max_entries` are held."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from llmc.errors import RuntimeLlmcError
from llmc.runtime.server.result_cache import CachedResult, ran_to_end, request_key

TEXT_FIELDS = frozenset({"prompt", "messages"})   # what may differ between requests that match

NEIGHBOURS = 16   # nearest entries looked at for one of the request's context


class PromptEmbedder:
    """Unit vectors of texts from the served model; call from one thread (it tokenises)."""

    TEMPLATE = 'This sentence : "{}" means in one word:"'

    def __init__(self, executor, tokenizer):
        self.executor, self.tokenizer = executor, tokenizer
        self.max_tokens = executor.plan.max_tokens
        self.dim = int(self("").shape[0])

    def __call__(self, text: str) -> np.ndarray:
        """`text` as a unit vector [hidden]."""
        ids = self.tokenizer(self.TEMPLATE.format(text), add_special_tokens=False)["input_ids"][-self.max_tokens:]
        state = self.executor.final_hidden_state(torch.tensor(ids)).float()
        return (state / state.norm().clamp_min(1e-12)).numpy().astype(np.float32)


def make_semantic_cache(engine, preparer, threshold: float | None, max_entries: int = 10_000):
    """The cache `--semantic-cache-threshold T` asks for (None without T), embedding on `preparer`'s
    thread with its tokenizer."""
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise RuntimeLlmcError(f"--semantic-cache-threshold {threshold!r} must be a cosine similarity in (0, 1]")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise RuntimeLlmcError(f"--semantic-cache-entries {max_entries!r} must be an integer >= 1")
    runner = getattr(engine, "runner", None)
    if runner is None or not hasattr(runner, "executor"):
        raise RuntimeLlmcError("--semantic-cache-threshold: this engine (a parallel one) does not expose its "
                               "hidden states; serve it without the semantic cache")
    embed = PromptEmbedder(runner.executor, preparer.tokenizer)
    return ServedSemanticCache(SemanticCache(embed.dim, float(threshold), max_entries), embed, preparer.executor)


def request_text(body, tokenizer) -> str:
    """What a request asks, in words: a chat's messages, or a completion's prompt."""
    if hasattr(body, "messages"):
        return "\n".join(m.text() for m in body.messages)
    text, ids = body.one_prompt()
    return text if text is not None else tokenizer.decode(ids)


@dataclass
class Lookup:
    """One opted-in request's look-up: its hit (and similarity), or how to store its result."""
    cache: SemanticCache
    context: bytes
    vector: np.ndarray
    hit: CachedResult | None = None
    similarity: float = math.nan

    def headers(self) -> dict:
        return {"X-Cache": "semantic-hit", "X-Cache-Similarity": f"{self.similarity:.4f}"}

    def store(self, result: CachedResult) -> None:
        if ran_to_end(result):
            self.cache.put(self.context, self.vector, result)


class ServedSemanticCache:
    """The semantic cache as the app uses it: look-ups embed the request's text on `thread`."""

    def __init__(self, cache: SemanticCache, embed: PromptEmbedder, thread):
        self.cache, self.embed, self.thread = cache, embed, thread

    async def lookup(self, model: str, route: str, body, metrics) -> Lookup:
        context = request_key(model, route, [], body.sampling_params(), body, TEXT_FIELDS)
        vector = await asyncio.get_running_loop().run_in_executor(
            self.thread, lambda: self.embed(request_text(body, self.embed.tokenizer)))
        found = self.cache.get(context, vector)
        (metrics.semantic_cache_misses if found is None else metrics.semantic_cache_hits).inc()
        lookup = Lookup(self.cache, context, vector)
        if found is not None:
            lookup.hit, lookup.similarity = found
        return lookup


class SemanticCache:
    """Results by (context, meaning): `get` gives the most similar entry of the same context at or
    above `threshold` (cosine, in [-1, 1]) and its similarity."""

    def __init__(self, dim: int, threshold: float, max_entries: int = 10_000):
        import faiss  # faiss: ~0.2 s to import; only servers that use it

        assert -1.0 <= threshold <= 1.0 and max_entries >= 1
        self.threshold, self.max_entries = threshold, max_entries
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self.entries: OrderedDict[int, tuple[bytes, bytes]] = OrderedDict()   # id -> (context, pickled result)
        self.next_id = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, context: bytes, vector: np.ndarray) -> tuple[CachedResult, float] | None:
        if not self.entries:
            return None
        scores, ids = self.index.search(vector[None], min(NEIGHBOURS, len(self.entries)))
        for score, label in zip(scores[0], ids[0]):
            if score < self.threshold:
                break   # most similar first
            entry = self.entries.get(int(label))
            if entry is not None and entry[0] == context:
                return pickle.loads(entry[1]), float(score)
        return None

    def put(self, context: bytes, vector: np.ndarray, result: CachedResult) -> None:
        if len(self.entries) >= self.max_entries:
            oldest, _ = self.entries.popitem(last=False)
            self.index.remove_ids(np.array([oldest], dtype=np.int64))
        result = CachedResult(dataclasses.replace(result.output, metrics=None), result.deltas)
        self.entries[self.next_id] = (context, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        self.index.add_with_ids(vector[None], np.array([self.next_id], dtype=np.int64))
        self.next_id += 1
