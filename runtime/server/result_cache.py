"""The server's result cache: a repeated request whose output is determined (greedy, or sampled with
a seed) gets its stored result without running the model. An entry is keyed by a digest of the
served model, the route, the rendered prompt's token ids, every SamplingParams field and every body
field that shapes the response (all but `stream`, `stream_options`, `user` and `priority`, which
change neither the tokens nor the choices); it holds the result and the deltas it was streamed in,
pickled, so a hit answers whole or as the same stream. Bounded in bytes (least recently used
out first), with an optional time to live. Used from the event loop only, so it takes no lock."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pickle
import time
from collections import OrderedDict
from dataclasses import dataclass

from llmc.errors import RuntimeLlmcError
from llmc.runtime.block_manager import parse_bytes
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.sampling_params import SamplingParams

# Body fields that change neither the tokens generated nor the response's choices.
UNKEYED_FIELDS = frozenset({"stream", "stream_options", "user", "priority", "semantic_cache"})
# What an entry costs beyond its pickled bytes and key: the OrderedDict slot, the tuple, the float
# and the bytes objects' headers (tracemalloc measured 220 bytes on CPython 3.12).
ENTRY_OVERHEAD = 256


@dataclass
class CachedResult:
    """A finished request as the cache gives it back: the whole result (metrics dropped) and the
    per-step deltas (engine_loop.SampleDelta) it was handed out in."""
    output: RequestOutput
    deltas: list


def make_result_cache(size: int | str | None, ttl: float | None = None) -> ResultCache | None:
    """The cache `--result-cache SIZE [--result-cache-ttl SECONDS]` asks for; None without a size."""
    if size is None:
        if ttl is not None:
            raise RuntimeLlmcError("--result-cache-ttl needs --result-cache SIZE (result_cache=...)")
        return None
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < math.inf):
        raise RuntimeLlmcError(f"--result-cache-ttl {ttl!r} must be a positive number of seconds")
    return ResultCache(parse_bytes(size, "--result-cache"), ttl)


def is_determined(params: SamplingParams) -> bool:
    """Whether the request's output is a function of the request: greedy or seeded, and no logits
    processors (callables, which a key cannot capture)."""
    return (params.greedy or params.seed is not None) and not params.logits_processors


def ran_to_end(result: CachedResult) -> bool:
    """Whether every choice finished (an aborted one is not the request's output)."""
    return all(o.finish_reason not in (None, "abort") for o in result.output.outputs)


def request_key(model: str, route: str, token_ids: list[int], params: SamplingParams, body,
                unkeyed: frozenset = frozenset()) -> bytes:
    """The digest (sha256) keying a request: equal exactly when every input to the output is equal
    (the body's `unkeyed` fields left out besides UNKEYED_FIELDS)."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "logits_processors"}
    shown = body.model_dump(mode="json", exclude=set(UNKEYED_FIELDS | unkeyed), by_alias=True)
    material = json.dumps([model, route, token_ids, _plain(fields), shown], sort_keys=True, default=repr,
                          separators=(",", ":"))
    return hashlib.sha256(material.encode()).digest()


def _plain(value):
    """Dataclasses (structured outputs) as dicts, dict keys as strings: JSON with one spelling per value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class ResultCache:
    """A byte-bounded LRU of pickled CachedResults; `ttl`: seconds an entry stays valid (None: forever)."""

    def __init__(self, max_bytes: int, ttl: float | None = None, clock=time.monotonic):
        assert max_bytes > 0 and (ttl is None or ttl > 0)
        self.max_bytes, self.ttl, self.clock = max_bytes, ttl, clock
        self.entries: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()   # key -> (pickle, stored at)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> CachedResult | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        blob, stored = entry
        if self.ttl is not None and self.clock() - stored > self.ttl:
            self._drop(key)
            return None
        self.entries.move_to_end(key)
        return pickle.loads(blob)

    def put(self, key: bytes, result: CachedResult) -> bool:
        """Store `result` (evicting the least recently used); False when it alone is over the bound."""
        output = dataclasses.replace(result.output, metrics=None)
        blob = pickle.dumps(CachedResult(output, result.deltas), protocol=pickle.HIGHEST_PROTOCOL)
        cost = self._cost(key, blob)
        if cost > self.max_bytes:
            return False
        if key in self.entries:
            self._drop(key)
        while self.bytes + cost > self.max_bytes:
            self._drop(next(iter(self.entries)))
        self.entries[key] = (blob, self.clock())
        self.bytes += cost
        return True

    def _drop(self, key: bytes) -> None:
        blob, _ = self.entries.pop(key)
        self.bytes -= self._cost(key, blob)

    @staticmethod
    def _cost(key: bytes, blob: bytes) -> int:
        return len(key) + len(blob) + ENTRY_OVERHEAD
