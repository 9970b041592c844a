"""The engine's side of a disaggregated handoff, in one process: a request prefilled on one engine,
exported after its first token (its blocks freed there, the full ones kept in its prefix cache) and
taken in by another, decodes to what one engine alone makes (greedy and seeded, stop strings
included), also when the blocks the taking engine's prefix cache holds are left out of the KV; the
packed KV round-trips any block order; a request that can never fit is refused."""

import pytest
import torch

from llmc.errors import RuntimeLlmcError
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.kv_transfer import can_hand_off, export_request
from llmc.runtime.paged_attention import PagedKVCache
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence


def run_to_end(engine: Engine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs


def hand_over(prefill: Engine, decode: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for i, ids in enumerate(prompts):
        prefill.add_request(str(i), prompt_token_ids=ids, params=params)
    while prefill.has_unfinished():
        prefill.step()
        for rid in [r for r in prefill.requests if can_hand_off(prefill, r)]:
            handoff, kv = export_request(prefill, rid)
            assert decode.add_prefilled(handoff, kv)
    return run_to_end(decode)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=30, temperature=1.0, seed=11, logprobs=2),
                                    SamplingParams(max_tokens=30, temperature=0, stop=["e "], ignore_eos=True)],
                         ids=["greedy", "seeded", "stop"])
def test_a_handed_over_request_decodes_as_on_one_engine(artifact, params):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 16, 37, 70)]
    alone = Engine(artifact, EngineConfig(kv_memory="4MiB"))
    for i, ids in enumerate(prompts):
        alone.add_request(str(i), prompt_token_ids=ids, params=params)
    expected = run_to_end(alone)
    prefill, decode = Engine(artifact, EngineConfig(kv_memory="4MiB")), Engine(artifact, EngineConfig(kv_memory="4MiB"))
    got = hand_over(prefill, decode, prompts, params)
    for rid, out in expected.items():
        assert got[rid].outputs[0].text == out.outputs[0].text
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids
        assert got[rid].outputs[0].finish_reason == out.outputs[0].finish_reason
        if params.logprobs:
            def flat(o):
                return [(t, lp.rank) for step in o.outputs[0].logprobs for t, lp in sorted(step.items())]

            def values(o):
                return [lp.logprob for step in o.outputs[0].logprobs for _, lp in sorted(step.items())]
            assert flat(got[rid]) == flat(out) and values(got[rid]) == pytest.approx(values(out), abs=1e-6)
    bm = prefill.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks > 0   # freed, the full ones cached
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_blocks_the_decode_cache_holds_need_not_travel(artifact):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    prefill, decode = Engine(artifact, EngineConfig(kv_memory="4MiB")), Engine(artifact, EngineConfig(kv_memory="4MiB"))
    first = hand_over(prefill, decode, [ids], params)["0"]
    prefill.add_request("again", prompt_token_ids=ids, params=params)
    prefill.step()
    handoff, kv = export_request(prefill, "again")
    bm = decode.block_manager
    held = Sequence(ids + [handoff.first_token])
    assert bm.hold_cached_prefix(held) == 4   # 70 prompt tokens: the first request's 4 full blocks
    bm.check_invariants()
    assert decode.add_prefilled(handoff, kv[:, :, 4:], skipped=4)
    bm.free(held)
    bm.check_invariants()
    assert run_to_end(decode)["again"].outputs[0].token_ids == first.outputs[0].token_ids


def test_packed_blocks_round_trip_into_other_block_ids():
    src, dst = (PagedKVCache(3, 12, 4, 2, 8, torch.float32) for _ in range(2))
    for cache in (src._k_layers, src._v_layers):
        cache.copy_(torch.randn_like(cache))
    dst.import_blocks([0, 9, 4], src.export_blocks([5, 2, 11]))
    for a, b in ((src._k_layers, dst._k_layers), (src._v_layers, dst._v_layers)):
        assert torch.equal(b[:, [0, 9, 4]], a[:, [5, 2, 11]])


def test_a_handed_over_request_that_can_never_fit_is_refused(artifact):
    prefill = Engine(artifact, EngineConfig(kv_memory="4MiB"))
    small = Engine(artifact, EngineConfig(kv_memory="16KiB"))   # 2 blocks
    prefill.add_request("r", prompt_token_ids=list(range(3, 60)), params=SamplingParams(max_tokens=5))
    prefill.step()
    handoff, kv = export_request(prefill, "r")
    with pytest.raises(RuntimeLlmcError, match="KV blocks"):
        small.add_prefilled(handoff, kv)
    assert small.block_manager.num_free_blocks == 2 and not small.requests
