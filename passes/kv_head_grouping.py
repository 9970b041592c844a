"""Which KV heads `convert_kv_heads` pools together: contiguous runs by index, or groups of heads
whose keys and values point the same way on calibration text (mean cosine similarity), found by
a greedy partition refined with pairwise swaps."""

from __future__ import annotations

import torch


def index_groups(kv_heads: int, n: int) -> list[list[int]]:
    """kv_heads heads in n contiguous groups: 6 -> 2 is [[0, 1, 2], [3, 4, 5]]."""
    size = kv_heads // n
    return [list(range(j * size, (j + 1) * size)) for j in range(n)]


class HeadSimilarity:
    """Running mean over tokens of cos(head a, head b) of an attention's keys and of its values,
    as one [kv_heads, kv_heads] float64 matrix (the average of the two)."""

    def __init__(self, kv_heads: int, head_dim: int):
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.total = torch.zeros(kv_heads, kv_heads, dtype=torch.float64)
        self.tokens = 0

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads * head_dim]. Keys after rope work as well as before: rope turns
        every head of a token by the same rotation, which keeps the angles between heads."""
        for x in (k, v):
            unit = torch.nn.functional.normalize(x.reshape(-1, self.kv_heads, self.head_dim).double(), dim=-1)
            self.total += 0.5 * torch.einsum("tad,tbd->ab", unit, unit)
        self.tokens += k.reshape(-1, self.kv_heads * self.head_dim).shape[0]

    def matrix(self) -> torch.Tensor:
        return self.total / max(self.tokens, 1)


def within_group_similarity(sim: torch.Tensor, groups: list[list[int]]) -> float:
    """Sum of sim over the unordered pairs of heads that share a group."""
    return sum(float(sim[a, b]) for g in groups for i, a in enumerate(g) for b in g[i + 1:])


def similarity_groups(sim: torch.Tensor, n: int) -> list[list[int]]:
    """An equal-size partition of the heads into n groups with high within-group similarity:
    greedy (each group grows from the lowest free head by the head most similar to it), then
    swaps of two heads between groups while one raises the total. Exhaustive search is out of
    reach for MHA checkpoints (32 heads in 8 groups has ~10^18 partitions)."""
    return canonical(refine_by_swaps(sim, greedy_groups(sim, n)))


def greedy_groups(sim: torch.Tensor, n: int) -> list[list[int]]:
    size = sim.shape[0] // n
    free = list(range(sim.shape[0]))
    groups = []
    while free:
        group = [free.pop(0)]
        while len(group) < size:
            best = max(free, key=lambda h: sum(float(sim[h, g]) for g in group))
            free.remove(best)
            group.append(best)
        groups.append(group)
    return groups


def swap_gain(sim: torch.Tensor, ga: list[int], a: int, gb: list[int], b: int) -> float:
    """How much the within-group total rises when a (in ga) and b (in gb) trade places."""
    a_in_b = sum(float(sim[a, h]) for h in gb if h != b) - sum(float(sim[a, h]) for h in ga if h != a)
    b_in_a = sum(float(sim[b, h]) for h in ga if h != a) - sum(float(sim[b, h]) for h in gb if h != b)
    return a_in_b + b_in_a


def refine_by_swaps(sim: torch.Tensor, groups: list[list[int]]) -> list[list[int]]:
    """Apply the best improving swap until none is left (the total rises every time, so it ends)."""
    groups = [list(g) for g in groups]
    while True:
        best = max(((swap_gain(sim, ga, a, gb, b), i, a, j, b)
                    for i, ga in enumerate(groups) for j, gb in enumerate(groups[i + 1:], start=i + 1)
                    for a in ga for b in gb), default=None)
        if best is None or best[0] <= 1e-12:
            return groups
        _, i, a, j, b = best
        groups[i][groups[i].index(a)], groups[j][groups[j].index(b)] = b, a


def canonical(groups: list[list[int]]) -> list[list[int]]:
    """Heads ascending within a group, groups by their first head: index grouping's own order."""
    return sorted(sorted(g) for g in groups)


__all__ = ["index_groups", "HeadSimilarity", "similarity_groups", "within_group_similarity"]
