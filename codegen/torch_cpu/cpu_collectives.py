"""CPU kernels of the collective ops (compiler/ops.py): torch.distributed calls on the default
process group, which the runtime's parallel launcher (runtime/parallel/) sets up with a timeout,
so a rank that died makes the others' collective fail instead of hang. Each call's wall time is
added to COLLECTIVE_SECONDS, which `llmc bench` reports per rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from llmc.codegen.torch_cpu.cpu_kernels import kernel
from llmc.errors import RuntimeLlmcError

COLLECTIVE_SECONDS = {"all_reduce": 0.0, "all_gather": 0.0}
_GROUP = None   # the collectives' process group: the default one, or this rank's pipeline stage's (--tp with --pp)


def use_group(group) -> None:
    """Run this process's collectives in `group` (None: the default group)."""
    global _GROUP
    _GROUP = group


def _check_group(op: str, world_size: int) -> None:
    if world_size == 1:
        return
    if not dist.is_initialized() or dist.get_world_size(_GROUP) != world_size:
        have = dist.get_world_size(_GROUP) if dist.is_initialized() else "no"
        raise RuntimeLlmcError(f"{op} over {world_size} ranks found {have} process group of that size; a "
                               f"tensor-parallel plan runs through its artifact (llmc.load / llmc run), which "
                               f"starts its ranks")


@kernel("all_reduce")
def all_reduce(x, *, world_size, **attrs):
    return [_timed("all_reduce", world_size, x, _summed)]


@kernel("all_gather")
def all_gather(x, *, world_size, **attrs):
    return [_timed("all_gather", world_size, x, _joined)]


def _summed(x, world_size: int):
    out = x.contiguous().clone()  # plan values are not written in place
    dist.all_reduce(out, group=_GROUP)
    return out


def _joined(x, world_size: int):
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=_GROUP)
    return torch.cat(parts, dim=-1)


def _timed(op: str, world_size: int, x, communicate):
    """communicate(x) across the group (x itself in a world of one), its time added up."""
    _check_group(op, world_size)
    if world_size == 1:
        return x
    start = time.perf_counter()
    out = communicate(x, world_size)
    COLLECTIVE_SECONDS[op] += time.perf_counter() - start
    return out


# the pipeline's point-to-point kernels register themselves as cpu.send / cpu.recv
from llmc.codegen.torch_cpu import cpu_point_to_point  # noqa: E402,F401
