"""Blocks outside every layer's sliding window go back to the pool during decode: a tiny Mistral
(window 16, blocks of 4 tokens) decoding far past its window still gives HF's tokens and log-probs
at every step while the blocks it holds stay bounded; batched runs equal solo ones; aborts leak
nothing; a prefix cached by a sequence that dropped it is reused only with the right KV. The block
manager's own state machine runs again with a window (its fake KV store checks every live slot)."""

import pytest
import tiny_hf_models as tiny
import torch
from hypothesis import settings
from hypothesis.stateful import invariant
from test_block_manager import BS, BlockManagerMachine
from tiny_hf_models import ARCHS, hf_greedy, hf_logits, prompt_ids, save_checkpoint

import llmc
from llmc import SamplingParams
from llmc.runtime.block_manager import BlockManager, droppable_window
from llmc.runtime.sequence import Sequence

WINDOW, BLOCK = 16, 4
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(HF module, artifact path) of a tiny Mistral with a 16-token window."""
    source = tmp_path_factory.mktemp("mistral")
    module = save_checkpoint(ARCHS["mistral"](sliding_window=WINDOW), source, seed=11)
    return module, llmc.compile(str(source), output=tmp_path_factory.mktemp("art") / "mistral.llmc")


def load(path):
    return llmc.load(path, block_size=BLOCK, kv_memory="128KiB")


def used_blocks(bm: BlockManager) -> int:
    return bm.num_blocks - bm.num_free_blocks


def test_the_engine_drops_behind_the_widest_window_and_never_without_one():
    assert droppable_window([16, 16]) == 16 and droppable_window([4, 16]) == 16
    assert droppable_window([16, None]) is None and droppable_window([]) is None
    assert droppable_window([16, 16], pipelined=True) is None


def test_decoding_80_tokens_past_the_window_gives_hf_s_logprobs_in_bounded_blocks(mistral):
    module, path = mistral
    llm = load(path)
    bm = llm.engine.block_manager
    assert bm.window == WINDOW
    ids = prompt_ids(40, seed=5)
    llm.engine.add_request("r", prompt_token_ids=ids, params=SamplingParams(max_tokens=80, logprobs=3, **GREEDY))
    peak, out = 0, None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            pass
        peak = max(peak, used_blocks(bm))
        bm.check_invariants()
    tokens = out.outputs[0].token_ids
    assert tokens == hf_greedy(module, ids, 80)
    # after each step (the first one's prefill held all 10 prompt blocks): the window's 4 and 2 more
    assert peak <= WINDOW // BLOCK + 2 and used_blocks(bm) == 0
    assert bm.total_dropped_blocks >= (120 - WINDOW) // BLOCK - 2
    ref = torch.log_softmax(hf_logits(module, ids + tokens)[len(ids) - 1:-1], -1)
    for step, entry in enumerate(out.outputs[0].logprobs):
        for token, lp in entry.items():
            assert abs(lp.logprob - ref[step, token].item()) < 1e-4 * ref[step].abs().max().item(), (step, token)


def test_mixed_lengths_batched_in_a_pool_too_small_without_dropping_equal_their_solo_runs(mistral):
    # 8 requests of up to 100 tokens would need 8 x 25 blocks; the pool has 64 (128 KiB / 2 KiB)
    module, path = mistral
    llm = load(path)
    assert llm.engine.block_manager.num_blocks < 8 * 25
    prompts = [{"prompt_token_ids": prompt_ids(n, seed=n)} for n in (3, 15, 17, 33, 40, 9, 21, 5)]
    params = SamplingParams(max_tokens=60, **GREEDY)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions == 0
    assert together == [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert together[4] == hf_greedy(module, prompts[4]["prompt_token_ids"], 60)


def test_aborts_part_way_leak_no_block(mistral):
    llm = load(mistral[1])
    engine, bm = llm.engine, llm.engine.block_manager
    for i in range(6):
        engine.add_request(f"r{i}", prompt_token_ids=prompt_ids(10 + 7 * i, seed=i),
                           params=SamplingParams(max_tokens=50, n=1 + i % 2, temperature=1.0, seed=i))
    for _ in range(30):
        engine.step()
    assert bm.num_dropped_blocks > 0
    for i in (0, 3, 4):
        engine.abort(f"r{i}")
        bm.check_invariants()
    while engine.has_unfinished():
        engine.step()
    bm.check_invariants()
    assert used_blocks(bm) == 0 and bm.num_dropped_blocks == 0 and not bm.seqs
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_a_prefix_whose_blocks_its_first_holder_dropped_is_served_with_the_right_kv(mistral):
    module, path = mistral
    llm = load(path)
    first = prompt_ids(40, seed=7)
    out = llm.generate({"prompt_token_ids": first}, SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0].token_ids
    second = first + out[:30] + prompt_ids(5, seed=8)   # its leading blocks were dropped and cached
    got = llm.generate({"prompt_token_ids": second}, SamplingParams(max_tokens=20, **GREEDY))[0]
    assert got.metrics.num_cached_tokens >= 64
    assert got.outputs[0].token_ids == hf_greedy(module, second, 20)


def test_speculative_decoding_drops_blocks_and_keeps_hf_s_tokens(mistral):
    module, path = mistral
    llm = llmc.load(path, block_size=BLOCK, kv_memory="128KiB",
                    speculative={"method": "ngram", "num_speculative_tokens": 3})
    ids = prompt_ids(12, seed=12) * 3   # repeats, so the n-gram proposer drafts
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=60, **GREEDY))[0].outputs[0].token_ids
    assert out == hf_greedy(module, ids, 60)
    assert llm.engine.metrics.speculative.num_drafts > 0 and llm.engine.block_manager.total_dropped_blocks > 15


@pytest.mark.triton
def test_a_gpu_artifact_drops_blocks_and_decodes_hf_s_tokens_through_the_triton_interpreter(mistral, tmp_path):
    module, _ = mistral
    source = tmp_path / "hf"
    module.save_pretrained(source)
    tiny.TOKENIZER.save_pretrained(source)
    path = llmc.compile(str(source), "h100-bf16", output=tmp_path / "gpu.llmc", disable=["cast_bf16"])
    llm = llmc.load(path, device="cpu", kv_memory="1MiB")
    ids = prompt_ids(20, seed=13)
    assert tiny.llmc_greedy(llm, ids, 40) == hf_greedy(module, ids, 40)
    assert llm.engine.block_manager.total_dropped_blocks >= 2   # 60 tokens in blocks of 16, window 16


class WindowedBlockManagerMachine(BlockManagerMachine):
    """The block manager's state machine with a window of 5 tokens: each computed step drops what
    falls out of it, and the fake KV store is checked on the slots still held."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BS, window=5)

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        super()._write(seq, start, end)
        self.bm.drop_outside_window(seq)

    @invariant()
    def computed_kv_matches_tokens(self):
        for seq in self.live:
            first = seq.num_dropped_blocks * BS
            slots = self.bm.slot_mapping(seq, first, seq.num_computed_tokens)
            for p, slot in enumerate(slots, first):
                assert self.kv.get(slot) == tuple(seq.token_ids[:p + 1]), (seq, p)

    @invariant()
    def kv_waste_is_the_empty_share_of_held_slots(self):
        filled: dict[int, int] = {}  # block -> the most tokens any holder keeps in it
        for seq in self.live:
            for i, block_id in enumerate(seq.block_table[seq.num_dropped_blocks:], seq.num_dropped_blocks):
                filled[block_id] = max(filled.get(block_id, 0), min(BS, max(0, seq.num_tokens - i * BS)))
        expected = 1 - sum(filled.values()) / (len(filled) * BS) if filled else 0.0
        assert abs(self.bm.kv_waste - expected) < 1e-12


WindowedBlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase


def test_bench_reports_the_blocks_the_window_gave_back(mistral):
    from llmc.cli import _window_lines
    from llmc.tools.bench import Workload, run_engine

    engine = load(mistral[1]).engine
    requests = Workload(num_requests=3, input_len=20, output_len=40).build(engine.model["vocab_size"])
    report = run_engine(engine, requests, progress=False).to_dict()["kv_window"]
    # each request: 60 tokens in 15 blocks, all but the window's last few dropped by its end
    assert report["window"] == WINDOW and 3 * 9 <= report["blocks_dropped"] <= 3 * 15
    assert 0 < report["peak_blocks_dropped"] <= report["blocks_dropped"]
    assert report["peak_bytes_saved"] == report["peak_blocks_dropped"] * BLOCK * engine.model["kv_bytes_per_token"]
    assert _window_lines(report)[0].startswith(f"sliding window    16 tokens: {report['blocks_dropped']} KV blocks")
