"""Runs the artifact's plan on one scheduled step: packs prefill chunks and decode tokens
into one batch without padding, points attention at the paged KV cache, and returns the
logits of the sequences that sample this step."""

from __future__ import annotations

import torch

from llmc.runtime.draft_tree import DraftTree
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.kv_policy import KVPolicy, PolicyState, compact_state, kept_slots
from llmc.runtime.paged_attention import PagedKVCache, StepMetadata
from llmc.runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, executor: PlanExecutor, cache: PagedKVCache):
        self.executor = executor
        self.cache = cache
        self.attention = executor.paged_backend(cache)
        self.kv_policy: KVPolicy | None = None   # set by the engine (runtime/kv_policy.py)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], sampled: list[Sequence],
                blocks_to_copy: list[tuple[int, int]], drafts: dict[int, list[int]] | None = None,
                borrow: bool = False, prompt_rows: dict[int, int] | None = None,
                evictions: list[tuple[Sequence, int, list[int]]] | None = None) -> torch.Tensor:
        """logits [rows, vocab]: one row per `sampled` sequence, in order, then for each sequence
        with `drafts` (speculative decoding; its drafts are fed after its known tokens) 1 + k rows:
        the logits after its last known token and after each of its k drafts; then for each sequence in
        `prompt_rows` (seq_id -> count) the rows of the first `count` tokens of its chunk (prompt
        logprobs). With `borrow` they may be a buffer the next call overwrites (PlanExecutor.run_values).
        `evictions`: a KV policy's (sequence, entries evicted, its table before), compacted first."""
        drafts = drafts or {}
        for seq, count, old_table in evictions or ():
            self._compact(seq, count, old_table)
        self.cache.copy_blocks(blocks_to_copy)
        self.attention.scored = [] if self.kv_policy is not None and self.kv_policy.kind == "h2o" else None
        ids, positions, last_row, first_row, layout, trees = [], [], {}, {}, [], {}
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            known = seq.token_ids[start:start + n]
            ids += known + drafts.get(seq.seq_id, [])[:n - len(known)]
            tree = drafts.get(seq.seq_id)
            if isinstance(tree, DraftTree):   # its nodes sit at their depth's position
                trees[len(ids) - n] = (tree, start)
                positions += [start] + [start + depth for depth in tree.depths()]
            else:
                positions += range(start, start + n)
            last_row[seq.seq_id] = len(ids) - 1
            first_row[seq.seq_id] = len(ids) - n
            layout.append((seq.block_table, start - seq.num_evicted_tokens, n))   # slots: past evicted entries
            if self.kv_policy is not None:
                self._track(seq, len(ids) - n, n)
        device = self.executor.device
        self.attention.metadata = meta = StepMetadata.build(layout, self.cache.block_size, device)
        for chunk in self.attention.metadata.prefills:
            if chunk.q_start in trees:
                tree, start = trees[chunk.q_start]
                chunk.visible = tree.visible(start, device)
        wanted = [last_row[s.seq_id] for s in sampled]
        for seq_id, tokens in drafts.items():
            wanted += range(last_row[seq_id] - len(tokens), last_row[seq_id] + 1)
        for seq_id, count in (prompt_rows or {}).items():
            wanted += range(first_row[seq_id], first_row[seq_id] + count)
        rows = torch.tensor(wanted, dtype=torch.long, device=device)
        inputs = {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions), "logits_indices": rows}
        graph = self.executor.decode_graph
        if graph is not None and graph.native_first and self.executor.native_decode is not None \
                and meta.native_step(self.cache.block_size) is not None:
            graph = None   # the native decode program takes this step (the walk runs it)
        if self.attention.scored:
            graph = None   # an H2O policy reads each layer's queries (runtime/kv_policy.py)
        if graph is not None and not trees and graph.serves(meta, self.cache):   # one ORT run for the step
            logits = graph(inputs, meta, self.cache)
            return logits if "logits_indices" in graph.plan_inputs else logits[rows]
        if "logits_indices" not in self.executor.plan.inputs:  # plans whose LM head could not be split
            return self.executor.run(inputs["input_ids"], inputs["positions"], self.attention)[rows]
        return self.executor.run_values(inputs, self.attention, borrow)["logits"]

    def _track(self, seq: Sequence, row: int, n: int) -> None:
        """A policy sequence's n new entries: their positions, and for H2O the rows whose attention scores them."""
        state, first = self.kv_state_for(seq), seq.kv_len
        state.positions[:, :, first:first + n] = torch.arange(seq.num_computed_tokens,
                                                                     seq.num_computed_tokens + n)
        if self.attention.scored is not None:
            used = -(-(first + n) // self.cache.block_size)
            self.attention.scored.append((state, row, first, n, torch.tensor(seq.block_table[:used])))

    def kv_state_for(self, seq: Sequence) -> PolicyState:
        if seq.kv_state is None:
            seq.kv_state = PolicyState.empty(len(self.cache.k_cache), self.cache.num_kv_heads, self.kv_policy.budget)
        return seq.kv_state

    def _compact(self, seq: Sequence, count: int, old_table: list[int]) -> None:
        """Keep each head's chosen entries of a full policy sequence in its first slots (runtime/kv_policy.py)."""
        bs, state = self.cache.block_size, self.kv_state_for(seq)
        kept = kept_slots(self.kv_policy, state, seq.kv_len + count, count)
        old = torch.tensor(old_table)
        src = old[kept // bs] * bs + kept % bs
        new = torch.arange(kept.shape[-1])
        dst = torch.tensor(seq.block_table)[new // bs] * bs + new % bs
        self.cache.compact(src, dst)
        compact_state(state, kept)
