"""The KV block manager: invariants under random allocate/append/fork/free, prefix caching
with token-confirmed hits and LRU eviction, copy-on-write, and pool sizing."""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmc.errors import RuntimeLlmcError
from llmc.runtime import block_manager as bm_module
from llmc.runtime.block_manager import BlockManager, num_blocks_for_budget, parse_bytes
from llmc.runtime.sequence import Sequence

BS = 4


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """Pretend the model computed the next n tokens (all, by default)."""
    seq.num_computed_tokens += seq.num_uncomputed_tokens if n is None else n
    bm.mark_full_blocks(seq)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(n)]


class BlockManagerMachine(RuleBasedStateMachine):
    """A fake KV store rides along: each slot records which (prefix) produced it, so a wrong
    prefix hit, a missed copy-on-write or a reused live block shows up as wrong KV."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BS)
        self.live: list[Sequence] = []
        self.kv: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        for p, slot in zip(range(start, end), self.bm.slot_mapping(seq, start, end)):
            assert self.bm.blocks[slot // BS].ref_count == 1, "wrote into a shared block"
            self.kv[slot] = tuple(seq.token_ids[:p + 1])
        seq.num_computed_tokens = end
        self.bm.mark_full_blocks(seq)

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=4 * BS + 3))
    def admit(self, prompt):
        seq = Sequence(prompt, seq_id=self._new_id())
        if not self.bm.can_allocate(seq):
            return
        self.bm.allocate(seq)
        assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens <= len(prompt) - 1
        self.live.append(seq)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.live))
    @rule(data=st.data())
    def prefill_chunk(self, data):
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_uncomputed_tokens]))
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        self._write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.live))
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from([s for s in self.live if not s.num_uncomputed_tokens]))
        seq.append_token(token)
        if not self.bm.can_append(seq):  # out of blocks: preempt it
            self.bm.free(seq)
            self.live.remove(seq)
            return
        copy = self.bm.append_slot(seq)
        if copy is not None:
            src, dst = copy
            for offset in range(BS):
                if src * BS + offset in self.kv:
                    self.kv[dst * BS + offset] = self.kv[src * BS + offset]
        self._write(seq, seq.num_tokens - 1, seq.num_tokens)

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.live))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from([s for s in self.live if not s.num_uncomputed_tokens]))
        child = parent.fork(self._new_id())
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):  # a finish, or an abort part-way through a prefill
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        self.live.remove(seq)
        assert seq.block_table == []

    @invariant()
    def invariants_hold(self):
        self.bm.check_invariants()
        assert 0.0 <= self.bm.kv_waste < 1.0 and 0.0 <= self.bm.usage <= 1.0

    @invariant()
    def computed_kv_matches_tokens(self):
        for seq in self.live:
            slots = self.bm.slot_mapping(seq, 0, seq.num_computed_tokens)
            for p, slot in enumerate(slots):
                assert self.kv.get(slot) == tuple(seq.token_ids[:p + 1]), (seq, p)

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                 deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_second_request_reuses_256_token_prefix():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=16)
    prefix = tokens(rng, 256)
    first = Sequence(prefix + tokens(rng, 37))
    bm.allocate(first)
    assert first.num_cached_tokens == 0
    compute(bm, first)
    second = Sequence(prefix + tokens(rng, 37))
    assert bm.can_allocate(second)
    bm.allocate(second)
    assert second.num_cached_tokens == second.num_computed_tokens == 256
    assert second.block_table[:16] == first.block_table[:16]
    assert not set(second.block_table[16:]) & set(first.block_table)
    assert all(bm.blocks[b].ref_count == 2 for b in first.block_table[:16])
    bm.check_invariants()


def computed_prompt(rng, length: int = 100) -> tuple[BlockManager, list[int], Sequence]:
    """A 32-block manager holding one computed prompt of `length` random tokens."""
    bm = BlockManager(num_blocks=32, block_size=16)
    prompt = tokens(rng, length)
    first = Sequence(prompt)
    bm.allocate(first)
    compute(bm, first)
    return bm, prompt, first


def test_prefix_survives_its_owner_in_the_cache():
    rng = random.Random(1)
    bm, prompt, first = computed_prompt(rng)
    bm.free(first)
    assert bm.num_free_blocks == 32 and bm.num_cached_blocks == 6
    again = Sequence(prompt[:96] + tokens(rng, 5))
    bm.allocate(again)
    assert again.num_cached_tokens == 96
    bm.check_invariants()


def test_reset_prefix_cache_forgets_every_cached_block_but_only_when_nothing_is_held():
    bm, prompt, first = computed_prompt(random.Random(4))
    assert not bm.reset_prefix_cache()        # first still holds its blocks
    bm.free(first)
    assert bm.num_cached_blocks == 6 and bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 32 and not bm.hash_to_block
    again = Sequence(prompt)
    bm.allocate(again)
    assert again.num_cached_tokens == 0
    bm.check_invariants()


def test_identical_prompt_recomputes_its_last_token():
    rng = random.Random(2)
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = tokens(rng, 32)  # exactly two full blocks
    first = Sequence(prompt)
    bm.allocate(first)
    compute(bm, first)
    second = Sequence(prompt)
    bm.allocate(second)
    # 31 tokens may hit, rounded down to whole blocks; the second block is recomputed.
    assert second.num_cached_tokens == 16
    assert second.block_table[1] != first.block_table[1]


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda prev, token_ids: 7)
    rng = random.Random(3)
    bm = BlockManager(num_blocks=16, block_size=16)
    first = Sequence(tokens(rng, 40))
    bm.allocate(first)
    compute(bm, first)
    stranger = Sequence(tokens(rng, 40))
    bm.allocate(stranger)
    assert stranger.num_cached_tokens == 0  # same hash, other tokens
    same = Sequence(list(first.token_ids))
    bm.allocate(same)
    # Block 0 matches; block 1's hash leads to block 0 too, whose tokens differ.
    assert same.num_cached_tokens == 16
    bm.check_invariants()


def test_lru_evicts_least_recently_used_cached_blocks():
    rng = random.Random(4)
    bm = BlockManager(num_blocks=7, block_size=BS)
    prompt_a, prompt_b = tokens(rng, 9), tokens(rng, 9)  # two full blocks and one token each
    for prompt in (prompt_a, prompt_b):
        seq = Sequence(prompt)
        bm.allocate(seq)
        compute(bm, seq)
        bm.free(seq)
    reuse = Sequence(prompt_a)  # touching a's blocks makes b's the least recently used
    bm.allocate(reuse)
    assert reuse.num_cached_tokens == 8
    compute(bm, reuse)
    bm.free(reuse)
    hungry = Sequence(tokens(rng, 3 * BS))  # 3 blocks; 3 uncached free ones exist, then evict
    bm.allocate(hungry)
    assert len(bm.free_block_ids) == 0 and bm.num_cached_blocks == 4
    extra = Sequence(tokens(rng, BS))
    bm.allocate(extra)  # evicts b's tail block first: its head is likelier to be shared
    assert bm.num_cached_blocks == 3
    assert bm.count_cached_tokens(Sequence(prompt_b)) == 4
    assert bm.count_cached_tokens(Sequence(prompt_a)) == 8
    bm.check_invariants()


def test_hit_on_held_blocks_needs_no_free_block():
    rng = random.Random(5)
    bm = BlockManager(num_blocks=4, block_size=BS)
    first = Sequence(tokens(rng, 3 * BS))
    bm.allocate(first)
    compute(bm, first)
    second = Sequence(first.token_ids[:2 * BS] + tokens(rng, 1))  # 3 blocks, 2 of them hits
    assert bm.num_free_blocks == 1 and bm.can_allocate(second)
    bm.allocate(second)
    assert second.num_cached_tokens == 2 * BS and bm.num_free_blocks == 0
    assert not bm.can_allocate(Sequence(tokens(rng, 1)))


def test_prefix_caching_off_never_hits():
    rng = random.Random(6)
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    prompt = tokens(rng, 20)
    first = Sequence(prompt)
    bm.allocate(first)
    compute(bm, first)
    second = Sequence(prompt)
    bm.allocate(second)
    assert second.num_cached_tokens == 0 and bm.num_cached_blocks == 0
    bm.free(first)
    bm.free(second)
    assert len(bm.free_block_ids) == 16


def test_fork_then_append_copies_the_shared_partial_block():
    rng = random.Random(7)
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = Sequence(tokens(rng, 6))
    bm.allocate(parent)
    compute(bm, parent)
    child = parent.fork(new_id=10**6)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and child.block_table is not parent.block_table
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    shared_tail = parent.block_table[1]
    parent.append_token(1)
    child.append_token(2)
    assert bm.can_append(parent)
    src, dst = bm.append_slot(parent)
    assert src == shared_tail and parent.block_table == [child.block_table[0], dst]
    assert bm.append_slot(child) is None  # it now holds the old tail alone
    assert child.block_table[1] == shared_tail
    assert [bm.blocks[b].ref_count for b in (child.block_table[0], shared_tail, dst)] == [2, 1, 1]
    bm.check_invariants()


def test_append_takes_a_new_block_when_the_last_is_full():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = Sequence(list(range(BS)))
    bm.allocate(seq)
    compute(bm, seq)
    seq.append_token(9)
    assert bm.can_append(seq) and bm.append_slot(seq) is None
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 0
    compute(bm, seq)
    for t in range(BS - 1):  # fills the second block without new ones
        seq.append_token(t)
        bm.append_slot(seq)
        compute(bm, seq)
    seq.append_token(0)
    assert not bm.can_append(seq)


def test_slot_mapping_and_kv_waste():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = Sequence([3, 1, 4, 1, 5])
    bm.allocate(seq)
    first, second = seq.block_table
    assert bm.slot_mapping(seq, 3, 5) == [first * BS + 3, second * BS + 0]
    assert bm.kv_waste == pytest.approx(3 / 8)  # 2 blocks, 8 slots, 5 tokens
    assert bm.usage == pytest.approx(2 / 8)


def test_parse_bytes_reads_binary_and_decimal_units():
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4G") == 4 * 1024**3
    assert parse_bytes(" 64 kb ") == 64_000
    assert parse_bytes("123") == parse_bytes(123) == 123
    for bad in ("2 gigs", "", "GiB", "0", "-1GiB"):
        with pytest.raises(RuntimeLlmcError, match="--kv-memory"):
            parse_bytes(bad)


def test_num_blocks_for_budget_fills_the_budget():
    # SmolLM2-135M in fp16: 30 layers x (K and V) x 3 kv heads x 64 dims x 2 bytes.
    per_token = 30 * 2 * 3 * 64 * 2
    n = num_blocks_for_budget(parse_bytes("1GiB"), per_token, block_size=16)
    assert n * 16 * per_token <= 1024**3 < (n + 1) * 16 * per_token
    with pytest.raises(RuntimeLlmcError, match="raise --kv-memory"):
        num_blocks_for_budget(per_token * 15, per_token, block_size=16)


def test_kv_budget_as_a_fraction_of_available_memory(monkeypatch):
    import llmc.runtime.block_manager as bm
    monkeypatch.setattr(bm, "available_memory_bytes", lambda: 8 * 2**30)
    assert bm.parse_bytes("0.25") == 2 * 2**30
    assert bm.parse_bytes("50%") == 4 * 2**30
    assert bm.parse_bytes("3") == 3  # a whole number stays a byte count
