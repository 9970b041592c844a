"""--tp with --pp: each pipeline stage's tp ranks (rank = stage * tp + tp_rank) run their plans'
all_reduce / all_gather in a process group of their own, so two stages' collectives never mix;
hidden states and logits go point to point in the default group (cpu_point_to_point)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from llmc.codegen.torch_cpu.cpu_collectives import use_group


def join_stage_groups(tp: int, pp: int, timeout_s: float) -> None:
    """Every rank of the default group calls this (new_group is collective), each stage's in order."""
    if tp == 1:
        return
    rank = dist.get_rank()
    for stage in range(pp):
        # the default group's backend: gloo, or NCCL between GPUs
        group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timedelta(seconds=timeout_s))
        if rank // tp == stage:
            use_group(group)


__all__ = ["join_stage_groups"]
