"""The ranks' torch.distributed groups (gloo, on this machine's loopback): the default group runs
the plans' collectives with a timeout (LLMC_COLLECTIVE_TIMEOUT seconds, default 60), so a rank that
hangs stops the others with an error (one that dies closes its connections, which fails them at
once); a control group with a long timeout carries rank 0's messages to the followers, who may
wait idle between requests for as long as the engine does."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from llmc.codegen.cpu_collectives import COLLECTIVE_SECONDS
from llmc.errors import RuntimeLlmcError

TIMEOUT_ENV = "LLMC_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
IDLE_TIMEOUT = timedelta(days=30)
# rank 0's messages to the followers
STOP, STEP, REPORT = 0, 1, 2


def collective_timeout() -> float:
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e6:
        raise RuntimeLlmcError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds above 0; set it to e.g. 60")
    return seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, world_size: int, port: int, timeout_s: float):
    """Join the default group and return the control group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def send(control, kind: int, payload: torch.Tensor | None = None) -> None:
    """Rank 0: tell every follower what comes next (and its int64 payload)."""
    dist.broadcast(torch.tensor([kind, 0 if payload is None else payload.numel()]), 0, group=control)
    if payload is not None:
        dist.broadcast(payload, 0, group=control)


def receive(control) -> tuple[int, torch.Tensor | None]:
    """A follower: rank 0's next message (kind, payload)."""
    header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, 0, group=control)
    kind, size = header.tolist()
    if not size:
        return kind, None
    payload = torch.zeros(size, dtype=torch.int64)
    dist.broadcast(payload, 0, group=control)
    return kind, payload


def own_stats() -> torch.Tensor:
    """This rank's seconds in all_reduce and all_gather, and its resident memory in bytes (now: a
    follower's peak would count the memory of the process it was forked from)."""
    import psutil

    rss = psutil.Process().memory_info().rss
    return torch.tensor([COLLECTIVE_SECONDS["all_reduce"], COLLECTIVE_SECONDS["all_gather"], float(rss)],
                        dtype=torch.float64)


def gather_stats(control) -> list[dict]:
    """Rank 0 (after send(REPORT)): every rank's own_stats, in rank order."""
    parts = [torch.zeros(3, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, own_stats(), group=control)
    return [{"rank": r, "all_reduce_s": round(p[0].item(), 4), "all_gather_s": round(p[1].item(), 4),
             "rss_bytes": int(p[2].item())} for r, p in enumerate(parts)]
