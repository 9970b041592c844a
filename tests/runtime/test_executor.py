"""The plan executor and the attention backends: logits equal an op-by-op reference run,
activations die when the memory plan says, and cached decoding equals a full forward."""

import weakref

import pytest
import torch
from contiguous_kv_cache import ContiguousKVCache

from llmc.codegen.plan import Plan, build_plan
from llmc.errors import ArtifactError, RuntimeLlmcError
from llmc.runtime.attention import NoCacheAttention
from llmc.runtime.executor import PlanExecutor

from tiny_llama import HEAD_DIM, HEADS, KV_HEADS, build_tiny_llama, random_tokens, reference_outputs

ATTN = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM ** -0.5)


def executor_for(graph, max_tokens=16):
    # Through JSON, so the executor sees only what an artifact holds.
    plan = Plan.from_json(build_plan(graph, "cpu", max_tokens).to_json())
    return PlanExecutor(plan, dict(graph.weights))


def naive_attention(q, k, v, *, start, num_heads, num_kv_heads, head_dim, scale, causal=True):
    """float64 softmax(QK^T)V, one head at a time; query i sits at position start + i."""
    q, k, v = q.double(), k.double(), v.double()
    t, ctx, group = q.shape[0], k.shape[0], num_heads // num_kv_heads
    out = torch.empty(t, num_heads * head_dim, dtype=torch.float64)
    for h in range(num_heads):
        kv = h // group
        qh = q[:, h * head_dim:(h + 1) * head_dim]
        kh, vh = k[:, kv * head_dim:(kv + 1) * head_dim], v[:, kv * head_dim:(kv + 1) * head_dim]
        scores = qh @ kh.T * scale
        if causal:
            future = torch.arange(ctx)[None, :] > (start + torch.arange(t))[:, None]
            scores = scores.masked_fill(future, float("-inf"))
        out[:, h * head_dim:(h + 1) * head_dim] = scores.softmax(-1) @ vh
    return out


def random_qkv(t, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, HEADS * HEAD_DIM, generator=gen)
    k, v = (torch.randn(t, KV_HEADS * HEAD_DIM, generator=gen) for _ in range(2))
    return q, k, v


# -- executor ------------------------------------------------------------------------------
@pytest.mark.parametrize("aten_scale", [False, True])
def test_logits_match_op_by_op_reference(aten_scale):
    graph = build_tiny_llama(seed=3, aten_scale=aten_scale)
    ids, positions = random_tokens(9)
    want = reference_outputs(graph, {"input_ids": ids, "positions": positions})["logits"]
    got = executor_for(graph).run(ids, positions, NoCacheAttention())
    assert got.shape == (9, 50)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_run_values_returns_every_plan_output():
    graph = build_tiny_llama()
    graph.outputs = ["logits", "l0.attn"]
    ids, positions = random_tokens(4)
    want = reference_outputs(graph, {"input_ids": ids, "positions": positions})
    got = executor_for(graph).run_values({"input_ids": ids, "positions": positions})
    assert set(got) == {"logits", "l0.attn"}
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5)


def test_logit_rows_are_selected_before_the_lm_head():
    graph = build_tiny_llama(seed=4, select_rows=True)
    ids, positions = random_tokens(7)
    rows = torch.tensor([6, 2])
    inputs = {"input_ids": ids, "positions": positions, "logits_indices": rows}
    got = executor_for(graph).run_values(inputs)["logits"]
    want = reference_outputs(build_tiny_llama(seed=4), inputs)["logits"][rows]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_activations_are_released_when_their_value_dies():
    graph = build_tiny_llama()
    ex = executor_for(graph)
    lifetimes, outputs = ex.plan.memory.lifetimes, set(ex.plan.outputs)
    alive: dict[str, weakref.ref] = {}
    most_alive = 0

    def watch(step, launch):
        def run(*args, **kwargs):
            nonlocal most_alive
            # the executor's loop still holds the previous step's results list
            stale = [v for v, ref in alive.items()
                     if ref() is not None and lifetimes[v][1] < step - 1 and v not in outputs]
            assert not stale, f"step {step}: dead values still held: {stale}"
            most_alive = max(most_alive, sum(ref() is not None for ref in alive.values()))
            results = launch.fn(*args, **kwargs)
            alive.update({v: weakref.ref(t) for v, t in zip(ex.plan.steps[step].outputs, results)})
            return results
        return launch._replace(fn=run)

    ex._program = [watch(i, launch) for i, launch in enumerate(ex._program)]
    ex.run(*random_tokens(6), NoCacheAttention())
    assert 0 < most_alive <= len(ex.plan.memory.slot_bytes) + 1


def test_missing_weight_is_an_artifact_error():
    graph = build_tiny_llama()
    weights = dict(graph.weights)
    del weights["layers.1.up_proj"]
    with pytest.raises(ArtifactError, match="layers.1.up_proj"):
        PlanExecutor(build_plan(graph, "cpu", 8), weights)


def test_more_tokens_than_the_plan_allows_is_refused():
    ex = executor_for(build_tiny_llama(), max_tokens=4)
    with pytest.raises(RuntimeLlmcError, match="over the 4"):
        ex.run(*random_tokens(5))


def test_wrong_input_dtype_or_missing_input_is_refused():
    ex = executor_for(build_tiny_llama())
    ids, positions = random_tokens(3)
    with pytest.raises(RuntimeLlmcError, match="positions"):
        ex.run(ids, positions.float())
    with pytest.raises(RuntimeLlmcError, match="positions"):
        ex.run_values({"input_ids": ids})


# -- attention backends --------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_no_cache_attention_matches_float64_naive(causal):
    q, k, v = random_qkv(7, seed=11)
    got = NoCacheAttention().forward(0, q, k, v, causal=causal, **ATTN)
    want = naive_attention(q, k, v, start=0, causal=causal, **ATTN)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_contiguous_cache_chunks_match_float64_naive_over_the_whole_sequence():
    q, k, v = random_qkv(8, seed=12)
    cache = ContiguousKVCache(num_layers=2, max_len=10, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    want = naive_attention(q, k, v, start=0, **ATTN)
    for start, end in [(0, 5), (5, 6), (6, 8)]:
        got = cache.forward(1, q[start:end], k[start:end], v[start:end], causal=True, **ATTN)
        torch.testing.assert_close(got.double(), want[start:end], atol=1e-5, rtol=1e-5)
        cache.advance(end - start)
    assert cache.length == 8


def test_contiguous_cache_refuses_to_overflow_naming_the_lengths():
    q, k, v = random_qkv(4, seed=13)
    cache = ContiguousKVCache(num_layers=1, max_len=6, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    cache.forward(0, q, k, v, causal=True, **ATTN)
    cache.advance(4)
    with pytest.raises(RuntimeLlmcError, match=r"4 cached tokens \+ 3 new exceed max_len 6"):
        cache.forward(0, *random_qkv(3, seed=14), causal=True, **ATTN)
    with pytest.raises(RuntimeLlmcError, match="max_len 6"):
        cache.advance(3)
    cache.reset()
    assert cache.length == 0


def test_incremental_decode_matches_one_full_forward():
    graph = build_tiny_llama(seed=5)
    ex = executor_for(graph)
    ids, positions = random_tokens(8, seed=9)
    full = ex.run(ids, positions, NoCacheAttention())
    cache = ContiguousKVCache(**ex.plan.kv_layout(), max_len=8)
    steps = [ex.run(ids[:5], positions[:5], cache)]
    cache.advance(5)
    for i in range(5, 8):
        steps.append(ex.run(ids[i:i + 1], positions[i:i + 1], cache))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)
    cache.reset()
    torch.testing.assert_close(ex.run(ids[:5], positions[:5], cache), full[:5], atol=1e-5, rtol=1e-5)
