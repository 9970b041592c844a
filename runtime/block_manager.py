"""Which fixed-size KV-cache blocks each sequence owns: a free pool, reference counts,
copy-on-write for shared partial blocks, a prefix cache of full blocks found by chained
block hashes and confirmed by their token ids, and, when every attention layer has a sliding
window, the release of blocks that no future query can see."""

from __future__ import annotations

import hashlib
import os
import re
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from llmc.errors import RuntimeLlmcError
from llmc.runtime.sequence import Sequence

NO_HASH = -1


def hash_block_tokens(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chain hash of a full block: blake2b over the previous block's hash and these
    token ids, so equal hashes mean equal prefixes (up to collisions, which callers
    rule out by comparing tokens). Stable across processes, unlike Python's hash()."""
    data = prev_hash.to_bytes(8, "little", signed=True) + array("q", token_ids).tobytes()
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: never NO_HASH, fits signed


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, to confirm a hit
    last_access: int = 0  # manager tick of the last allocate/free touching it

    def forget(self) -> None:
        self.hash = NO_HASH
        self.token_ids = ()


class BlockManager:
    """Free blocks live in two pools: `free` (no cached content) and `evictable`
    (ref count 0 but still in the prefix cache, least recently used first)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise RuntimeLlmcError(f"BlockManager: num_blocks={num_blocks} and block_size={block_size} "
                                   "must both be at least 1; raise --kv-memory")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise RuntimeLlmcError(f"BlockManager: window={window!r} must be None or an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        self.seqs: dict[int, Sequence] = {}  # every sequence holding blocks, by seq_id
        self._tick = 0
        # a query at position p sees keys p - window + 1 .. p in every layer (None: some layer sees all)
        self.window = window
        self.num_dropped_blocks = 0  # block-table entries of live sequences dropped by the window
        self.total_dropped_blocks = 0  # over this manager's life

    # --- pool state -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def kv_waste(self) -> float:
        """Allocated slots that hold no token, over all slots allocated to live sequences. Only a
        sequence's tail blocks can be part-filled, so this walks tails, not whole tables; a tail
        block some other holder has as a full block is full."""
        tails: dict[int, list[int]] = {}  # block_id -> [tail holders seen, most tokens in it]
        bs = self.block_size
        for seq in self.seqs.values():
            for i in range(seq.num_kv_tokens // bs, len(seq.block_table)):
                seen = tails.setdefault(seq.block_table[i], [0, 0])
                seen[0] += 1
                seen[1] = max(seen[1], seq.num_kv_tokens - i * bs)
        empty = sum(bs - max(0, filled) for block_id, (holders, filled) in tails.items()
                    if holders == self.blocks[block_id].ref_count)
        allocated = (self.num_blocks - self.num_free_blocks) * bs
        return 0.0 if allocated == 0 else empty / allocated

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slot (block_id * block_size + offset) of each token position in [start, end) (past a KV
        policy's evicted entries)."""
        bs, e = self.block_size, seq.num_evicted_tokens
        return [seq.block_table[(p - e) // bs] * bs + (p - e) % bs for p in range(start, end)]

    # --- admission --------------------------------------------------------------------

    def count_cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens `allocate` would serve from the prefix cache right now."""
        return len(self._cached_prefix(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        # A hit on a block some sequence holds costs nothing; one on an evictable block
        # takes it out of the free pools just as a fresh block would.
        held = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.num_free_blocks >= seq.num_blocks(self.block_size) - held

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks {seq.block_table}"
        self._tick += 1
        hits = self._cached_prefix(seq)
        for block_id in hits:
            self._take(block_id)
        fresh = [self._allocate_block() for _ in range(seq.num_blocks(self.block_size) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.seqs[seq.seq_id] = seq

    def hold_cached_prefix(self, seq: Sequence) -> int:
        """Hold the cached blocks `allocate(seq)` would reuse, so nothing evicts them before it does
        (disaggregated decode: the prompt KV that need not be sent); `free(seq)` lets them go. How many."""
        assert seq.seq_id not in self.seqs, f"seq {seq.seq_id} already holds blocks"
        seq.block_table = self._cached_prefix(seq)
        for block_id in seq.block_table:
            self._take(block_id)
        self.seqs[seq.seq_id] = seq
        return len(seq.block_table)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the prompt's leading full blocks. At most num_tokens - 1
        tokens may hit: the last one is always recomputed to produce logits."""
        if not self.enable_prefix_caching or not seq.uses_prefix_cache:
            return []
        hits: list[int] = []
        prev = NO_HASH
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.block_token_ids(i, self.block_size))
            prev = hash_block_tokens(prev, tokens)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break  # miss, or a hash collision the token comparison caught
            hits.append(block_id)
        return hits

    # --- growth -----------------------------------------------------------------------

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        return self.num_free_blocks >= self._blocks_to_append(seq, lookahead)

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> tuple[int, int] | None:
        """Make slots for the uncomputed tokens and `lookahead` more (speculative drafts): a new
        block when the last one is full, or a private copy of a shared partial block
        (copy-on-write). Returns the (src, dst) block pair whose KV the runner must copy before
        this step writes, or None."""
        self._tick += 1
        copy = None
        if self._write_block_is_shared(seq):
            i = seq.kv_len // self.block_size
            src, dst = seq.block_table[i], self._allocate_block()
            self._release(src)
            seq.block_table[i] = dst
            copy = (src, dst)
        while len(seq.block_table) < self._num_blocks_with(seq, lookahead):
            seq.block_table.append(self._allocate_block())
        return copy

    def trim(self, seq: Sequence) -> None:
        """Roll back slots made for rejected drafts: blocks past the ones `seq`'s tokens need go
        back to the pools. They were never full of computed tokens, so they carry no hash."""
        self._tick += 1
        while len(seq.block_table) > seq.num_blocks(self.block_size):
            block_id = seq.block_table.pop()
            assert self.blocks[block_id].hash == NO_HASH, f"trimming hashed block {block_id}"
            self._release(block_id)

    def _num_blocks_with(self, seq: Sequence, lookahead: int) -> int:
        return -(-(seq.num_kv_tokens + lookahead) // self.block_size)

    def _blocks_to_append(self, seq: Sequence, lookahead: int = 0) -> int:
        missing = self._num_blocks_with(seq, lookahead) - len(seq.block_table)
        return max(missing, 0) + int(self._write_block_is_shared(seq))

    def _write_block_is_shared(self, seq: Sequence) -> bool:
        # Only the block holding the first uncomputed position can be shared: blocks
        # behind it are full (prefix hits, forks) and blocks after it are this seq's own.
        i = seq.kv_len // self.block_size
        if i >= len(seq.block_table) or seq.num_computed_tokens == seq.num_tokens:
            return False
        return self.blocks[seq.block_table[i]].ref_count > 1

    def mark_full_blocks(self, seq: Sequence) -> None:
        """Hash blocks whose tokens are now all computed and offer them to the prefix cache."""
        if not self.enable_prefix_caching or not seq.uses_prefix_cache:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash == NO_HASH:
            first -= 1
        for i in range(first, num_full):
            self._hash_block(seq, i)

    def _hash_block(self, seq: Sequence, i: int) -> None:
        block = self.blocks[seq.block_table[i]]
        prev = self.blocks[seq.block_table[i - 1]].hash if i > 0 else NO_HASH
        block.token_ids = tuple(seq.block_token_ids(i, self.block_size))
        block.hash = hash_block_tokens(prev, block.token_ids)
        # First holder wins; a duplicate keeps its hash (the next block chains on it)
        # but is not reachable from the cache and is forgotten when freed.
        self.hash_to_block.setdefault(block.hash, block.block_id)

    # --- sliding window ---------------------------------------------------------------

    def drop_outside_window(self, seq: Sequence) -> None:
        """Give back the leading blocks no query from `seq`'s next position on can see: a query
        at p >= num_computed_tokens sees keys from p - window + 1, so block i goes once its last
        key (i + 1) * block_size - 1 is below that. The block after it must be full (hashed)
        already, so a hash never chains on a dropped block. The table keeps block 0 in a dropped
        entry: positions still index the table, any block reads safely and the window masks it."""
        if self.window is None:
            return
        bs = self.block_size
        keep_from = min((seq.num_computed_tokens - self.window + 1) // bs, seq.num_computed_tokens // bs - 1)
        if keep_from <= seq.num_dropped_blocks:
            return
        self._tick += 1
        for i in range(seq.num_dropped_blocks, keep_from):
            self._release(seq.block_table[i])
            seq.block_table[i] = 0
        self.num_dropped_blocks += keep_from - seq.num_dropped_blocks
        self.total_dropped_blocks += keep_from - seq.num_dropped_blocks
        seq.num_dropped_blocks = keep_from

    # --- KV policies (runtime/kv_policy.py) ----------------------------------------------

    def evict(self, seq: Sequence, count: int) -> list[int]:
        """`count` of a policy sequence's cached entries go (the model runner compacts each head's kept
        entries into the first kv_len - count slots): the blocks past them return to the pools, and a kept
        block another holder shares (a fork) is replaced by a fresh one, as the compaction rewrites every kept
        slot. Returns the table before, which the runner reads the kept entries from."""
        assert seq.kv_cap is not None and not seq.uses_prefix_cache, f"seq {seq.seq_id} has no KV policy"
        assert 0 < count <= seq.kv_len, (count, seq)
        self._tick += 1
        old = list(seq.block_table)
        seq.num_evicted_tokens += count
        keep = -(-seq.kv_len // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        for i, block_id in enumerate(seq.block_table):
            if self.blocks[block_id].ref_count > 1:
                self._release(block_id)
                seq.block_table[i] = self._allocate_block()
        return old

    # --- sharing and release ----------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent`."""
        assert child.seq_id not in self.seqs, f"seq {child.seq_id} already holds blocks"
        child.block_table = list(parent.block_table)
        child.num_dropped_blocks = parent.num_dropped_blocks
        self.num_dropped_blocks += child.num_dropped_blocks
        for block_id in child.live_blocks:
            self.blocks[block_id].ref_count += 1
        self.seqs[child.seq_id] = child

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody holds go back to the pools."""
        if self.seqs.pop(seq.seq_id, None) is None:
            assert not seq.block_table, f"seq {seq.seq_id} has blocks this manager never gave it"
            return
        self._tick += 1
        # Tail blocks first, so LRU eviction takes a prompt's tail before its shared head.
        for block_id in reversed(seq.live_blocks):
            self._release(block_id)
        self.num_dropped_blocks -= seq.num_dropped_blocks
        seq.block_table = []
        seq.num_dropped_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache), so the next request computes its
        whole prompt; only while no sequence holds blocks. Returns whether it was reset."""
        if self.seqs:
            return False
        for block_id in self.evictable_block_ids:
            self.blocks[block_id].forget()
            self.free_block_ids.append(block_id)
        self.evictable_block_ids.clear()
        self.hash_to_block.clear()
        return True

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than taken"
        block.ref_count -= 1
        block.last_access = self._tick
        if block.ref_count > 0:
            return
        if self.hash_to_block.get(block.hash) == block_id:
            self.evictable_block_ids[block_id] = None
        else:
            block.forget()
            self.free_block_ids.append(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable_block_ids[block_id]
        block.ref_count += 1
        block.last_access = self._tick

    def _allocate_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            assert self.evictable_block_ids, "no free KV block; callers must check can_allocate/can_append"
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            del self.hash_to_block[self.blocks[block_id].hash]
            self.blocks[block_id].forget()
        block = self.blocks[block_id]
        block.ref_count = 1
        block.last_access = self._tick
        return block_id

    # --- checking ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the pools, reference counts or prefix cache disagree."""
        holders = Counter(b for seq in self.seqs.values() for b in seq.live_blocks)
        free, evictable = set(self.free_block_ids), set(self.evictable_block_ids)
        _require(len(free) == len(self.free_block_ids), "a block is twice in the free list")
        _require(not free & evictable, f"blocks both free and evictable: {free & evictable}")
        for seq in self.seqs.values():
            _require(len(set(seq.live_blocks)) == len(seq.live_blocks),
                     f"seq {seq.seq_id} holds a block twice: {seq.block_table}")
            self._check_dropped(seq)
            _require(len(seq.block_table) * self.block_size >= seq.kv_len,
                     f"seq {seq.seq_id} computed tokens beyond its blocks")
        for block in self.blocks:
            self._check_block(block, holders[block.block_id], block.block_id in free,
                              block.block_id in evictable)
        for h, block_id in self.hash_to_block.items():
            _require(self.blocks[block_id].hash == h, f"cache maps hash {h} to block {block_id}, "
                     f"which has hash {self.blocks[block_id].hash}")

    def _check_dropped(self, seq: Sequence) -> None:
        n = seq.num_dropped_blocks
        _require(n == 0 or self.window is not None, f"seq {seq.seq_id} dropped {n} blocks without a window")
        _require(n == 0 or n * self.block_size <= seq.num_computed_tokens - self.window + 1,
                 f"seq {seq.seq_id} dropped {n} blocks, some still inside the window of its next query")
        _require(all(b == 0 for b in seq.block_table[:n]), f"seq {seq.seq_id}: a dropped entry is not block 0")

    def _check_block(self, block: Block, holders: int, is_free: bool, is_evictable: bool) -> None:
        where = f"block {block.block_id}"
        _require(block.ref_count == holders,
                 f"{where}: ref_count {block.ref_count} but {holders} sequences hold it")
        _require((block.ref_count == 0) == (is_free or is_evictable),
                 f"{where}: ref_count {block.ref_count}, free={is_free}, evictable={is_evictable}")
        cached = block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block.block_id
        _require(not is_evictable or cached, f"{where} is evictable but not in the prefix cache")
        _require(not is_free or block.hash == NO_HASH, f"{where} is free but still hashed")
        _require((block.hash == NO_HASH) == (len(block.token_ids) == 0)
                 and len(block.token_ids) in (0, self.block_size),
                 f"{where}: hash {block.hash} with {len(block.token_ids)} token ids")


def _require(ok: bool, message: str) -> None:
    if not ok:  # explicit, so invariant checks survive python -O
        raise AssertionError(message)


def droppable_window(windows: list[int | None], pipelined: bool = False) -> int | None:
    """The window a BlockManager may drop blocks behind, from each attention layer's sliding
    window: the widest, or None (keep every block) when a layer has none or when other pipeline
    stages hold layers `windows` does not show."""
    if pipelined or not windows or None in windows:
        return None
    return max(windows)


# --- sizing the pool ------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def available_memory_bytes() -> int:
    """Memory the OS can still hand out (host RAM; the GPU runtime asks its device instead)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_bytes(text: str | int | float, field: str = "--kv-memory") -> int:
    """'2GiB', '512MiB', '1.5GB', '4G' (binary, like '4GiB') or a plain byte count -> bytes;
    a fraction in (0, 1) ('0.3') or a percentage ('30%') of the memory available now.
    One regex; not worth a dependency."""
    fraction = _fraction(text)
    if fraction is not None:
        value = int(fraction * available_memory_bytes())
    elif isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.fullmatch(str(text))
        unit = match and _UNITS.get(match.group(2).lower())
        if unit is None:
            raise RuntimeLlmcError(f"{field}: cannot read {text!r} as a size; "
                                   "write e.g. 2GiB, 512MiB, 1.5GB or a number of bytes")
        value = int(float(match.group(1)) * unit)
    if value <= 0:
        raise RuntimeLlmcError(f"{field}: size {text!r} must be more than 0 bytes")
    return value


def _fraction(text) -> float | None:
    t = str(text).strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        return None
    return value if 0 < value < 1 else None


def num_blocks_for_budget(budget_bytes: int, kv_bytes_per_token: int, block_size: int = 16) -> int:
    """How many KV blocks of `block_size` tokens fit in `budget_bytes`."""
    assert kv_bytes_per_token > 0 and block_size > 0, (kv_bytes_per_token, block_size)
    block_bytes = kv_bytes_per_token * block_size
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise RuntimeLlmcError(f"--kv-memory: {budget_bytes} bytes cannot hold one KV block "
                               f"({block_size} tokens x {kv_bytes_per_token} bytes = {block_bytes} "
                               "bytes); raise --kv-memory")
    return num_blocks
