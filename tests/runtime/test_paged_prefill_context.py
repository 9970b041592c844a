"""A prefill chunk from position 0 attends to its own keys and values: with an unquantised cache it
takes them from the step's k and v instead of gathering them back out of the cache (the same
numbers), while a quantised cache still reads them back through its codes."""

import pytest
import torch

from llmc.runtime.kv_quant import dequantize_kv, quantize_kv
from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 16
SCALE = HEAD_DIM ** -0.5


def float64_causal(q, k, v):
    """q [t, heads*hd], k/v [t, kv_heads, hd] from position 0; one head at a time in float64."""
    t, group = q.shape[0], HEADS // KV_HEADS
    out = torch.empty(t, HEADS * HEAD_DIM, dtype=torch.float64)
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    for h in range(HEADS):
        cols = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        scores = q[:, cols].double() @ k[:, h // group].double().T * SCALE
        out[:, cols] = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v[:, h // group].double()
    return out


def fresh_prefill(cache, gen, n=11):
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:-(-n // BLOCK)].tolist()
    q = torch.randn(n, HEADS * HEAD_DIM, generator=gen)
    k, v = (torch.randn(n, KV_HEADS * HEAD_DIM, generator=gen) for _ in range(2))
    backend = PagedAttention(cache)
    backend.metadata = StepMetadata.build([(table, 0, n)], BLOCK)
    out = backend.forward(0, q, k, v, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          scale=SCALE, causal=True)
    return out, q, k.reshape(n, KV_HEADS, HEAD_DIM), v.reshape(n, KV_HEADS, HEAD_DIM), table


def test_unquantised_fresh_prefill_reads_nothing_back_and_still_fills_the_cache(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    monkeypatch.setattr(cache, "read", lambda *a: pytest.fail("a fresh prefill gathered its keys from the cache"))
    out, q, k, v, table = fresh_prefill(cache, gen)
    torch.testing.assert_close(out.double(), float64_causal(q, k, v), atol=1e-5, rtol=1e-5)
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(k.shape[0])]
    assert torch.equal(cache.k_cache[0].view(-1, KV_HEADS, HEAD_DIM)[slots], k)
    assert torch.equal(cache.v_cache[0].view(-1, KV_HEADS, HEAD_DIM)[slots], v)


def test_int8_cache_fresh_prefill_attends_to_the_stored_codes():
    gen = torch.Generator().manual_seed(1)
    scales = torch.rand(2, KV_HEADS, generator=gen) / 20 + 0.01
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.int8, kv_scales=[scales])
    out, q, k, v, _ = fresh_prefill(cache, gen)
    k_stored, v_stored = (dequantize_kv(quantize_kv(x, s, torch.int8), s) for x, s in ((k, scales[0]), (v, scales[1])))
    assert not torch.equal(k_stored, k)
    torch.testing.assert_close(out.double(), float64_causal(q, k_stored, v_stored), atol=1e-5, rtol=1e-5)
