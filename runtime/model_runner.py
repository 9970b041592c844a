"""Runs the artifact's plan on one scheduled step: packs prefill chunks and decode tokens
into one batch without padding, points attention at the paged KV cache, and returns the
logits of the sequences that sample this step."""

from __future__ import annotations

import torch

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
                blocks_to_copy: list[tuple[int, int]]) -> torch.Tensor:
        """logits [len(sampled), vocab], rows in `sampled` order."""
        self.cache.copy_blocks(blocks_to_copy)
        ids, positions, last_row, layout = [], [], {}, []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            last_row[seq.seq_id] = len(ids) - 1
            layout.append((seq.block_table, start, n))
        device = self.executor.device
        self.attention.metadata = StepMetadata.build(layout, self.cache.block_size, device)
        rows = torch.tensor([last_row[s.seq_id] for s in sampled], dtype=torch.long, device=device)
        inputs = {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions), "logits_indices": rows}
        if "logits_indices" not in self.executor.plan.inputs:  # plans whose LM head could not be split
            return self.executor.run(inputs["input_ids"], inputs["positions"], self.attention)[rows]
        return self.executor.run_values(inputs, self.attention)["logits"]
