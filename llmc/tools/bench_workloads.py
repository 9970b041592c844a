"""Text workloads for `llmc bench --workload`, read from samples/: "grounded" requests whose answers
quote a long prompt (samples/grounded.jsonl: code edits that give a function back changed, quotes
of a docstring or of a passage's sentence, summaries in the passage's own wording: what prompt
lookup is for), and "open" ones whose answers are free (samples/open.jsonl: story continuations,
open questions). Each line is {"task": ..., "prompt": ...}."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llmc.errors import RuntimeLlmcError

TEXT_WORKLOADS = ("grounded", "open")
SAMPLES = Path(__file__).resolve().parents[2] / "samples"   # the source tree's samples/ (llmc/tools/ is two below)


def text_prompts(kind: str, num_requests: int, seed: int) -> list[str]:
    """`num_requests` prompts of workload `kind`, drawn reproducibly by `seed` (each prompt once
    before any repeats)."""
    if kind not in TEXT_WORKLOADS:
        raise RuntimeLlmcError(f"bench: unknown workload {kind!r}; use random, {', '.join(TEXT_WORKLOADS)}")
    pool = workload_prompts(kind)
    order = np.random.default_rng(seed).permutation(len(pool))
    return [pool[order[i % len(pool)]] for i in range(num_requests)]


def workload_prompts(kind: str) -> list[str]:
    """Every prompt of samples/<kind>.jsonl, in file order."""
    path = SAMPLES / f"{kind}.jsonl"
    if not path.is_file():
        raise RuntimeLlmcError(f"bench: workload file {path} is missing; it ships in the repository's samples/")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row["prompt"] for row in rows]


def grounded_prompts() -> list[str]:
    return workload_prompts("grounded")


def open_prompts() -> list[str]:
    return workload_prompts("open")
