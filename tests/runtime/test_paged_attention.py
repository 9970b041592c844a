"""The paged KV cache and its attention backend: a mixed batch (a prefill chunk starting
mid-sequence, fresh prefills, decodes) over random block tables equals float64 attention
over each sequence's whole context, writes land in the right slots, and copy-on-write
copies whole blocks in every layer."""

import pytest
import torch

from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 4, 2, 8, 4, 48, 2
SCALE = HEAD_DIM ** -0.5


def random_cache(gen: torch.Generator) -> PagedKVCache:
    cache = PagedKVCache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    for t in cache.k_cache + cache.v_cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def read_context(cache_layer: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """[length, kv_heads, head_dim]: positions 0..length-1 of one sequence, slot by slot."""
    return torch.stack([cache_layer[table[p // BLOCK], p % BLOCK] for p in range(length)])


def float64_attention(q, k, v, start, window=None):
    """q: [t, heads*hd] at positions start..; k/v: [ctx, kv_heads, hd]; a query at position p sees
    keys 0..p, or with `window` keys p - window + 1 .. p. One head at a time."""
    q, k, v = q.double(), k.double(), v.double()
    t, group = q.shape[0], HEADS // KV_HEADS
    out = torch.empty(t, HEADS * HEAD_DIM, dtype=torch.float64)
    for h in range(HEADS):
        qh, kh, vh = q[:, h * HEAD_DIM:(h + 1) * HEAD_DIM], k[:, h // group], v[:, h // group]
        scores = qh @ kh.T * SCALE
        positions = (start + torch.arange(t))[:, None]
        visible = torch.arange(k.shape[0])[None, :] <= positions
        if window is not None:
            visible &= torch.arange(k.shape[0])[None, :] > positions - window
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[:, h * HEAD_DIM:(h + 1) * HEAD_DIM] = weights @ vh
    return out


def random_tables(gen, lengths: list[int]) -> list[list[int]]:
    """Disjoint block tables in random order, enough blocks for each total length."""
    ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = []
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(ids[:need])
        ids = ids[need:]
    return tables


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_matches_float64_attention_over_whole_context(seed):
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache(gen)
    # (tokens already in the cache, new tokens): a prefill chunk from mid-sequence, decodes
    # (one exactly at a block boundary), a fresh prefill and a one-token prompt
    shapes = [(int(torch.randint(5, 30, (1,), generator=gen)), 7), (5, 1), (16, 1), (22, 1), (0, 9), (0, 1)]
    tables = random_tables(gen, [start + n for start, n in shapes])
    tokens = sum(n for _, n in shapes)
    q = torch.randn(tokens, HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS * HEAD_DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS * HEAD_DIM, generator=gen)
    layer = 1
    before = [(read_context(cache.k_cache[layer], t, s), read_context(cache.v_cache[layer], t, s))
              if s else (torch.empty(0, KV_HEADS, HEAD_DIM),) * 2 for t, (s, _) in zip(tables, shapes)]
    untouched_layer = cache.k_cache[0].clone()

    backend = PagedAttention(cache)
    backend.metadata = StepMetadata.build([(t, s, n) for t, (s, n) in zip(tables, shapes)], BLOCK)
    out = backend.forward(layer, q, k, v, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          scale=SCALE, causal=True)

    row = 0
    for table, (start, n), (old_k, old_v) in zip(tables, shapes, before):
        new_k = k[row:row + n].reshape(n, KV_HEADS, HEAD_DIM)
        new_v = v[row:row + n].reshape(n, KV_HEADS, HEAD_DIM)
        expected = float64_attention(q[row:row + n], torch.cat([old_k, new_k]),
                                     torch.cat([old_v, new_v]), start)
        torch.testing.assert_close(out[row:row + n].double(), expected, atol=1e-5, rtol=1e-5)
        # the new keys and values sit in their slots; the old context is intact
        assert torch.equal(read_context(cache.k_cache[layer], table, start + n), torch.cat([old_k, new_k]))
        assert torch.equal(read_context(cache.v_cache[layer], table, start + n), torch.cat([old_v, new_v]))
        row += n
    assert torch.equal(cache.k_cache[0], untouched_layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_fresh_prefills_attend_as_one_batch_and_match_float64(dtype):
    """Three 7-token prompts side by side run as one batched attention (fresh_prefill_runs); a decode, a
    5-token prompt and a chunk from mid-sequence around them keep their own paths."""
    gen = torch.Generator().manual_seed(5)
    cache = PagedKVCache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    for t in cache.k_cache + cache.v_cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    shapes = [(0, 7), (0, 7), (0, 7), (9, 1), (0, 5), (6, 3)]
    tables = random_tables(gen, [start + n for start, n in shapes])
    tokens = sum(n for _, n in shapes)
    q, k, v = (torch.randn(tokens, h * HEAD_DIM, generator=gen).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    before = [(read_context(cache.k_cache[0], t, s), read_context(cache.v_cache[0], t, s))
              if s else (torch.empty(0, KV_HEADS, HEAD_DIM, dtype=dtype),) * 2 for t, (s, _) in zip(tables, shapes)]
    backend = PagedAttention(cache)
    backend.metadata = StepMetadata.build([(t, s, n) for t, (s, n) in zip(tables, shapes)], BLOCK)
    assert backend.metadata.fresh_prefill_runs == [(0, 3, 7)]
    out = backend.forward(0, q, k, v, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          scale=SCALE, causal=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    row = 0
    for (start, n), (old_k, old_v) in zip(shapes, before):
        new_k, new_v = (x[row:row + n].reshape(n, KV_HEADS, HEAD_DIM) for x in (k, v))
        expected = float64_attention(q[row:row + n], torch.cat([old_k, new_k]), torch.cat([old_v, new_v]), start)
        torch.testing.assert_close(out[row:row + n].double(), expected, **tol)
        row += n


@pytest.mark.parametrize("window", [None, 6])
def test_bf16_decodes_match_float64_attention(window):
    """A decode-only bf16 batch takes the block-diagonal GEMM path (every KV head scored at once, the
    bias keeping each query head's own): within bf16 rounding of float64 attention over the same
    bf16 cache, sliding window included."""
    gen = torch.Generator().manual_seed(11)
    cache = PagedKVCache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    for t in cache.k_cache + cache.v_cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    starts = [3, 16, 29, 9]                       # tokens already cached; one decode token each
    tables = random_tables(gen, [s + 1 for s in starts])
    q, k, v = (torch.randn(len(starts), h * HEAD_DIM, generator=gen).bfloat16()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    backend = PagedAttention(cache)
    backend.metadata = StepMetadata.build([(t, s, 1) for t, s in zip(tables, starts)], BLOCK)
    out = backend.forward(0, q, k, v, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          scale=SCALE, causal=True, window=window)
    assert out.dtype == torch.bfloat16
    for i, (table, start) in enumerate(zip(tables, starts)):
        keys, values = (read_context(c[0], table, start + 1) for c in (cache.k_cache, cache.v_cache))
        expected = float64_attention(q[i:i + 1], keys, values, start, window)
        torch.testing.assert_close(out[i:i + 1].double(), expected, atol=3e-2, rtol=2e-2)


def test_writes_touch_only_the_scheduled_slots():
    gen = torch.Generator().manual_seed(3)
    cache = random_cache(gen)
    tables = random_tables(gen, [13, 6])
    shapes = [(10, 3), (5, 1)]
    before = cache.v_cache[0].clone()
    backend = PagedAttention(cache)
    backend.metadata = StepMetadata.build([(t, s, n) for t, (s, n) in zip(tables, shapes)], BLOCK)
    backend.forward(0, torch.randn(4, HEADS * HEAD_DIM, generator=gen),
                    torch.randn(4, KV_HEADS * HEAD_DIM, generator=gen),
                    torch.randn(4, KV_HEADS * HEAD_DIM, generator=gen),
                    num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=SCALE, causal=True)
    written = {(tables[0][p // BLOCK], p % BLOCK) for p in range(10, 13)} | {(tables[1][1], 1)}
    changed = {(b, s) for b in range(NUM_BLOCKS) for s in range(BLOCK)
               if not torch.equal(cache.v_cache[0][b, s], before[b, s])}
    assert changed == written


def test_copy_blocks_copies_every_layer_and_nothing_else():
    gen = torch.Generator().manual_seed(4)
    cache = random_cache(gen)
    before = [t.clone() for t in cache.k_cache + cache.v_cache]
    src, dst = torch.randperm(NUM_BLOCKS, generator=gen)[:6].view(2, 3).tolist()
    cache.copy_blocks(list(zip(src, dst)))
    for old, new in zip(before, cache.k_cache + cache.v_cache):
        expected = old.clone()
        expected[dst] = old[src]
        assert torch.equal(new, expected)
        assert not torch.equal(new, old)


def test_copy_blocks_with_no_pairs_changes_nothing():
    cache = random_cache(torch.Generator().manual_seed(5))
    before = cache.k_cache[1].clone()
    cache.copy_blocks([])
    assert torch.equal(cache.k_cache[1], before)
