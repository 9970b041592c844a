"""Who runs this step: decodes of running sequences first, then (chunked) prefills of
waiting ones by priority under a token budget; sequences join and leave every step
(in-flight batching) and the newest are preempted by recompute when KV blocks run out."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.errors import RuntimeLlmcError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.sequence import Sequence, SequenceStatus

PREEMPTION_MODES = ("recompute",)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RuntimeLlmcError(f"SchedulerConfig.{name}={value!r}: must be an integer >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise RuntimeLlmcError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_num_seqs={self.max_num_seqs}, so some decodes could never run; "
                "raise max_num_batched_tokens or lower max_num_seqs")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise RuntimeLlmcError(f"SchedulerConfig.preemption_mode={self.preemption_mode!r}: "
                                   f"use one of {PREEMPTION_MODES}")


@dataclass
class SchedulerOutput:
    """One step's work. For each (seq, n) the runner computes KV for token positions
    [seq.num_computed_tokens, seq.num_computed_tokens + n); sequences in `sampled` reach
    their last known token this step and need a next token sampled."""
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the step
    # KV policies: (seq, entries evicted, its block table before) to compact before the step, before the copies
    evictions: list[tuple[Sequence, int, list[int]]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # finished with seq.error set
    # speculative decoding: seq_id -> the draft tokens scored after its last token this step;
    # such sequences are in `speculated`, not in `sampled`
    drafts: dict[int, list[int]] = field(default_factory=dict)
    speculated: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def add(self, seq: Sequence, num_new_tokens: int, drafts: list[int] | None = None) -> None:
        self.scheduled.append((seq, num_new_tokens + len(drafts or ())))
        if drafts:
            self.drafts[seq.seq_id] = drafts
            self.speculated.append(seq)
        elif seq.num_computed_tokens + num_new_tokens == seq.num_tokens:
            self.sampled.append(seq)


def _queue_key(seq: Sequence) -> tuple:
    # Higher priority first; within a priority, preempted sequences go back to the front,
    # then first come first served.
    return (-seq.priority, seq.num_preemptions == 0, seq.arrival_index, seq.seq_id)


def _victim_key(seq: Sequence) -> tuple:
    # The lowest priority, then the latest arrival (the newest fork of a request last).
    return (seq.priority, -seq.arrival_index, -seq.seq_id)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        if block_manager.block_size != config.block_size:
            raise RuntimeLlmcError(f"SchedulerConfig.block_size={config.block_size} differs from the "
                                   f"KV cache's block_size={block_manager.block_size}; use one value")
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by _queue_key
        self.running: list[Sequence] = []
        self._rejected: list[Sequence] = []  # refused at add(), reported by the next schedule()
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the prefix cache
        self.num_admitted_tokens = 0  # prompt tokens looked up in the prefix cache

    def reset_counters(self) -> None:
        """Zero the cumulative counters EngineMetrics reads (preemptions, prefix-cache lookups)."""
        self.num_preemptions = self.num_prefix_hit_tokens = self.num_admitted_tokens = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    # --- entering and leaving ---------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        error = self._fit_error(seq)
        if error is not None:
            self._reject(seq, error, self._rejected)
        else:
            self._enqueue(seq)

    def fork(self, parent: Sequence, seq_id: int, num_tokens: int | None = None) -> Sequence:
        """Another sample of a running `parent` (its first `num_tokens` tokens, all by default),
        sharing its KV blocks; runs from the next step."""
        assert parent.status is SequenceStatus.RUNNING, f"fork of a {parent.status.name} sequence"
        child = parent.fork(seq_id, num_tokens)
        self.block_manager.fork(parent, child)
        self.running.append(child)
        return child

    def admit_prefilled(self, seq: Sequence) -> bool:
        """Take in a sequence whose prompt KV another engine computed (disaggregated decode,
        runtime/kv_transfer.py): blocks for all its tokens, all but the last counted as computed, the
        caller writing their KV from block seq.num_cached_tokens // block_size on (the ones before are
        this cache's prefix hits); it runs from the next step. False while the batch is full, the free
        blocks fall short, or preempted sequences wait (they go first)."""
        error = self._fit_error(seq)
        if error is not None:
            raise RuntimeLlmcError(error)
        bm = self.block_manager
        if self.waiting or len(self.running) >= self.config.max_num_seqs or not bm.can_allocate(seq):
            return False
        seq.uses_prefix_cache = bm.window is None   # a window's dropped blocks arrive unfilled
        bm.allocate(seq)
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of `request_id`, waiting or running, freeing its blocks."""
        seqs = [s for s in self.waiting + self.running if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        key = _queue_key(seq)
        i = next((i for i, s in enumerate(self.waiting) if _queue_key(s) > key), len(self.waiting))
        self.waiting.insert(i, seq)

    def _fit_error(self, seq: Sequence) -> str | None:
        """Why `seq` could never be scheduled, even alone; None if it can."""
        n, pool = seq.num_tokens, self.block_manager.num_blocks
        needed = seq.num_blocks(self.block_manager.block_size)
        if needed > pool and seq.num_output_tokens == 0:
            return (f"prompt of {n} tokens needs {needed} KV blocks but the cache has only {pool}; "
                    "raise --kv-memory or shorten the prompt")
        if needed > pool:
            return (f"request {seq.request_id} grew to {n} tokens (prompt and output), which needs "
                    f"{needed} KV blocks but the cache has only {pool}; raise --kv-memory or lower "
                    "max_tokens")
        limit = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and n > limit:
            return (f"sequence of {n} tokens exceeds max_num_batched_tokens={limit} with chunked "
                    "prefill off; enable chunked prefill or raise max_num_batched_tokens")
        return None

    def _reject(self, seq: Sequence, error: str, into: list[Sequence]) -> None:
        seq.error = error
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        into.append(seq)

    # --- one step ---------------------------------------------------------------------

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """`drafts`: seq_id -> draft tokens to verify after a running sequence's next token
        (speculative decoding); dropped where the token budget or the free blocks fall short."""
        out = SchedulerOutput(rejected=self._rejected)
        self._rejected = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, drafts or {})
        if not out.preempted:  # admitting now would only evict what we just preempted for
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, drafts: dict[int, list[int]]) -> int:
        # Decodes (one uncomputed token) before unfinished chunked prefills; each group by
        # priority, then arrival, so any preemption victim is still unscheduled.
        order = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, -s.priority,
                                                    s.arrival_index, s.seq_id))
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                continue
            if seq.kv_cap is not None:
                if not self._make_room(seq, out):
                    continue
                n = min(n, seq.kv_cap - seq.kv_len)
            fitting = self._fitting_drafts(seq, drafts.get(seq.seq_id, []), budget - n)
            if self._reserve_slots(seq, out, len(fitting)):
                out.add(seq, n, fitting)
                budget -= n + len(fitting)
        return budget

    def _fitting_drafts(self, seq: Sequence, drafts: list[int], budget: int) -> list[int]:
        """The drafts `seq` can verify this step: all, if it is decoding one token and the budget
        and the free blocks hold them; nothing is preempted for a draft."""
        if seq.num_uncomputed_tokens != 1 or not drafts or len(drafts) > budget:
            return []
        return drafts if self.block_manager.can_append(seq, len(drafts)) else []

    def _reserve_slots(self, seq: Sequence, out: SchedulerOutput, lookahead: int = 0) -> bool:
        """Make room for `seq`'s new tokens (and `lookahead` drafts), preempting the newest
        running sequences if blocks run out; False if `seq` itself had to go."""
        while not self.block_manager.can_append(seq, lookahead):
            victim = min(self.running, key=_victim_key)
            assert all(victim is not s for s, _ in out.scheduled), "preempting a scheduled sequence"
            self._preempt(victim, out)
            if victim is seq:
                return False
        copy = self.block_manager.append_slot(seq, lookahead)
        if copy is not None:
            out.blocks_to_copy.append(copy)
        return True

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A KV policy sequence whose cache is full gives up a block's worth of entries before it writes more
        (runtime/kv_policy.py), preempting the newest running sequences if its shared kept blocks need fresh
        ones; False if `seq` itself had to go."""
        bm = self.block_manager
        if seq.kv_len < seq.kv_cap:
            return True
        keep = -(-(seq.kv_len - bm.block_size) // bm.block_size)
        while bm.num_free_blocks < sum(bm.blocks[b].ref_count > 1 for b in seq.block_table[:keep]):
            victim = min(self.running, key=_victim_key)
            self._preempt(victim, out)
            if victim is seq:
                return False
        out.evictions.append((seq, bm.block_size, bm.evict(seq, bm.block_size)))
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute mode: drop the KV; every known token (prompt and output) becomes the
        prefill when it is admitted again."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_evicted_tokens = 0
        seq.kv_state = None
        out.evictions = [e for e in out.evictions if e[0] is not seq]
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        error = self._fit_error(seq)
        if error is not None:
            self._reject(seq, error, out.rejected)
        else:
            self._enqueue(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # Head of line blocks the queue, so priority and FCFS order hold.
            if not bm.can_allocate(seq):
                break
            if not self.config.enable_chunked_prefill and \
                    seq.num_tokens - bm.count_cached_tokens(seq) > budget:
                break
            self.waiting.pop(0)
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.num_prefix_hit_tokens += seq.num_cached_tokens
            self.num_admitted_tokens += seq.num_tokens
            n = min(seq.num_uncomputed_tokens, budget, seq.num_kv_tokens)
            out.add(seq, n)
            budget -= n

    # --- after the model ran ----------------------------------------------------------

    def update_computed(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The KV of the scheduled tokens is now in the cache: advance and hash full blocks."""
        for seq, n in scheduled:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += n
            self.block_manager.mark_full_blocks(seq)
            self.block_manager.drop_outside_window(seq)

    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[Sequence]:
        """Record a step: `token_ids[i]` is the token sampled for `out.sampled[i]`. Returns
        the sequences that grew; the caller decides which of them finish."""
        assert len(token_ids) == len(out.sampled), (len(token_ids), len(out.sampled))
        self.update_computed([(seq, n) for seq, n in out.scheduled if seq.seq_id not in out.drafts])
        grown = []
        for seq, token_id in zip(out.sampled, token_ids):
            if seq.status is SequenceStatus.RUNNING:
                seq.append_token(token_id)
                grown.append(seq)
        return grown

    def settle_verified(self, seq: Sequence) -> None:
        """After a step verified `seq`'s drafts and appended the tokens it kept: every token but
        the newest has its KV in the cache (the rejected drafts' KV is left to be overwritten);
        the blocks made for rejected drafts are freed, and newly full blocks hashed."""
        if seq.status is not SequenceStatus.RUNNING:
            return  # aborted while the step ran
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.trim(seq)
        self.block_manager.mark_full_blocks(seq)
        self.block_manager.drop_outside_window(seq)
