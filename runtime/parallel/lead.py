"""Rank 0's ModelRunner for a sharded artifact, whoever started the other ranks (launch.py starts
them itself; under torchrun they were already running): each step it tells the followers the
batch, runs its own part, and returns the logits; a failed collective stops the run in one line."""

from __future__ import annotations

import torch

from llmc.errors import RuntimeLlmcError
from llmc.runtime.parallel.group import REPORT, STEP, gather_stats
from llmc.runtime.parallel.step_batch import StepBatch


class LeadRunner:
    """ModelRunner's `execute` and the ranks' report. A subclass sets `step` (rank 0's part of a
    step, steps.lead_step), and defines `tell(kind, payload=None)` (a message to every follower) and
    `_collective(work)` (runs `work` across the ranks; a failure raises one line and stops them)."""

    @torch.inference_mode()
    def execute(self, scheduled, sampled, blocks_to_copy, drafts=None, borrow=False, prompt_rows=None) -> torch.Tensor:
        """logits [len(sampled), vocab], rows in `sampled` order, as ModelRunner.execute (always the
        caller's own: gathered or received from the other ranks)."""
        if prompt_rows:
            raise RuntimeLlmcError("prompt_logprobs are not computed on a sharded (--tp, --pp) artifact yet; "
                                   "ask for them from an unsharded one")
        if drafts:
            raise RuntimeLlmcError("speculative decoding does not run on a sharded (--tp, --pp) artifact yet; "
                                   "load it without a speculative config")
        batch = StepBatch.from_schedule(scheduled, sampled, blocks_to_copy)
        return self._collective(lambda: (self.tell(STEP, batch.encode()), self.step(batch))[1])

    def rank_stats(self) -> list[dict]:
        """Each rank's time in collectives and send/recv, and its resident memory."""
        return self._collective(lambda: (self.tell(REPORT), gather_stats())[1])


__all__ = ["LeadRunner"]
