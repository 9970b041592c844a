"""Runs the artifact's plan on one scheduled step: packs prefill chunks and decode tokens
into one batch without padding, points attention at the paged KV cache, and returns the
logits of the sequences that sample this step."""

from __future__ import annotations

import torch

from llmc.runtime.draft_tree import DraftTree
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.paged_attention import PagedKVCache, StepMetadata
from llmc.runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, executor: PlanExecutor, cache: PagedKVCache):
        self.executor = executor
        self.cache = cache
        self.attention = executor.paged_backend(cache)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], sampled: list[Sequence],
                blocks_to_copy: list[tuple[int, int]], drafts: dict[int, list[int]] | None = None,
                borrow: bool = False, prompt_rows: dict[int, int] | None = None) -> torch.Tensor:
        """logits [rows, vocab]: one row per `sampled` sequence, in order, then for each sequence
        with `drafts` (speculative decoding; its drafts are fed after its known tokens) 1 + k rows:
        the logits after its last known token and after each of its k drafts; then for each sequence in
        `prompt_rows` (seq_id -> count) the rows of the first `count` tokens of its chunk (prompt
        logprobs). With `borrow` they may be a buffer the next call overwrites (PlanExecutor.run_values)."""
        drafts = drafts or {}
        self.cache.copy_blocks(blocks_to_copy)
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
            layout.append((seq.block_table, start, n))
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
        if graph is not None and not trees and graph.serves(meta, self.cache):   # one ORT run for the step
            logits = graph(inputs, meta, self.cache)
            return logits if "logits_indices" in graph.plan_inputs else logits[rows]
        if "logits_indices" not in self.executor.plan.inputs:  # plans whose LM head could not be split
            return self.executor.run(inputs["input_ids"], inputs["positions"], self.attention)[rows]
        return self.executor.run_values(inputs, self.attention, borrow)["logits"]
