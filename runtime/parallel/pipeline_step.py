"""One engine step through pipeline stages, as every rank runs it. The step's sequences are split
into micro-batches (contiguous runs of sequences, balanced by tokens, at most one per stage), the
same split on every rank since each derives it from the same StepBatch. A stage runs its plan on
each micro-batch in turn: its plan receives the previous stage's hidden states (recv) and posts
its own to the next stage (send, not waited for), so stage s works on micro-batch m while stage
s + 1 works on m - 1. Rank 0 then receives each micro-batch's logits from the last stage."""

from __future__ import annotations

import torch

from llmc.codegen.torch_cpu.cpu_point_to_point import receive, wait_sends
from llmc.runtime.paged_attention import StepMetadata
from llmc.runtime.parallel.step_batch import StepBatch


def micro_batches(batch: StepBatch, stages: int) -> list[tuple[int, StepBatch]]:
    """(index of its first sequence, micro-batch) for up to `stages` contiguous runs of the step's
    sequences with about equal tokens; the copy-on-write pairs go with the first."""
    count = min(stages, len(batch.seqs))
    total = sum(len(tokens) for _, tokens, _ in batch.seqs)
    bounds, running = [0], 0
    for i, (_, tokens, _) in enumerate(batch.seqs[:-1]):
        running += len(tokens)
        left = len(batch.seqs) - (i + 1)   # sequences after this one
        wanted = count - len(bounds)       # cuts still to make
        if wanted and (running * count >= total * len(bounds) or left == wanted):
            bounds.append(i + 1)
    bounds.append(len(batch.seqs))
    parts = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        sampled = [i - a for i in batch.sampled if a <= i < b]
        parts.append((a, StepBatch(batch.seqs[a:b], sampled, batch.blocks_to_copy if k == 0 else [])))
    return parts


def run_stage(batch: StepBatch, stages: int, executor, cache, attention) -> None:
    """This rank's plan on each micro-batch of the step; every send it posted has been received."""
    try:
        for _, part in micro_batches(batch, stages):
            executor.run_values(plan_inputs(part, cache, attention, executor.device), attention)
    finally:
        wait_sends()


def run_first_stage(batch: StepBatch, stages: int, executor, cache, attention, logits: dict) -> torch.Tensor:
    """Rank 0: its stage on every micro-batch, then the last stage's logits for each, returned as
    [len(batch.sampled), width] in batch.sampled order."""
    parts = micro_batches(batch, stages)
    try:
        for _, part in parts:
            executor.run_values(plan_inputs(part, cache, attention, executor.device), attention)
        out = torch.empty(len(batch.sampled), logits["width"], dtype=getattr(torch, logits["dtype"]),
                          device=executor.device)
        row_of = {seq: row for row, seq in enumerate(batch.sampled)}
        for first, part in parts:
            if part.sampled:
                got = receive((len(part.sampled), logits["width"]), out.dtype, logits.get("rank", stages - 1),
                              out.device)
                out[[row_of[first + i] for i in part.sampled]] = got
        return out
    finally:
        wait_sends()


def plan_inputs(batch: StepBatch, cache, attention, device) -> dict[str, torch.Tensor]:
    """A stage plan's inputs for one micro-batch, its attention metadata set (as StepBatch.run)."""
    cache.copy_blocks(batch.blocks_to_copy)
    ids, positions, last_row, layout = [], [], [], []
    for start, tokens, table in batch.seqs:
        ids += tokens
        positions += range(start, start + len(tokens))
        last_row.append(len(ids) - 1)
        layout.append((table, start, len(tokens)))
    attention.metadata = StepMetadata.build(layout, cache.block_size, device)
    rows = torch.tensor([last_row[i] for i in batch.sampled], dtype=torch.long, device=device)
    return {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions), "logits_indices": rows}


__all__ = ["micro_batches", "run_stage", "run_first_stage", "plan_inputs"]
