"""KV policies that hold a sequence's cache to a fixed budget of entries per KV head: StreamingLLM (the first
`sinks` tokens and the newest ones; Xiao et al. 2023) and H2O (the sinks, the `recent` newest tokens and the
heavy hitters, the entries with the largest attention accumulated since they were written; Zhang et al. 2023).

How the cache holds them. Keys are cached after RoPE, so an entry's position matters only to the mask, never
to the arithmetic: per sequence and layer, each KV head compacts the entries it keeps, in position order, into
the first slots of the sequence's blocks. Every head keeps the same count, so one length per sequence (its
`kv_len`, positions minus `num_evicted_tokens`) indexes the block table as a position does for a full cache,
the attention kernels read the first `kv_len` slots as they read any prefix, and the blocks past the budget go
back to the pool. Eviction takes a block's worth (block_size entries) at once, when the cache is full
(kv_len == budget) and a token must be written: the copy of the kept entries (O(budget) a layer) is paid once
every block_size tokens rather than every token, and the held blocks never exceed ceil(budget / block_size).
Prefill chunks stop at the budget, so a prompt is written chunk by chunk with the same evictions, at the same
positions, as a decode of it token by token would make.

Accumulated scores: after each step's attention, each query row's softmax over the entries it saw (float64,
recomputed from the cached keys, summed over the query heads of a KV head) is added to its KV head's scores
row by row, in position order, with the same shapes as a decode row: a sequence keeps the same entries
whatever else is in the step and however its prompt is chunked. A policy sequence neither reads nor publishes
the prefix cache: a hit would skip the queries that give its prefix their scores, and a compacted block no
longer holds the tokens its hash names. Forked samples share blocks; a block that is shared when its holder
evicts is replaced by a private one (the compaction rewrites every kept slot, so nothing needs copying)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.errors import RuntimeLlmcError

POLICIES = ("h2o", "streaming")
DEFAULT_SINKS = 4


@dataclass(frozen=True)
class KVPolicy:
    """`budget`: KV entries a sequence keeps per layer and KV head; `sinks`: the first tokens, never evicted;
    `recent` (h2o): the newest tokens, never evicted (default: half of what the sinks leave)."""
    kind: str
    budget: int
    recent: int | None = None
    sinks: int | None = None

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise RuntimeLlmcError(f"--kv-policy {self.kind!r}: use one of {', '.join(POLICIES)} (or none)")
        for name in ("budget", "recent", "sinks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise RuntimeLlmcError(f"--kv-{name} {value!r} must be a whole number >= 0")
        if self.budget < 1:
            raise RuntimeLlmcError(f"--kv-budget {self.budget} must be at least 1 token")
        if self.kind == "streaming" and self.recent is not None:
            raise RuntimeLlmcError("--kv-recent applies to --kv-policy h2o; streaming keeps the sinks and the "
                                   "newest --kv-budget - --kv-sinks tokens")
        sinks = DEFAULT_SINKS if self.sinks is None else self.sinks
        object.__setattr__(self, "sinks", sinks)
        if self.kind == "h2o" and self.recent is None:
            object.__setattr__(self, "recent", max(self.budget - sinks, 0) // 2)
        if self.kind == "streaming":
            object.__setattr__(self, "recent", 0)

    @property
    def heavy(self) -> int:
        """Entries chosen by score (h2o) or by age (streaming): the budget less sinks and recent."""
        return self.budget - self.sinks - self.recent

    def check_block_size(self, block_size: int) -> None:
        """A block's worth of entries must be evictable when the cache is full."""
        if self.heavy < block_size:
            raise RuntimeLlmcError(
                f"--kv-budget {self.budget} less --kv-sinks {self.sinks} and --kv-recent {self.recent} leaves "
                f"{self.heavy} evictable entries, fewer than one block of {block_size}; raise --kv-budget or "
                "lower --kv-recent/--kv-sinks")

    def as_meta(self) -> dict:
        return {"kind": self.kind, "budget": self.budget, "recent": self.recent, "sinks": self.sinks}

    def describe(self) -> str:
        extra = f", recent {self.recent}" if self.kind == "h2o" else ""
        return f"{self.kind}: budget {self.budget} tokens per KV head, sinks {self.sinks}{extra}"


def kv_policy(value, budget: int | None = None, recent: int | None = None,
              sinks: int | None = None) -> KVPolicy | None:
    """A KVPolicy from a KVPolicy, a plan's meta dict, a kind name with the budget given apart, or None /
    "none" (the full cache)."""
    if value is None or value == "none":
        if budget is not None or recent is not None or sinks is not None:
            raise RuntimeLlmcError("--kv-budget, --kv-recent and --kv-sinks need --kv-policy h2o or streaming")
        return None
    if isinstance(value, KVPolicy):
        return value
    if isinstance(value, dict):
        return KVPolicy(value.get("kind"), value.get("budget"), value.get("recent"), value.get("sinks"))
    if not isinstance(value, str):
        raise RuntimeLlmcError(f"kv_policy={value!r}: give 'h2o', 'streaming', 'none' or a KVPolicy")
    if budget is None:
        raise RuntimeLlmcError(f"--kv-policy {value} needs --kv-budget T (KV entries kept per sequence)")
    return KVPolicy(value, budget, recent, sinks)


@dataclass
class PolicyState:
    """One sequence's policy state: per layer and KV head, the accumulated score (float64) and the position
    of the entry in each of its first `budget` slots (-1: empty)."""
    scores: torch.Tensor     # float64 [layers, kv_heads, budget]
    positions: torch.Tensor  # int64 [layers, kv_heads, budget]

    @classmethod
    def empty(cls, layers: int, kv_heads: int, budget: int) -> PolicyState:
        return cls(torch.zeros(layers, kv_heads, budget, dtype=torch.float64),
                   torch.full((layers, kv_heads, budget), -1, dtype=torch.int64))

    def clone(self) -> PolicyState:
        return PolicyState(self.scores.clone(), self.positions.clone())


def kept_slots(policy: KVPolicy, state: PolicyState, kv_len: int, count: int) -> torch.Tensor:
    """int64 [layers, kv_heads, kv_len - count]: the slots each head keeps, ascending, when `count` of its
    `kv_len` entries go. Candidates are the slots between the sinks and the `recent` newest; streaming drops
    the oldest of them, h2o the lowest accumulated scores (ties: the older first)."""
    layers, heads, _ = state.scores.shape
    first, end = policy.sinks, kv_len - policy.recent
    assert end - first >= count, (policy, kv_len, count)
    if policy.kind == "streaming":
        dropped = torch.arange(first, first + count).expand(layers, heads, count)
    else:
        order = torch.sort(state.scores[:, :, first:end], dim=-1, stable=True).indices
        dropped = order[:, :, :count] + first
    keep = torch.ones(layers, heads, kv_len, dtype=torch.bool)
    keep.scatter_(2, dropped, False)
    return keep.nonzero()[:, 2].reshape(layers, heads, kv_len - count)


def compact_state(state: PolicyState, kept: torch.Tensor) -> None:
    """Move each head's kept entries' scores and positions to its first slots; the rest empty."""
    n = kept.shape[-1]
    for t, empty in ((state.scores, 0.0), (state.positions, -1)):
        moved = t.gather(2, kept)
        t.fill_(empty)
        t[:, :, :n] = moved


def accumulate_scores(scores: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, first: int,
                      scale: float) -> None:
    """Add the attention of query rows `q` [n, heads, head_dim] (slots first .. first + n - 1, each seeing the
    slots up to its own) over `keys` [first + n, kv_heads, head_dim] to `scores` [kv_heads, budget] of one
    layer, row by row: each row's softmax in float64, summed over the query heads that read each KV head
    (query head j reads KV head j // group, as the attention kernels do)."""
    n, heads, hd = q.shape
    kv_heads = keys.shape[1]
    q64 = q.to(torch.float64).reshape(n, kv_heads, heads // kv_heads, hd)
    k64 = keys.to(torch.float64).permute(1, 2, 0)           # [kv_heads, head_dim, slots]
    for i in range(n):
        seen = first + i + 1
        p = torch.softmax(torch.bmm(q64[i], k64[:, :, :seen]) * scale, dim=-1)   # [kv_heads, group, seen]
        scores[:, :seen] += p.sum(dim=1)


__all__ = ["KVPolicy", "POLICIES", "PolicyState", "kv_policy", "kept_slots", "compact_state",
           "accumulate_scores"]
