"""Engine metrics for benchmarks and serving: queue and batch sizes, KV block usage,
prefix-cache hits, preemptions, token counters, latency samples and speculative decoding's
acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


@dataclass
class SpeculativeMetrics:
    """Speculative decoding: a draft is one sequence's drafts verified in one step."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)   # drafts at position j
    accepted_per_position: list[int] = field(default_factory=list)
    steps_speculated: int = 0    # steps with decoding sequences in which at least one verified drafts
    steps_plain: int = 0         # steps with decoding sequences in which none did
    stood_aside: dict[str, int] = field(default_factory=dict)   # why a sequence decoded plainly, per step

    def on_proposed(self, decoding: int, drafting: int) -> None:
        if decoding:
            self.steps_speculated += drafting > 0
            self.steps_plain += drafting == 0

    def on_aside(self, reason: str) -> None:
        self.stood_aside[reason] = self.stood_aside.get(reason, 0) + 1

    def on_verified(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(num_drafts):
            self.proposed_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
                "acceptance_rate_per_position": [a / p for a, p in zip(self.accepted_per_position,
                                                                       self.proposed_per_position)],
                "mean_accepted_length": self.num_accepted_tokens / self.num_drafts if self.num_drafts else None,
                "steps_speculated": self.steps_speculated, "steps_plain": self.steps_plain,
                "stood_aside": dict(sorted(self.stood_aside.items()))}


@dataclass
class EngineMetrics:
    steps: int = 0
    step_seconds: list[float] = field(default_factory=list)
    batch_tokens: list[int] = field(default_factory=list)
    batch_seqs: list[int] = field(default_factory=list)     # sequences in each step's batch
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    peak_kv_usage: float = 0.0
    kv_waste_samples: list[float] = field(default_factory=list)
    computed_tokens: int = 0             # tokens run through the model (prefill + decode)
    generation_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    preemptions: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    finished_requests: int = 0
    speculative: SpeculativeMetrics | None = None   # set when the engine speculates

    def on_step(self, out, seconds: float, scheduler, block_manager) -> None:
        self.steps += 1
        self.step_seconds.append(seconds)
        self.batch_tokens.append(out.num_batched_tokens)
        self.batch_seqs.append(len(out.scheduled))
        self.generation_tokens += len(out.sampled)
        self.computed_tokens += out.num_batched_tokens
        self.num_waiting, self.num_running = scheduler.num_waiting, scheduler.num_running
        self.kv_blocks_free = block_manager.num_free_blocks
        self.kv_blocks_used = block_manager.num_blocks - self.kv_blocks_free
        self.peak_kv_usage = max(self.peak_kv_usage, block_manager.usage)
        if block_manager.seqs:
            self.kv_waste_samples.append(block_manager.kv_waste)
        self.prefix_hit_tokens = scheduler.num_prefix_hit_tokens
        self.prefix_query_tokens = scheduler.num_admitted_tokens
        self.preemptions = scheduler.num_preemptions

    def on_finish(self, m) -> None:
        self.finished_requests += 1
        for name in ("ttft", "tpot", "e2e"):
            value = getattr(m, name)
            if value is not None:
                getattr(self, name).append(value)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def kv_waste(self) -> float:
        return float(np.mean(self.kv_waste_samples)) if self.kv_waste_samples else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "num_waiting": self.num_waiting, "num_running": self.num_running,
                "kv_blocks_used": self.kv_blocks_used, "kv_blocks_free": self.kv_blocks_free,
                "peak_kv_usage": self.peak_kv_usage, "kv_waste": self.kv_waste,
                "computed_tokens": self.computed_tokens, "generation_tokens": self.generation_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens, "prefix_hit_rate": self.prefix_hit_rate,
                "preemptions": self.preemptions, "finished_requests": self.finished_requests,
                "ttft_ms": percentiles(self.ttft, 1e3), "tpot_ms": percentiles(self.tpot, 1e3),
                "e2e_ms": percentiles(self.e2e, 1e3),
                "speculative": self.speculative.to_dict() if self.speculative else None}
