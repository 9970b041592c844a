"""Liveness-based activation memory planning: each activation gets a buffer slot, and
values whose lifetimes do not overlap share one, sized for the target's max batched tokens."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from llmc.compiler.ir import Graph, TensorType
from llmc.errors import TargetError

# A lifetime is [defining step, last use step], both inclusive: a kernel's inputs and
# outputs are live at the same step, so they never share a slot (kernels are not in place).
Lifetime = tuple[int, int]


@dataclass
class MemoryPlan:
    slot_of: dict[str, int]
    slot_bytes: list[int]
    lifetimes: dict[str, Lifetime] = field(default_factory=dict)
    value_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return sum(self.slot_bytes)

    @property
    def naive_bytes(self) -> int:
        return sum(self.value_bytes.values())

    def values_in(self, slot: int) -> list[str]:
        return sorted(v for v, s in self.slot_of.items() if s == slot)

    def to_dict(self) -> dict:
        return {
            "slot_of": dict(self.slot_of),
            "slot_bytes": list(self.slot_bytes),
            "lifetimes": {v: list(span) for v, span in self.lifetimes.items()},
            "value_bytes": dict(self.value_bytes),
            "peak_bytes": self.peak_bytes,
            "naive_bytes": self.naive_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryPlan":
        return cls(slot_of={v: int(s) for v, s in d["slot_of"].items()},
                   slot_bytes=[int(b) for b in d["slot_bytes"]],
                   lifetimes={v: (int(a), int(b)) for v, (a, b) in d.get("lifetimes", {}).items()},
                   value_bytes={v: int(b) for v, b in d.get("value_bytes", {}).items()})


def value_lifetimes(steps: Sequence[tuple[Sequence[str], Sequence[str]]],
                    outputs: Iterable[str]) -> dict[str, Lifetime]:
    """Lifetimes of the values the steps define, from (inputs, outputs) per step; names
    no step defines (graph inputs, params) are not activations and are left out."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, (ins, outs) in enumerate(steps):
        for name in ins:
            if name in first:
                last[name] = i
        for name in outs:
            first[name] = last[name] = i
    end = len(steps) - 1
    for name in outputs:
        if name in first:
            last[name] = end
    return {name: (first[name], last[name]) for name in first}


def _overlaps(a: Lifetime, b: Lifetime) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def assign_slots(lifetimes: dict[str, Lifetime], sizes: dict[str, int]) -> tuple[dict[str, int], list[int]]:
    """Size-sorted interval colouring with best fit: largest values first, so a slot's size
    is set by its first value and later ones never grow it; each goes to the smallest free slot."""
    order = sorted(lifetimes, key=lambda v: (-sizes[v], lifetimes[v][0], v))
    slot_of: dict[str, int] = {}
    slot_bytes: list[int] = []
    slot_spans: list[list[Lifetime]] = []
    for v in order:
        span = lifetimes[v]
        free = [s for s, spans in enumerate(slot_spans) if not any(_overlaps(span, o) for o in spans)]
        if free:
            slot = min(free, key=lambda s: (slot_bytes[s], s))
        else:
            slot = len(slot_bytes)
            slot_bytes.append(0)
            slot_spans.append([])
        slot_of[v] = slot
        slot_spans[slot].append(span)
        slot_bytes[slot] = max(slot_bytes[slot], sizes[v])
    return slot_of, slot_bytes


def _dim_symbols(types: Iterable[TensorType]) -> set[str]:
    return {s for t in types for d in t.shape if isinstance(d, str) for s in re.findall(r"[A-Za-z_]\w*", d)}


def plan_memory(graph: Graph, max_tokens: int, dims: dict[str, int] | None = None) -> MemoryPlan:
    """Plan the graph's activations at `max_tokens` batched tokens. Every symbolic dim counts
    tokens or a subset of them (logit rows, sequences), so one not bound in `dims` is
    bounded by `max_tokens`."""
    if max_tokens < 1:
        raise TargetError(f"graph {graph.name}: max_tokens must be a positive number of batched "
                          f"tokens, got {max_tokens}")
    types = {v.name: v.type for n in graph.nodes for v in n.outputs}
    binding = {s: max_tokens for s in _dim_symbols(types.values())} | {"tokens": max_tokens} | (dims or {})
    lifetimes = value_lifetimes([(n.inputs, [v.name for v in n.outputs]) for n in graph.nodes],
                                graph.outputs)
    sizes = {v: types[v].nbytes(binding) for v in lifetimes}
    slot_of, slot_bytes = assign_slots(lifetimes, sizes)
    return MemoryPlan(slot_of, slot_bytes, lifetimes, sizes)


__all__ = ["MemoryPlan", "Lifetime", "value_lifetimes", "assign_slots", "plan_memory"]
