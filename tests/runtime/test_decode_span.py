"""A single decode whose KV blocks are consecutive in the cache reads them as a view (no gather):
its output equals float64 attention over its context, with and without a sliding window, and
equals the gathering path's over the same keys held in scattered blocks."""

import pytest
import torch

from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 6, 2, 8, 4, 40
SCALE = HEAD_DIM ** -0.5


def float64_decode(q, k, v, window):
    """q: [heads*hd] at the last position; k/v: [ctx, kv_heads, hd]."""
    ctx, group = k.shape[0], HEADS // KV_HEADS
    seen = slice(0 if window is None else max(0, ctx - window), ctx)
    out = []
    for h in range(HEADS):
        kh, vh = k[seen, h // group].double(), v[seen, h // group].double()
        weights = (kh @ q[h * HEAD_DIM:(h + 1) * HEAD_DIM].double() * SCALE).softmax(dim=0)
        out.append(weights @ vh)
    return torch.cat(out)


def decode(cache, table, start, q, k, v, window):
    backend = PagedAttention(cache)
    backend.metadata = StepMetadata.build([(table, start, 1)], BLOCK)
    out = backend.forward(0, q[None], k[None], v[None], num_heads=HEADS, num_kv_heads=KV_HEADS,
                          head_dim=HEAD_DIM, scale=SCALE, causal=True, window=window)
    return out[0], backend.metadata


@pytest.mark.parametrize("window", [None, 3, 6, 100])
@pytest.mark.parametrize("start", [4, 9, 15])
def test_consecutive_blocks_decode_matches_float64_and_the_gathering_path(window, start):
    gen = torch.Generator().manual_seed(start * 7 + (window or 0))
    used = start // BLOCK + 1
    first = int(torch.randint(0, NUM_BLOCKS - used, (1,), generator=gen))
    spans = list(range(first, first + used))
    scattered = [b for b in torch.randperm(NUM_BLOCKS, generator=gen).tolist() if b not in spans][:used]
    if scattered == list(range(scattered[0], scattered[0] + used)):
        scattered.reverse()
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    context_k = torch.randn(used * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    context_v = torch.randn(used * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    for table in (spans, scattered):
        cache.k_cache[0][table] = context_k.view(used, BLOCK, KV_HEADS, HEAD_DIM)
        cache.v_cache[0][table] = context_v.view(used, BLOCK, KV_HEADS, HEAD_DIM)
    q = torch.randn(HEADS * HEAD_DIM, generator=gen)
    k, v = (torch.randn(KV_HEADS * HEAD_DIM, generator=gen) for _ in range(2))

    got, meta = decode(cache, spans, start, q, k, v, window)
    gathered, other = decode(cache, scattered, start, q, k, v, window)
    assert meta.decode_span == (first, used, start + 1) and other.decode_span is None
    keys = torch.cat([context_k[:start], k.view(1, KV_HEADS, HEAD_DIM)])
    values = torch.cat([context_v[:start], v.view(1, KV_HEADS, HEAD_DIM)])
    want = float64_decode(q, keys, values, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gathered.double(), want, atol=1e-5, rtol=1e-5)
