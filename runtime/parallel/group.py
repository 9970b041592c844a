"""The ranks' torch.distributed group (gloo between CPUs, NCCL between GPUs, one GPU a rank; rendezvous
on this machine's loopback) runs the plans' collectives with a timeout (LLMC_COLLECTIVE_TIMEOUT
seconds, default 60), so a rank that hangs stops the others with an error (one that dies closes its
connections, which fails them at once). Rank 0's messages
to a follower (run this step, report, stop) go down the follower's stdin: a follower may wait idle
between requests for as long as the engine does, a write to a hung follower does not block rank 0
(the step's first collective times out instead), and end of file means rank 0 is gone."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from llmc.codegen.torch_cpu.cpu_collectives import COLLECTIVE_SECONDS, use_group
from llmc.codegen.torch_cpu.cpu_point_to_point import P2P_SECONDS
from llmc.errors import RuntimeLlmcError

TIMEOUT_ENV = "LLMC_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 600.0   # a rank reads and hashes its weights before it says it loaded
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


def wait_loaded(procs: dict[int, subprocess.Popen], name: Callable[[int], str],
                timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Every started rank's one status line on its stdout (`{"loaded": true}`, or `{"error": ...}`):
    returns once each loaded, else raises naming (`name(rank)`) the first that failed or those still
    loading after `timeout_s`."""
    waiting = {p.stdout: rank for rank, p in procs.items()}
    selector = selectors.DefaultSelector()
    for stream in waiting:
        selector.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while waiting:
        ready = selector.select(timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = ", ".join(name(r) for r in sorted(waiting.values()))
            raise RuntimeLlmcError(f"{late} did not load within {timeout_s:.0f} s; the run stopped")
        for key, _ in ready:
            rank = waiting.pop(key.fileobj)
            selector.unregister(key.fileobj)
            _check_loaded(procs[rank], name(rank), key.fileobj.readline())


def _check_loaded(proc: subprocess.Popen, name: str, line: bytes) -> None:
    try:
        status = json.loads(line)
    except ValueError:
        status = {}
    if not isinstance(status, dict) or status.get("loaded") is not True:
        why = status.get("error") if isinstance(status, dict) else None
        raise RuntimeLlmcError(f"{name} failed to load: {why or f'it exited with code {proc.wait()} before loading'}")


def process_group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """This rank's device: the CPU, or its own GPU, the `local_rank`-th of this machine (made current)."""
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise RuntimeLlmcError(f"rank {local_rank} of this machine needs GPU {local_rank}, but it has "
                               f"{torch.cuda.device_count()}; run at most one rank per GPU on a machine")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def join_group(rank: int, world_size: int, port: int, timeout_s: float, backend: str = "gloo") -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def leave_group() -> None:
    use_group(None)  # a pipeline stage's tp group goes with the default one
    if dist.is_initialized():
        dist.destroy_process_group()


def send(streams, kind: int, payload: torch.Tensor | None = None) -> None:
    """Rank 0: tell every follower (its stdin) what comes next, with an int64 payload."""
    data = torch.tensor([kind, 0 if payload is None else payload.numel()], dtype=torch.int64).numpy().tobytes()
    if payload is not None:
        data += payload.to(torch.int64).numpy().tobytes()
    for stream in streams:
        stream.write(data)
        stream.flush()


def receive(stream) -> tuple[int, torch.Tensor | None]:
    """A follower: rank 0's next message (kind, payload); STOP at end of file (rank 0 is gone)."""
    header = stream.read(16)
    if len(header) < 16:
        return STOP, None
    kind, size = torch.frombuffer(bytearray(header), dtype=torch.int64).tolist()
    if not size:
        return kind, None
    body = stream.read(8 * size)
    if len(body) < 8 * size:
        return STOP, None
    return kind, torch.frombuffer(bytearray(body), dtype=torch.int64)


def own_stats() -> torch.Tensor:
    """This rank's seconds in all_reduce and all_gather, and its resident memory in bytes (now: a
    follower's peak would count the memory of the process it was forked from)."""
    rss = psutil.Process().memory_info().rss
    return torch.tensor([COLLECTIVE_SECONDS["all_reduce"], COLLECTIVE_SECONDS["all_gather"], float(rss),
                         P2P_SECONDS["send"] + P2P_SECONDS["recv"]], dtype=torch.float64)


def gather_stats() -> list[dict]:
    """Every rank (rank 0 after send(REPORT)): all ranks' own_stats, in rank order."""
    stats = own_stats()
    if dist.get_backend() == "nccl":  # NCCL gathers GPU tensors only
        stats = stats.cuda()
    parts = [torch.zeros_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, stats)
    return [{"rank": r, "all_reduce_s": round(p[0].item(), 4), "all_gather_s": round(p[1].item(), 4),
             "rss_bytes": int(p[2].item()), "send_recv_s": round(p[3].item(), 4)} for r, p in enumerate(parts)]
