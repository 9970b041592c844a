"""The scheduler, driven by a fake model that writes each token into its KV slot and, before
sampling, checks the slots hold the sequence's tokens: in-flight batching, chunked prefill
under a token budget, priorities, preemption by recompute, rejection and abort."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmc.errors import RuntimeLlmcError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.scheduler import Scheduler, SchedulerConfig
from llmc.runtime.sequence import Sequence, SequenceStatus

BS = 4


def next_token(seq: Sequence) -> int:
    """The fake model's output depends only on the sequence and position, so a sequence
    preempted and recomputed must produce exactly the tokens of an uninterrupted run."""
    return (seq.seq_id * 7919 + seq.num_tokens * 104729) % 50000


def expected_output(seq: Sequence, max_tokens: int) -> list[int]:
    probe = Sequence(seq.prompt_token_ids, seq_id=seq.seq_id)
    for _ in range(max_tokens):
        probe.append_token(next_token(probe))
    return probe.output_token_ids


class FakeModel:
    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (token, position) whose KV it holds

    def step(self, out) -> list[int]:
        for src, dst in out.blocks_to_copy:
            for offset in range(self.bm.block_size):
                if src * BS + offset in self.kv:
                    self.kv[dst * BS + offset] = self.kv[src * BS + offset]
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            for p, slot in zip(range(start, start + n), self.bm.slot_mapping(seq, start, start + n)):
                self.kv[slot] = (seq.token_ids[p], p)
        for seq in out.sampled:
            slots = self.bm.slot_mapping(seq, 0, seq.num_tokens)
            assert [self.kv.get(s) for s in slots] == [(t, p) for p, t in enumerate(seq.token_ids)]
        return [next_token(seq) for seq in out.sampled]


class Harness:
    """An engine loop in miniature: `params` of each sequence is its max_tokens."""

    def __init__(self, num_blocks=64, prefix_caching=True, **config):
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
        self.config = SchedulerConfig(block_size=BS, **config)
        self.sched = Scheduler(self.config, self.bm)
        self.model = FakeModel(self.bm)
        self.finished: list[Sequence] = []

    def add(self, prompt, max_tokens=4, **kw) -> Sequence:
        seq = Sequence(prompt, params=max_tokens, **kw)
        self.sched.add(seq)
        return seq

    def step(self):
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        tokens = self.model.step(out)
        for seq in self.sched.postprocess(out, tokens):
            if seq.num_output_tokens >= seq.params:
                self.sched.finish(seq, "length")
                self.finished.append(seq)
        self.bm.check_invariants()
        return out

    def run(self, max_steps=500):
        outs = []
        while self.sched.has_unfinished():
            outs.append(self.step())
            assert len(outs) < max_steps, "scheduler made no progress"
        return outs


def ids(pairs):
    return [(seq.seq_id, n) for seq, n in pairs]


def prompt(rng, n):
    return [rng.randrange(32000) for _ in range(n)]


def test_request_added_mid_way_joins_the_next_step():
    rng = random.Random(0)
    h = Harness()
    a = h.add(prompt(rng, 10), max_tokens=6)
    assert ids(h.step().scheduled) == [(a.seq_id, 10)]
    assert ids(h.step().scheduled) == [(a.seq_id, 1)]
    b = h.add(prompt(rng, 7), max_tokens=2)
    assert ids(h.step().scheduled) == [(a.seq_id, 1), (b.seq_id, 7)]
    h.run()
    assert a.output_token_ids == expected_output(a, 6) and b.output_token_ids == expected_output(b, 2)


def test_chunked_prefill_splits_a_long_prompt_under_the_budget_beside_decodes():
    rng = random.Random(1)
    h = Harness(max_num_batched_tokens=64, max_num_seqs=8)
    a, b = h.add(prompt(rng, 10), max_tokens=20), h.add(prompt(rng, 10), max_tokens=20)
    h.step()
    long = h.add(prompt(rng, 150), max_tokens=3)
    steps = [h.step() for _ in range(3)]
    assert [ids(s.scheduled) for s in steps] == [
        [(a.seq_id, 1), (b.seq_id, 1), (long.seq_id, 62)],
        [(a.seq_id, 1), (b.seq_id, 1), (long.seq_id, 62)],
        [(a.seq_id, 1), (b.seq_id, 1), (long.seq_id, 26)]]
    assert [long in s.sampled for s in steps] == [False, False, True]
    assert long.num_output_tokens == 1
    h.run()
    assert long.output_token_ids == expected_output(long, 3)


def test_without_chunked_prefill_a_prompt_over_the_budget_is_rejected():
    rng = random.Random(2)
    h = Harness(max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=False)
    ok, too_long = h.add(prompt(rng, 60)), h.add(prompt(rng, 65))
    out = h.step()
    assert ids(out.scheduled) == [(ok.seq_id, 60)] and out.rejected == [too_long]
    assert "max_num_batched_tokens=64" in too_long.error


def test_without_chunked_prefill_prompts_wait_for_a_step_with_room():
    rng = random.Random(3)
    h = Harness(max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=False)
    a, b = h.add(prompt(rng, 40)), h.add(prompt(rng, 40))
    assert ids(h.step().scheduled) == [(a.seq_id, 40)]
    assert ids(h.step().scheduled) == [(a.seq_id, 1), (b.seq_id, 40)]


def test_priority_orders_admission_and_fcfs_within_a_priority():
    rng = random.Random(4)
    h = Harness(max_num_seqs=1)
    low = h.add(prompt(rng, 5), max_tokens=2, priority=0)
    high = h.add(prompt(rng, 5), max_tokens=2, priority=5)
    mid = h.add(prompt(rng, 5), max_tokens=2, priority=1)
    low_later = h.add(prompt(rng, 5), max_tokens=2, priority=0)
    h.run()
    assert h.finished == [high, mid, low, low_later]


def test_preemption_takes_the_newest_and_it_resumes_by_recompute():
    rng = random.Random(5)
    h = Harness(num_blocks=6, prefix_caching=False)
    old, new = h.add(prompt(rng, 8), max_tokens=12), h.add(prompt(rng, 8), max_tokens=12)
    outs = h.run()
    preempting = [o for o in outs if o.preempted]
    assert len(preempting) == 1 and preempting[0].preempted == [new]
    assert new not in [s for s, _ in preempting[0].scheduled]
    assert h.sched.num_preemptions == 1 and new.num_preemptions == 1
    # Both fit 12 tokens in 3 blocks each; only one can get a 4th block for the 13th.
    at = outs.index(preempting[0])
    assert len(outs[at - 1].scheduled) == 2 and new.status is SequenceStatus.FINISHED
    resumed = next(n for o in outs[at + 1:] for s, n in o.scheduled if s is new)
    assert resumed == 8 + 5  # the prompt and the 5 tokens generated before, all recomputed
    assert h.finished == [old, new]
    assert old.output_token_ids == expected_output(old, 12)
    assert new.output_token_ids == expected_output(new, 12)


def test_no_admission_in_a_step_that_preempted():
    rng = random.Random(12)
    h = Harness(num_blocks=6, prefix_caching=False, max_num_seqs=2)
    h.add(prompt(rng, 8), max_tokens=12)
    new = h.add(prompt(rng, 8), max_tokens=12)
    h.step()
    urgent = h.add(prompt(rng, 3), max_tokens=1, priority=1)  # waits: max_num_seqs is reached
    outs = h.run()
    at = next(i for i, o in enumerate(outs) if o.preempted)
    assert outs[at].preempted == [new]
    # Its freed blocks would fit `urgent`, but admitting now only invites the next preemption.
    assert urgent not in [s for s, _ in outs[at].scheduled]
    assert urgent in [s for s, _ in outs[at + 1].scheduled]


def test_preemption_spares_higher_priority_even_if_newer():
    rng = random.Random(6)
    h = Harness(num_blocks=6, prefix_caching=False)
    low = h.add(prompt(rng, 8), max_tokens=12, priority=0)
    high = h.add(prompt(rng, 8), max_tokens=12, priority=1)
    outs = h.run()
    assert [o.preempted for o in outs if o.preempted] == [[low]]
    assert h.finished == [high, low]
    assert low.output_token_ids == expected_output(low, 12)


def test_a_sequence_too_long_for_the_whole_cache_is_rejected_after_preemption():
    rng = random.Random(7)
    h = Harness(num_blocks=3, prefix_caching=False)
    seq = h.add(prompt(rng, 5), max_tokens=50)
    outs = h.run()
    assert outs[-1].rejected == [seq] and seq.finish_reason == "abort"
    assert seq.num_tokens == 13 and "grew to 13 tokens" in seq.error
    assert h.bm.num_free_blocks == 3


def test_oversize_prompt_is_rejected_while_the_others_continue():
    rng = random.Random(8)
    h = Harness(num_blocks=8)
    first = h.add(prompt(rng, 12), max_tokens=3)
    huge = h.add(prompt(rng, 200), max_tokens=3)
    last = h.add(prompt(rng, 12), max_tokens=3)
    out = h.step()
    assert out.rejected == [huge] and ids(out.scheduled) == [(first.seq_id, 12), (last.seq_id, 12)]
    assert huge.status is SequenceStatus.FINISHED and huge.finish_reason == "abort"
    assert huge.error == ("prompt of 200 tokens needs 50 KV blocks but the cache has only 8; "
                          "raise --kv-memory or shorten the prompt")
    h.run()
    assert h.finished == [first, last] and h.step().rejected == []


def test_abort_frees_blocks_of_running_and_waiting_requests():
    rng = random.Random(9)
    h = Harness(num_blocks=16, max_num_seqs=1)
    running = h.add(prompt(rng, 10), max_tokens=50, request_id="r1")
    waiting = h.add(prompt(rng, 10), max_tokens=50, request_id="r2")
    h.step()
    h.step()
    assert h.bm.num_free_blocks == 16 - 3 and h.sched.num_waiting == 1
    assert h.sched.abort("r1") == [running]
    assert h.bm.num_free_blocks == 16 and running.block_table == []
    assert h.sched.abort("r2") == [waiting] and h.sched.num_waiting == 0
    assert [s.finish_reason for s in (running, waiting)] == ["abort", "abort"]
    assert h.sched.abort("r3") == [] and not h.sched.has_unfinished()
    h.bm.check_invariants()


def test_fork_shares_the_prompt_and_copies_the_partial_block_on_write():
    rng = random.Random(10)
    h = Harness(num_blocks=16)
    parent = h.add(prompt(rng, 6), max_tokens=5)
    out = h.step()
    child = h.sched.fork(parent, seq_id=10**6)
    child.token_ids[-1] = next_token(child)  # each sample draws its own first token
    assert child.block_table == parent.block_table
    out = h.step()  # FakeModel checks both read their own tokens back
    assert len(out.blocks_to_copy) == 1 and out.blocks_to_copy[0][0] == child.block_table[1]
    assert parent.block_table[0] == child.block_table[0]
    h.run()
    assert parent.output_token_ids[1:] != child.output_token_ids[1:]


def test_shared_prefix_is_counted_as_prefix_hits():
    rng = random.Random(11)
    h = Harness()
    system = prompt(rng, 32)
    h.add(system + prompt(rng, 5))
    h.step()
    second = h.add(system + prompt(rng, 7))
    out = h.step()
    assert (second, 7) in out.scheduled and second.num_cached_tokens == 32
    assert h.sched.num_prefix_hit_tokens == 32 and h.sched.num_admitted_tokens == 37 + 39


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(8, 24),
       budget=st.sampled_from([16, 32, 100]), caching=st.booleans())
def test_random_workloads_all_finish_with_the_right_tokens(seed, num_blocks, budget, caching):
    rng = random.Random(seed)
    h = Harness(num_blocks=num_blocks, prefix_caching=caching,
                max_num_batched_tokens=budget, max_num_seqs=6)
    shared = prompt(rng, 2 * BS)
    seqs, aborted = [], set()
    for step in range(400):
        if len(seqs) < 12 and rng.random() < 0.4:
            head = shared if rng.random() < 0.5 else []
            seqs.append(h.add(head + prompt(rng, rng.randrange(1, 20)), max_tokens=rng.randrange(1, 12),
                              priority=rng.randrange(2), request_id=f"r{len(seqs)}"))
        if seqs and rng.random() < 0.05:
            victim = rng.choice(seqs)
            aborted.update(s.seq_id for s in h.sched.abort(victim.request_id))
        h.step()
        if len(seqs) == 12 and not h.sched.has_unfinished():
            break
    assert not h.sched.has_unfinished() and h.bm.num_free_blocks == num_blocks
    for seq in seqs:
        assert seq.is_finished
        if seq.finish_reason == "length":
            assert seq.output_token_ids == expected_output(seq, seq.params)
        else:
            assert seq.seq_id in aborted or seq.error


def test_config_is_validated():
    for bad in (dict(preemption_mode="swap"), dict(max_num_seqs=0),
                dict(max_num_batched_tokens=8, max_num_seqs=16), dict(block_size=1.5)):
        with pytest.raises(RuntimeLlmcError, match="SchedulerConfig"):
            SchedulerConfig(**bad)
    with pytest.raises(RuntimeLlmcError, match="block_size"):
        Scheduler(SchedulerConfig(block_size=16), BlockManager(4, block_size=8))
