"""What a target step of n rows costs on this artifact and machine, against a one-row decode step: the
speculative policy's price of verifying k drafts (runtime/speculative.py). On the CPU it depends on the
kernels and on where the weights sit: SmolLM2's Q4_1 weights in the last-level cache make the native
GEMV's extra rows cost a visible share of a row each, while a model streaming its weights from DRAM
verifies a few drafts nearly free. So it is measured at load, once per (plan, machine, threads,
invariance, native kernels' source), and kept in $LLMC_CACHE/step_costs: one sequence over a short primed
context, steps of ROWS rows alternated, best of REPEATS each, relative to one row and linear in between. A measurement
taken while other processes held the cores is used by this engine only (and taken again by the next);
the cached one makes k, and with it a seeded request's random draws, the same from load to load."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import torch

from llmc.cache import busy_reason, cache_root, watch_load, write_json
from llmc.codegen.native import cpu_native
from llmc.runtime.paged_attention import StepMetadata
from llmc.runtime.roofline import cpu_model

CONTEXT = 32
ROWS = (1, 2, 4, 8, 16)   # a decode step; verification of 1, 3 and 7 drafts; a batch past the native program's 8
REPEATS = 5
FORMAT = 2                # bump when what is measured changes


@dataclass(frozen=True)
class StepCost:
    """A target step of n tokens, over a one-token decode step: measured (`table`: (rows, cost), costs
    linear between the rows measured and past the last), else 1 + jump [n > 1] + per_token (n - 1)."""
    jump: float = 0.0
    per_token: float = 0.0
    table: tuple[tuple[int, float], ...] = ()

    def of(self, n: int) -> float:
        if not self.table:
            return 1.0 + self.jump * (n > 1) + self.per_token * (n - 1)
        points = self.table
        if n <= points[0][0]:
            return points[0][1]
        for (a, ca), (b, cb) in zip(points, points[1:]):
            if n <= b:
                return ca + (cb - ca) * (n - a) / (b - a)
        (a, ca), (b, cb) = points[-2], points[-1]
        return cb + (cb - ca) / (b - a) * (n - b)


def fit(us: dict[int, float]) -> StepCost:
    """The StepCost of measured microseconds per step of n rows ({n: us}, n = 1 among them): each row
    count's time over one row's, never below a smaller row count's (a cheaper bigger step is noise)."""
    table, floor = [], 0.0
    for n in sorted(us):
        floor = max(floor, us[n] / us[1])
        table.append((n, round(floor, 3)))
    return StepCost(table=tuple(table))


def measured_step_cost(executor, backend, threads: int) -> tuple[StepCost, dict] | None:
    """(StepCost, record) for `executor`'s plan on this machine, from the cache or measured now over the
    first blocks of `backend`'s paged cache (at load: no request holds them yet); None where the cache
    has too few blocks for it."""
    blocks = -(-(CONTEXT + max(ROWS)) // backend.cache.block_size)
    if backend.cache.k_cache[0].shape[0] < blocks:
        return None
    key = {"plan": hashlib.sha256(executor.plan.to_json().encode()).hexdigest(), "cpu": cpu_model(),
           "kernels": cpu_native.timing_key(), "threads": threads, "invariant": executor.batch_invariant,
           "rows": list(ROWS), "format": FORMAT}
    text = json.dumps(key, sort_keys=True)
    path = cache_root() / "step_costs" / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
    cached = _read(path, key)
    if cached is not None:
        return fit({int(n): us for n, us in cached["us"].items()}), {**cached, "cached": True}
    with watch_load(threads) as load:
        us = _measure(executor, backend, list(range(blocks)))
    record = {"us": us, "measured": load.record}
    busy = busy_reason(load.record)
    if busy:
        record["busy"] = busy
    else:
        write_json(path, {"key": key, **record})
    return fit(us), record


def _measure(executor, backend, table: list[int]) -> dict[int, float]:
    plan, block = executor.plan, backend.cache.block_size
    ids = torch.randint(0, _vocab(executor), (CONTEXT + max(ROWS),), generator=torch.Generator().manual_seed(0))
    feed = lambda **values: {k: t for k, t in values.items() if k in plan.inputs}
    backend.metadata = StepMetadata.build([(table, 0, CONTEXT)], block)
    executor.run_values(feed(input_ids=ids[:CONTEXT], positions=torch.arange(CONTEXT),
                             logits_indices=torch.tensor([CONTEXT - 1])), backend, borrow=True)
    steps = {}
    for n in ROWS:   # each step writes the same slots with the same values: the context stays as primed
        steps[n] = (StepMetadata.build([(table, CONTEXT, n)], block),
                    feed(input_ids=ids[CONTEXT:CONTEXT + n], positions=torch.arange(CONTEXT, CONTEXT + n),
                         logits_indices=torch.arange(n)))
    best = {n: float("inf") for n in ROWS}
    for round_ in range(REPEATS + 1):   # the first round warms (packing, first touch) and is not kept
        for n, (metadata, inputs) in steps.items():
            backend.metadata = metadata
            start = time.perf_counter()
            executor.run_values(inputs, backend, borrow=True)
            if round_:
                best[n] = min(best[n], (time.perf_counter() - start) * 1e6)
    backend.metadata = None
    return {n: round(t, 1) for n, t in best.items()}


def _vocab(executor) -> int:
    """Token ids below every embedding table's rows."""
    rows = [executor.weight(step.inputs[1]).shape[0] for step in executor.plan.steps
            if "input_ids" in step.inputs and len(step.inputs) > 1 and step.inputs[1] in executor.plan.params]
    return min(rows) if rows else 2


def _read(path, key: dict) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("us"), dict) \
        and {str(n) for n in ROWS} <= set(entry["us"])
    return {"us": entry["us"], "measured": entry.get("measured")} if ok else None


__all__ = ["StepCost", "fit", "measured_step_cost", "ROWS"]
