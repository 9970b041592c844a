"""The server's queue in front of the engine. Requests wait here until the engine has room and
leave by priority (higher first, as the engine orders them), then fairly between users: weighted
fair queueing on tokens, self-clocked (Golestani, INFOCOM 1994), so a user's request is tagged
with the tokens that user has queued before it, and one user's hundred requests cannot starve
another user's single one. A tag is what deficit round-robin computes with an infinitely small
quantum, without rounds to iterate."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from llmc.runtime.server.protocol import ApiError


@dataclass(order=True)
class _Entry:
    key: tuple
    job: object = field(compare=False)
    live: bool = field(default=True, compare=False)


class FairQueue:
    """Jobs with `.user` (str), `.priority` (int), `.cost` (tokens) and `.prompt_tokens` (int)."""

    def __init__(self):
        self._heap: list[_Entry] = []
        self._entries: dict[int, _Entry] = {}   # by id(job)
        self._finish: dict[str, float] = {}     # each user's last virtual finish tag
        self._clock = 0.0                       # the tag of the job served last
        self._order = itertools.count()
        self.prompt_tokens = 0                  # of the jobs waiting, for TTFT predictions

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, job) -> None:
        start = max(self._clock, self._finish.get(job.user, 0.0))
        self._finish[job.user] = start + job.cost
        entry = _Entry((-job.priority, start + job.cost, next(self._order)), job)
        heapq.heappush(self._heap, entry)
        self._entries[id(job)] = entry
        self.prompt_tokens += job.prompt_tokens

    def pop(self):
        """The next job to admit; None when empty."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry.live:
                self._clock = entry.key[1]
                self._forget(entry.job)
                return entry.job
        return None

    def remove(self, job) -> bool:
        """Take a waiting job out (its client left); False if it is not waiting."""
        entry = self._entries.get(id(job))
        if entry is None:
            return False
        entry.live = False
        self._forget(job)
        return True

    def drain(self) -> list:
        """Every waiting job, in admission order, leaving the queue empty."""
        jobs = []
        while (job := self.pop()) is not None:
            jobs.append(job)
        return jobs

    def _forget(self, job) -> None:
        del self._entries[id(job)]
        self.prompt_tokens -= job.prompt_tokens
        if not self._entries:   # idle: users' past tags no longer matter
            self._finish.clear()


# -- the refusals a server's admission answers (one engine's loop and the disaggregation router alike) ----
def draining_refusal() -> ApiError:
    return ApiError(503, "the server is shutting down and takes no new requests; send it to another replica",
                    kind="service_unavailable")


def queue_full_refusal(waiting: int, max_queue: int, headers: dict | None = None) -> ApiError:
    return ApiError(429, f"the server's queue is full ({waiting} requests waiting, --max-queue {max_queue}); "
                    f"retry later", kind="rate_limit_exceeded", headers=headers)


def slo_refusal(predicted: float, slo_seconds: float, headers: dict | None = None) -> ApiError:
    return ApiError(429, f"the predicted time to first token, {predicted * 1e3:.0f} ms, is over --ttft-slo-ms "
                    f"{slo_seconds * 1e3:g}; retry later", kind="rate_limit_exceeded", headers=headers)
