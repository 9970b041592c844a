"""CPU kernels of the pipeline's point-to-point ops (compiler/ops.py `send`, `recv`) over the default
torch.distributed group, which runtime/parallel/ sets up with a timeout. `send` posts an isend and
returns at once, so a stage goes on with its next micro-batch while the next stage receives; the
runtime waits for every posted send at the end of a step (wait_sends). Time spent is added to
P2P_SECONDS, which `llmc bench` reports per rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from llmc.codegen.torch_cpu.cpu_kernels import kernel
from llmc.compiler.ops import TORCH_DTYPES
from llmc.errors import RuntimeLlmcError

P2P_SECONDS = {"send": 0.0, "recv": 0.0}
_POSTED: list = []   # (work, tensor): a posted send keeps its tensor alive until it completes


def _check_group(op: str, peer: int) -> None:
    if not dist.is_initialized() or peer >= dist.get_world_size():
        raise RuntimeLlmcError(f"{op} with rank {peer} found no process group holding it; a pipeline-parallel "
                               f"plan runs through its artifact (llmc.load / llmc run), which starts its ranks")


@kernel("send")
def send(x, *, peer, **attrs):
    _check_group("send", peer)
    if x.numel():  # a micro-batch that samples no row sends no logits (rank 0 expects none)
        start = time.perf_counter()
        data = x.contiguous()
        _POSTED.append((dist.isend(data, peer), data))
        P2P_SECONDS["send"] += time.perf_counter() - start
    return [x]


@kernel("recv")
def recv(positions, *, peer, hidden, dtype, **attrs):
    _check_group("recv", peer)
    return [receive((positions.shape[0], hidden), TORCH_DTYPES[dtype], peer, positions.device)]


def receive(shape: tuple[int, ...], dtype: torch.dtype, peer: int, device="cpu") -> torch.Tensor:
    """A tensor of `shape` on `device` from rank `peer` (blocking, within the group's timeout)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    start = time.perf_counter()
    dist.recv(out, peer)
    P2P_SECONDS["recv"] += time.perf_counter() - start
    return out


def wait_sends() -> None:
    """Wait for every send posted since the last call (the next stage received it)."""
    start = time.perf_counter()
    try:
        for work, _ in _POSTED:
            work.wait()
    finally:
        _POSTED.clear()
        P2P_SECONDS["send"] += time.perf_counter() - start


__all__ = ["P2P_SECONDS", "receive", "wait_sends"]
