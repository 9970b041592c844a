"""Who is who in a disaggregated server's torch.distributed group: rank 0 is the router, the prefill
engines come next and the decode engines last (`Roles`, from `--disaggregate prefill:P,decode:D`);
every rank joins the group's two process groups (`join_groups`) and writes its log lines the same way."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from llmc.errors import RuntimeLlmcError

ROUTER = 0                   # the router's rank; prefill engines are ranks 1 .. P, decode engines the next D
# An idle rank waits for messages as long as the server runs: a dead peer closes its connections, which
# fails the waits at once; a hung one is found by its missing heartbeats (liveness.py).
WAIT = timedelta(days=365)


@dataclass(frozen=True)
class Roles:
    prefill: int
    decode: int

    @property
    def world(self) -> int:
        return 1 + self.prefill + self.decode

    @property
    def engine_ranks(self) -> list[int]:
        return list(range(1, self.world))

    @property
    def prefill_ranks(self) -> list[int]:
        return list(range(1, 1 + self.prefill))

    @property
    def decode_ranks(self) -> list[int]:
        return list(range(1 + self.prefill, self.world))

    def role(self, rank: int) -> str:
        return "prefill" if rank in self.prefill_ranks else "decode"

    def name(self, rank: int) -> str:
        """The engine's name in metrics and messages: prefill-0, decode-1, ..."""
        role = self.role(rank)
        return f"{role}-{rank - (1 if role == 'prefill' else 1 + self.prefill)}"

    def __str__(self) -> str:
        return f"prefill:{self.prefill},decode:{self.decode}"


def parse_roles(text: str) -> Roles:
    """'prefill:P,decode:D' (both, each at least 1, in either order)."""
    counts: dict[str, int] = {}
    for part in str(text).split(","):
        role, _, count = part.strip().partition(":")
        if role not in ("prefill", "decode"):
            raise RuntimeLlmcError(f"--disaggregate {text!r}: unknown role {role!r}; give prefill:N,decode:M "
                                   f"(e.g. prefill:1,decode:1)")
        if role in counts:
            raise RuntimeLlmcError(f"--disaggregate {text!r}: {role} is given twice; give each role once")
        if not count.strip().isdigit() or int(count) < 1:
            raise RuntimeLlmcError(f"--disaggregate {text!r}: {role} needs a whole number of engines >= 1, "
                                   f"not {count!r}")
        counts[role] = int(count)
    missing = [r for r in ("prefill", "decode") if r not in counts]
    if missing:
        raise RuntimeLlmcError(f"--disaggregate {text!r}: no {missing[0]} engines; give prefill:N,decode:M")
    return Roles(counts["prefill"], counts["decode"])


def join_groups(rank: int, world: int, init_method: str, kv_backend: str):
    """Join the server's process group (gloo: the messages) and its engines' KV group (gloo, or NCCL
    between GPUs); every rank, the router too, calls this. Returns the KV group."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=WAIT)
    return dist.new_group(list(range(1, world)), backend=kv_backend, timeout=WAIT)


def log(line: str) -> None:
    print(f"llmc serve: {line}", file=sys.stderr, flush=True)


def first_line(error: Exception) -> str:
    return ((str(error).strip().splitlines() or [type(error).__name__])[0])[:160]
