"""Prefix-affinity routing: which engines hold a prompt's leading KV blocks in their prefix caches, as
far as the router can tell from where it sent earlier prompts, so that a prompt sharing a prefix with an
earlier one goes where that prefix is cached (a prefill engine computes less; a decode engine is sent
fewer blocks) unless that engine is too busy.

The router keys blocks as the engines' prefix caches do (block_manager.hash_block_tokens, chained over
the prompt's full blocks); the map from block hash to the engines it was sent to is bounded (LRU). It is
a guess: an engine evicts blocks on its own, and a stale entry costs only a missed hit."""

from __future__ import annotations

from collections import OrderedDict

from llmc.runtime.block_manager import NO_HASH, hash_block_tokens

CAPACITY = 1 << 16   # block hashes remembered per role: ~10 MiB, 1M tokens at 16 a block


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, as a prefix cache keys them. A prefix cache
    serves at most the blocks before the last token (that one is always computed), so those only."""
    hashes, prev = [], NO_HASH
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        prev = hash_block_tokens(prev, tuple(token_ids[start:start + block_size]))
        hashes.append(prev)
    return hashes


class PrefixAffinity:
    """Block hash -> the engines (ranks) of one role that were sent a prompt with that block, LRU-bounded."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._holders: OrderedDict[int, set[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def matched(self, hashes: list[int]) -> dict[int, int]:
        """Each engine that holds a leading run of these blocks, and how many (as far as known)."""
        depth: dict[int, int] = {}
        for i, h in enumerate(hashes):
            holders = self._holders.get(h, ())
            longer = [r for r in holders if depth.get(r, 0) == i]
            if not longer:
                break   # chained hashes: no engine holds a later block of this prompt without this one
            for r in longer:
                depth[r] = i + 1
        return depth

    def record(self, hashes: list[int], rank: int) -> None:
        """Engine `rank` was sent a prompt with these blocks: its prefix cache will hold them. The leading
        blocks are made the newest, so that the bound evicts a prompt's tail before the blocks it chains on."""
        for h in reversed(hashes):
            self._holders.setdefault(h, set()).add(rank)
            self._holders.move_to_end(h)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, rank: int) -> None:
        """Engine `rank` is gone: it holds nothing."""
        for h in [h for h, holders in self._holders.items() if holders == {rank}]:
            del self._holders[h]
        for holders in self._holders.values():
            holders.discard(rank)
