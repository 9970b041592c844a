"""One generation stream's state: its tokens (the only store of them: the sampler, the stop
checker and the outputs read them from here), the KV blocks it owns, how much of it is
computed, and why it finished."""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

from llmc.errors import RuntimeLlmcError

_seq_ids = itertools.count()
_arrivals = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted by recompute and queued again (as vLLM)
    RUNNING = "running"  # owns KV blocks and is scheduled every step
    FINISHED = "finished"


class Sequence:
    """Tokens are one list (prompt then output), grown only by `append_token`; the KV of
    the first `num_computed_tokens` of them is in the blocks of `block_table`."""

    def __init__(self, prompt_token_ids: list[int], *, seq_id: int | None = None,
                 request_id: str | None = None, params: Any = None, priority: int = 0,
                 arrival_time: float | None = None):
        self.seq_id = next(_seq_ids) if seq_id is None else seq_id
        self.request_id = str(self.seq_id) if request_id is None else request_id
        if len(prompt_token_ids) == 0:
            raise RuntimeLlmcError(f"request {self.request_id}: the prompt has no tokens; "
                                   "pass at least one token (e.g. the BOS token)")
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params  # sampling parameters; opaque to the scheduler
        self.priority = priority  # higher runs first
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_index = next(_arrivals)  # FCFS order; ties in arrival_time broken here
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_dropped_blocks = 0  # leading entries of block_table given back to a sliding window
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, served by the prefix cache at admission
        self.uses_prefix_cache = True  # False: computes every prompt token (its prompt logprobs need them)
        # a KV policy (runtime/kv_policy.py): at most kv_cap entries cached per KV head, num_evicted_tokens given
        # up so far; the first kv_len = num_computed_tokens - num_evicted_tokens slots hold the kept ones
        self.kv_cap: int | None = None
        self.num_evicted_tokens = 0
        self.kv_state = None  # the policy's PolicyState, made by the model runner
        self.num_preemptions = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.error: str | None = None  # why the runtime refused it, when it did

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
                f"status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def live_blocks(self) -> list[int]:
        """The blocks this sequence holds: its table past the entries a sliding window dropped."""
        return self.block_table[self.num_dropped_blocks:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def kv_len(self) -> int:
        """Cache slots holding computed entries: the computed tokens less those a KV policy evicted."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def num_kv_tokens(self) -> int:
        """Cache slots every known token needs: all of them, or with a KV policy at most its cap."""
        n = len(self.token_ids) - self.num_evicted_tokens
        return n if self.kv_cap is None else min(n, self.kv_cap)

    def num_blocks(self, block_size: int) -> int:
        """KV blocks needed to hold every known token (with a KV policy, at most its cap's worth)."""
        return -(-self.num_kv_tokens // block_size)

    def block_token_ids(self, i: int, block_size: int) -> list[int]:
        """Token ids held by block i of the table (the last one may be partial)."""
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        """The one place a sample's token list grows."""
        self.token_ids.append(token_id)

    def fork(self, new_id: int, num_tokens: int | None = None) -> Sequence:
        """Another sample of the same request: its own copy of the block table and of the
        first `num_tokens` tokens (all by default; at least the prompt and the computed
        ones). The block manager's `fork` takes the extra references on the shared blocks."""
        num_tokens = self.num_tokens if num_tokens is None else num_tokens
        assert max(self.num_computed_tokens, self.num_prompt_tokens) <= num_tokens <= self.num_tokens, \
            (num_tokens, self)
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = new_id
        child.token_ids = self.token_ids[:num_tokens]
        child.block_table = list(self.block_table)
        child.kv_state = None if self.kv_state is None else self.kv_state.clone()
        return child
