"""What each rank runs of one engine step, by the artifact's layout (manifest["parallel"]): with
pipeline stages, its stage on every micro-batch (rank 0 also receives the last stage's logits);
tensor-parallel only, its plan on the whole batch (whose all_gather makes the logits whole)."""

from __future__ import annotations

from typing import Callable

import torch

from llmc.runtime.parallel.pipeline_step import run_first_stage, run_stage
from llmc.runtime.parallel.step_batch import StepBatch


def lead_step(parallel: dict, executor, cache, attention) -> Callable[[StepBatch], torch.Tensor]:
    """Rank 0's part of a step: the batch's logits [len(sampled), vocab]."""
    stages = parallel.get("pp", 1)
    if stages > 1:
        return lambda batch: run_first_stage(batch, stages, executor, cache, attention, parallel["logits"])
    return lambda batch: batch.run(executor, cache, attention)


def follow_step(parallel: dict, executor, cache, attention) -> Callable[[StepBatch], object]:
    """A follower's part of a step (what it returns is not used)."""
    stages = parallel.get("pp", 1)
    if stages > 1:
        return lambda batch: run_stage(batch, stages, executor, cache, attention)
    return lambda batch: batch.run(executor, cache, attention)


__all__ = ["lead_step", "follow_step"]
