"""Token trees for speculative decoding (SpecInfer, Medusa, Lookahead): several candidate
continuations of a sequence merged into one prefix tree and verified in a single target forward,
each node attending to the context and its own ancestors only. A greedy request keeps the longest
path the target's argmax follows."""

from __future__ import annotations

import torch


class DraftTree(list):
    """Draft tokens in row order, a parent before its children; `parents[i]` is the index of node
    i's parent, -1 for the sequence's last known token. In the verification forward that token is
    row 0 and node i is row i + 1. As a list it is what the scheduler and model runner count and
    feed like a chain of drafts."""

    def __init__(self, tokens: list[int], parents: list[int]):
        super().__init__(tokens)
        self.parents = parents

    def depths(self) -> list[int]:
        """Each node's distance from the last known token (1 for its children)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def visible(self, context: int, device=None) -> torch.Tensor:
        """[nodes + 1, context + nodes + 1] True where verification row r may see key j: every key of
        the `context` tokens before the last known one, and the rows on r's path from the root."""
        rows = len(self) + 1
        own = torch.eye(rows, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            own[i + 1] |= own[parent + 1]
        return torch.cat([torch.ones(rows, context, dtype=torch.bool), own], dim=1).to(device)

    def accept_greedy(self, argmax: list[int]) -> tuple[list[int], list[int]]:
        """Follow the target's argmax (`argmax[r]` at verification row r) down the tree: (the tokens
        kept, which are the path's drafts and the argmax after them; the path's node indices)."""
        children = {(parent, token): i for i, (parent, token) in enumerate(zip(self.parents, self))}
        kept, path, node = [], [], -1
        while True:
            token = argmax[node + 1]
            kept.append(token)
            node = children.get((node, token))
            if node is None:
                return kept, path
            path.append(node)


def merge_candidates(candidates: list[list[int]], max_nodes: int) -> list[int]:
    """The candidates as one prefix tree of at most `max_nodes` nodes (shared prefixes merged, the
    first candidate whole as nodes 0, 1, ...): a DraftTree, or the plain list when it is one chain."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for candidate in candidates:
        node = -1
        for token in candidate:
            child = index.get((node, token))
            if child is None:
                if len(tokens) == max_nodes:
                    break
                child = index[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = child
    if parents == list(range(-1, len(tokens) - 1)):
        return tokens
    return DraftTree(tokens, parents)
