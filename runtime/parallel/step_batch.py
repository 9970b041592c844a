"""One engine step as every rank runs it: each scheduled sequence's new tokens, their first
position and its block table, which rows sample, and the copy-on-write block pairs. Rank 0 packs
it into one int64 tensor and sends it to the followers (no pickle crosses the pipe); every rank
then runs it against its own plan and KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.runtime.paged_attention import StepMetadata


@dataclass
class StepBatch:
    seqs: list[tuple[int, list[int], list[int]]]    # (start, new token ids, block table) in batch order
    sampled: list[int]                              # indices into seqs whose last token samples
    blocks_to_copy: list[tuple[int, int]]

    @classmethod
    def from_schedule(cls, scheduled, sampled, blocks_to_copy) -> StepBatch:
        """From the scheduler's (sequence, new tokens) pairs and the sequences that sample."""
        index = {seq.seq_id: i for i, (seq, _) in enumerate(scheduled)}
        seqs = [(seq.num_computed_tokens, list(seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n]),
                 list(seq.block_table)) for seq, n in scheduled]
        return cls(seqs, [index[s.seq_id] for s in sampled], [tuple(p) for p in blocks_to_copy])

    def encode(self) -> torch.Tensor:
        """[len(seqs), len(sampled), len(blocks_to_copy), then per seq: start, tokens, blocks,
        *tokens, *blocks; then the sampled indices; then the copy pairs]."""
        flat = [len(self.seqs), len(self.sampled), len(self.blocks_to_copy)]
        for start, tokens, table in self.seqs:
            flat += [start, len(tokens), len(table), *tokens, *table]
        flat += self.sampled
        flat += [i for pair in self.blocks_to_copy for i in pair]
        return torch.tensor(flat, dtype=torch.int64)

    @classmethod
    def decode(cls, packed: torch.Tensor) -> StepBatch:
        values = packed.tolist()
        n_seqs, n_sampled, n_copies = values[:3]
        at, seqs = 3, []
        for _ in range(n_seqs):
            start, n, n_blocks = values[at:at + 3]
            at += 3
            seqs.append((start, values[at:at + n], values[at + n:at + n + n_blocks]))
            at += n + n_blocks
        sampled = values[at:at + n_sampled]
        copies = values[at + n_sampled:at + n_sampled + 2 * n_copies]
        return cls(seqs, sampled, list(zip(copies[::2], copies[1::2])))

    def run(self, executor, cache, attention) -> torch.Tensor:
        """logits [len(sampled), vocab] from this rank's plan (its collectives meet the other ranks')."""
        cache.copy_blocks(self.blocks_to_copy)
        ids, positions, last_row, layout = [], [], [], []
        for start, tokens, table in self.seqs:
            ids += tokens
            positions += range(start, start + len(tokens))
            last_row.append(len(ids) - 1)
            layout.append((table, start, len(tokens)))
        device = executor.device
        attention.metadata = StepMetadata.build(layout, cache.block_size, device)
        rows = torch.tensor([last_row[i] for i in self.sampled], dtype=torch.long, device=device)
        inputs = {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions), "logits_indices": rows}
        return executor.run_values(inputs, attention)["logits"]
