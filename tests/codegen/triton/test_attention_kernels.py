"""The Triton attention kernels (codegen/triton/triton_attention.py), run in Triton's interpreter: the
KV-cache write against runtime/paged_attention.PagedKVCache (bit for bit), prefill and decode
attention against float64 torch SDPA on the keys and values gathered through the block tables,
and against the PagedAttention backend, with rotary checked against compiler.ops.apply_rope."""

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from llmc.codegen.triton.triton_attention import (
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    render_decode,
    render_decode_reduce,
    render_kv_cache_write,
    render_prefill,
    write_kv_cache,
)
from llmc.codegen.triton.triton_configs import ATTENTION_CONFIGS, AttentionConfig, attention_config
from llmc.codegen.triton.triton_render import kernel_cache_dir
from llmc.compiler.ops import apply_rope, rope_cos_sin
from llmc.errors import TargetError
from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/codegen/triton/conftest.py sets the interpreter"
pytestmark = pytest.mark.triton

# Small tiles: many programs, ragged tiles, several key steps per sequence.
SMALL = AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, decode_block_n=16, decode_num_warps=4,
                        decode_num_stages=1, split_keys=32, max_splits=8, num_sms=8)
QUANTIZED = (torch.int8, torch.float8_e4m3fn)
# fp32 kernels against float64; 16-bit outputs within one rounding of theirs (the interpreter
# truncates fp32 -> bf16 where GPUs round to nearest, so up to one bf16 ulp, 2^-7 relative)
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2**-10, atol=1e-4),
             torch.bfloat16: dict(rtol=2**-7, atol=1e-4)}


def inv_freq_for(head_dim, base=10000.0):
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rotated(x, positions, inv_freq, head_dim, scaling):
    """compiler.ops' rotary in float64."""
    cos, sin = rope_cos_sin(positions, inv_freq, scaling, torch.float64)
    return apply_rope(x.double(), cos, sin, head_dim)


@dataclass
class PagedBatch:
    """Sequences (context_start, q_len) whose keys and values sit in shuffled cache blocks."""
    seqs: list
    tables: list                 # per sequence, block ids covering its context
    cache: PagedKVCache          # layer 0 is used; every slot holds random keys/values
    q: torch.Tensor              # [tokens, heads * head_dim]
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def block_tables(self):      # [seqs, max_blocks] int32, padded with block 0
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)

    @property
    def cu_seqlens(self):
        return torch.tensor([0] + [sum(n for _, n in self.seqs[:i + 1]) for i in range(len(self.seqs))],
                            dtype=torch.int32)

    @property
    def context_starts(self):
        return torch.tensor([s for s, _ in self.seqs], dtype=torch.int32)

    @property
    def context_lens(self):
        return torch.tensor([s + n for s, n in self.seqs], dtype=torch.int32)

    @property
    def kv_scales(self):
        return None if self.cache.kv_scales is None else self.cache.kv_scales[0]

    def caches(self):
        return self.cache.k_cache[0], self.cache.v_cache[0]

    def gathered(self, i):
        """float64 keys and values [context, kv_heads, head_dim] of sequence i, dequantised."""
        start, n = self.seqs[i]
        keys, values = self.cache.read(0, torch.tensor(self.tables[i]), torch.float64)
        shape = (-1, self.kv_heads, self.head_dim)
        return keys.double().reshape(shape)[:start + n], values.double().reshape(shape)[:start + n]


def paged_batch(seqs, *, heads, kv_heads, head_dim, block_size, dtype=torch.float32, cache_dtype=None, seed=0):
    torch.manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    need = [-(-(s + n) // block_size) for s, n in seqs]
    num_blocks = sum(need) + 3                       # spare blocks hold decoys
    order = torch.randperm(num_blocks).tolist()     # non-contiguous, shuffled tables
    tables = [order[sum(need[:i]):sum(need[:i + 1])] for i in range(len(seqs))]
    scales = [torch.rand(2, kv_heads) * 0.02 + 0.01] if cache_dtype in QUANTIZED else None
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype, kv_scales=scales)
    slots = torch.arange(num_blocks * block_size)
    fill = torch.randn(2, len(slots), kv_heads, head_dim)
    fill = fill if cache_dtype in QUANTIZED else fill.to(cache_dtype)   # quantised caches take fp32 and round
    cache.write(0, slots, fill[0], fill[1])
    q = torch.randn(sum(n for _, n in seqs), heads * head_dim).to(dtype)
    return PagedBatch(seqs, tables, cache, q, heads, kv_heads, head_dim)


def sdpa_reference(batch, q, *, scale, causal=True, window=None, positions=None, inv_freq=None, scaling=1.0):
    """float64 SDPA of each sequence's queries over its gathered keys, with an explicit mask."""
    h, d = batch.heads, batch.head_dim
    q = q.double() if positions is None else rotated(q, positions, inv_freq, d, scaling)
    out, row = [], 0
    for i, (start, n) in enumerate(batch.seqs):
        keys, values = batch.gathered(i)
        q_pos = torch.arange(start, start + n)[:, None]
        k_pos = torch.arange(start + n)[None, :]
        mask = (k_pos <= q_pos) if causal else torch.ones(n, start + n, dtype=torch.bool)
        if window is not None:
            mask &= k_pos > q_pos - window
        qh = q[row:row + n].reshape(n, h, d).transpose(0, 1)
        o = F.scaled_dot_product_attention(qh, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
                                           scale=scale, enable_gqa=h != batch.kv_heads)
        out.append(o.transpose(0, 1).reshape(n, h * d))
        row += n
    return torch.cat(out)


def prefill(batch, **kw):
    k_cache, v_cache = batch.caches()
    return paged_prefill_attention(batch.q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens,
                                   batch.context_starts, num_heads=batch.heads, num_kv_heads=batch.kv_heads,
                                   head_dim=batch.head_dim, kv_scales=batch.kv_scales, **kw)


def decode(batch, **kw):
    k_cache, v_cache = batch.caches()
    return paged_decode_attention(batch.q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                  num_heads=batch.heads, num_kv_heads=batch.kv_heads, head_dim=batch.head_dim,
                                  kv_scales=batch.kv_scales, **kw)


def assert_matches(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[dtype])


# --- KV-cache write ----------------------------------------------------------------------------

def cache_pair(num_blocks, block_size, kv_heads, head_dim, dtype):
    """Caches of random contents (codes for int8/fp8), so a stray or missing write shows."""
    raw = torch.randint(0, 120, (2, num_blocks, block_size, kv_heads, head_dim), dtype=torch.uint8)
    if dtype in QUANTIZED:
        return raw[0].view(dtype).clone(), raw[1].view(dtype).clone()
    return raw[0].to(dtype) / 7, raw[1].to(dtype) / 7


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                         torch.float8_e4m3fn])
def test_kv_cache_write_stores_what_paged_kv_cache_stores_bitwise(cache_dtype):
    torch.manual_seed(1)
    kv_heads, head_dim, block_size, num_blocks, t = 3, 20, 4, 6, 11
    act = cache_dtype if cache_dtype not in QUANTIZED else torch.float32
    scales = torch.rand(2, kv_heads) * 0.02 + 0.005 if cache_dtype in QUANTIZED else None
    # magnitudes from 1e-4 to 40: through saturation, the normal range and fp8 subnormals
    spread = torch.logspace(-4, 1.6, kv_heads * head_dim)[torch.randperm(kv_heads * head_dim)]
    k, v = torch.randn(t, kv_heads * head_dim) * spread, torch.randn(t, kv_heads * head_dim) * spread
    k, v = k.to(act), v.to(act)
    slots = torch.randperm(num_blocks * block_size)[:t]
    slots[[2, 7]] = -1                                 # padding tokens
    k_cache, v_cache = cache_pair(num_blocks, block_size, kv_heads, head_dim, cache_dtype)
    ref = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype,
                       kv_scales=None if scales is None else [scales])
    ref.k_cache[0].copy_(k_cache), ref.v_cache[0].copy_(v_cache)
    keep = slots >= 0
    ref.write(0, slots[keep], k[keep].view(-1, kv_heads, head_dim), v[keep].view(-1, kv_heads, head_dim))
    write_kv_cache(k, v, k_cache, v_cache, slots, kv_scales=scales, target="h100-bf16")
    assert torch.equal(k_cache.view(torch.uint8), ref.k_cache[0].view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref.v_cache[0].view(torch.uint8))


def test_fp8_write_rounds_ties_and_saturates_as_torch():
    scale = torch.tensor([[0.5], [0.25]])
    # ties between e4m3 neighbours (normal and subnormal), the largest value, past it, and signs
    values = torch.tensor([1 + 1 / 16, 1 + 3 / 16, -(1 + 5 / 16), 2**-9 * 2.5, -(2**-9 * 1.5), 448.0, 470.0,
                           -1000.0, 2**-12, 0.0, 3.0, -7.5, 240.0, 2**-6, 2**-7 * 1.5, 100.0])
    k = (values * 0.5).reshape(1, 16)
    v = (values * 0.25).reshape(1, 16)
    k_cache, v_cache = cache_pair(1, 1, 1, 16, torch.float8_e4m3fn)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0]), kv_scales=scale.reshape(2, 1))
    expected = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(k_cache.view(torch.uint8).flatten(), expected.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8).flatten(), expected.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype,scaling", [(torch.float32, 1.0), (torch.bfloat16, 0.8), (torch.int8, 1.0)])
def test_kv_cache_write_rotates_keys_as_apply_rope(cache_dtype, scaling):
    torch.manual_seed(2)
    kv_heads, head_dim, block_size, t = 2, 40, 8, 9      # head_dim / 2 = 20: not a power of two
    act = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    k, v = torch.randn(t, kv_heads, head_dim).to(act), torch.randn(t, kv_heads, head_dim).to(act)
    positions = torch.randint(0, 2000, (t,))
    inv_freq = inv_freq_for(head_dim)
    scales = torch.tensor([[0.03, 0.02], [0.025, 0.04]]) if cache_dtype == torch.int8 else None
    slots = torch.randperm(3 * block_size)[:t]
    k_cache, v_cache = cache_pair(3, block_size, kv_heads, head_dim, cache_dtype)
    write_kv_cache(k, v, k_cache, v_cache, slots, kv_scales=scales, positions=positions, inv_freq=inv_freq,
                   rope_scaling=scaling)
    k_rot = rotated(k.reshape(t, -1), positions, inv_freq, head_dim, scaling).reshape(t, kv_heads, head_dim)
    stored_k = k_cache.reshape(-1, kv_heads, head_dim)[slots]
    stored_v = v_cache.reshape(-1, kv_heads, head_dim)[slots]
    if cache_dtype == torch.int8:
        # fp32 against float64 rotation: a code may land one step off at a rounding boundary
        codes = (k_rot / scales[0][:, None]).round().clamp(-127, 127)
        assert (stored_k.double() - codes).abs().max() <= 1
        assert torch.equal(stored_v, (v / scales[1][:, None]).round().clamp(-127, 127).to(torch.int8))
    else:
        torch.testing.assert_close(stored_k.double(), k_rot, **TOLERANCE[cache_dtype])
        assert torch.equal(stored_v, v)


# --- prefill -----------------------------------------------------------------------------------

PREFILL_CASES = {
    # name: (seqs as (context_start, q_len), heads, kv_heads, head_dim, block_size)
    "ragged-gqa-prefix-hits": ([(0, 9), (5, 20), (16, 3), (0, 1)], 4, 2, 24, 4),
    "mqa-head_dim-80": ([(3, 18), (0, 5)], 4, 1, 80, 16),
    "mha-head_dim-64-one-sequence": ([(0, 33)], 2, 2, 64, 8),
    "smollm2-gqa-group-3": ([(0, 21), (16, 5)], 9, 3, 64, 16),   # a group size that is no power of two
}


@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("config", [SMALL, ATTENTION_CONFIGS["h100"]], ids=["small-tiles", "h100-tiles"])
def test_prefill_matches_float64_sdpa_on_gathered_kv(case, config):
    seqs, heads, kv_heads, head_dim, block_size = PREFILL_CASES[case]
    batch = paged_batch(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    out = prefill(batch, scale=head_dim ** -0.5, config=config)
    assert_matches(out, sdpa_reference(batch, batch.q, scale=head_dim ** -0.5), torch.float32)


@pytest.mark.parametrize("window,causal", [(1, True), (7, True), (20, True), (5, False)])
def test_prefill_window_and_non_causal_match_sdpa_masks(window, causal):
    batch = paged_batch([(10, 12), (0, 17), (25, 2)], heads=4, kv_heads=2, head_dim=16, block_size=4, seed=3)
    out = prefill(batch, scale=0.3, causal=causal, window=window, config=SMALL)
    assert_matches(out, sdpa_reference(batch, batch.q, scale=0.3, causal=causal, window=window), torch.float32)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.float32, torch.int8), (torch.bfloat16, torch.float8_e4m3fn)])
def test_prefill_dtypes_and_quantised_caches(dtype, cache_dtype):
    # The reference dequantises the same codes, so only the kernel's arithmetic is measured.
    batch = paged_batch([(6, 10), (0, 7)], heads=4, kv_heads=2, head_dim=48, block_size=8, dtype=dtype,
                        cache_dtype=cache_dtype, seed=4)
    out = prefill(batch, scale=48 ** -0.5, config=SMALL)
    assert_matches(out, sdpa_reference(batch, batch.q, scale=48 ** -0.5), dtype)


@pytest.mark.parametrize("dtype,scaling", [(torch.float32, 1.0), (torch.bfloat16, 1.1)])
def test_prefill_rotates_queries_as_apply_rope(dtype, scaling):
    batch = paged_batch([(4, 9), (0, 6)], heads=2, kv_heads=1, head_dim=32, block_size=4, dtype=dtype, seed=5)
    positions = torch.cat([torch.arange(4, 13), torch.arange(0, 6)]) + 500
    inv_freq = inv_freq_for(32)
    out = prefill(batch, scale=0.2, positions=positions, inv_freq=inv_freq, rope_scaling=scaling, config=SMALL)
    ref = sdpa_reference(batch, batch.q, scale=0.2, positions=positions, inv_freq=inv_freq, scaling=scaling)
    assert_matches(out, ref, dtype)
    assert (ref - sdpa_reference(batch, batch.q, scale=0.2)).abs().max() > 0.1   # the rotation matters


def test_prefill_reads_q_from_a_fused_qkv_slice():
    batch = paged_batch([(2, 5), (0, 4)], heads=2, kv_heads=1, head_dim=16, block_size=4, seed=6)
    qkv = torch.cat([batch.q, torch.randn(batch.q.shape[0], 32)], dim=1)
    out = prefill(batch, scale=0.25, config=SMALL)
    batch.q = qkv[:, :32]                          # row stride 64, not 32
    torch.testing.assert_close(prefill(batch, scale=0.25, config=SMALL), out, rtol=0, atol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_write_then_prefill_and_decode_match_the_paged_attention_backend(cache_dtype):
    """A mixed step (fresh prompt, prefix-hit chunk, two decodes) through the runtime's backend and
    through write_kv_cache + the two kernels, starting from identical caches."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 4, 24
    seqs = [(0, 7), (9, 6), (13, 1), (4, 1)]           # (start, new tokens); the last two decode
    order = torch.randperm(num_blocks).tolist()
    tables = [order[0:2], order[2:6], order[6:10], order[10:12]]
    scales = [torch.rand(2, kv_heads) * 0.02 + 0.01] if cache_dtype == torch.int8 else None
    ref_cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype, kv_scales=scales)
    prefix = torch.tensor([table[p // block_size] * block_size + p % block_size
                           for table, (start, _) in zip(tables, seqs) for p in range(start)])
    ref_cache.write(0, prefix, *torch.randn(2, len(prefix), kv_heads, head_dim))
    k_cache, v_cache = ref_cache.k_cache[0].clone(), ref_cache.v_cache[0].clone()
    meta = StepMetadata.build([(t, s, n) for t, (s, n) in zip(tables, seqs)], block_size)
    t = sum(n for _, n in seqs)
    q, k, v = torch.randn(t, heads * head_dim), torch.randn(t, kv_heads * head_dim), torch.randn(t, kv_heads * head_dim)
    backend = PagedAttention(ref_cache)
    backend.metadata = meta
    ref = backend.forward(0, q, k, v, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=0.17,
                          causal=True)

    kv_scales = None if scales is None else scales[0]
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales=kv_scales)
    assert torch.equal(k_cache.view(torch.uint8), ref_cache.k_cache[0].view(torch.uint8))
    width = max(len(tab) for tab in tables)
    block_tables = torch.tensor([tab + [0] * (width - len(tab)) for tab in tables], dtype=torch.int32)
    common = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=0.17, kv_scales=kv_scales,
                  config=SMALL)
    out = paged_prefill_attention(q[:13], k_cache, v_cache, block_tables[:2], torch.tensor([0, 7, 13]),
                                  torch.tensor([0, 9]), **common)
    torch.testing.assert_close(out, ref[:13], rtol=1e-5, atol=1e-5)
    out = paged_decode_attention(q[13:], k_cache, v_cache, block_tables[2:], torch.tensor([14, 5]), num_splits=2,
                                 **common)
    torch.testing.assert_close(out, ref[13:], rtol=1e-5, atol=1e-5)


# --- decode ------------------------------------------------------------------------------------

def decode_batch(context_lens, **kw):
    """One new token per sequence at position context_len - 1."""
    return paged_batch([(n - 1, 1) for n in context_lens], **kw)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 24), (8, 1, 80), (2, 2, 64), (9, 3, 64)],
                         ids=["gqa", "mqa", "mha", "gqa-group-3"])
def test_decode_matches_float64_sdpa_over_splits(num_splits, heads, kv_heads, head_dim):
    # 3 keys: most of five splits are empty; 150 keys: every split takes several key tiles
    batch = decode_batch([150, 3, 41, 77], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=8, seed=8)
    out = decode(batch, scale=head_dim ** -0.5, num_splits=num_splits, config=SMALL)
    assert_matches(out, sdpa_reference(batch, batch.q, scale=head_dim ** -0.5), torch.float32)


def test_decode_picks_several_splits_for_long_contexts():
    batch = decode_batch([200, 9], heads=4, kv_heads=2, head_dim=16, block_size=16, seed=9)
    assert decode_num_splits(SMALL, 200, 2, 2) == 2        # 8 SMs over 4 (sequence, kv head) programs
    out = decode(batch, scale=0.25, config=SMALL)
    assert_matches(out, sdpa_reference(batch, batch.q, scale=0.25), torch.float32)


@pytest.mark.parametrize("window", [1, 10, 64])
def test_decode_sliding_window_matches_sdpa(window):
    batch = decode_batch([100, 12, 57], heads=4, kv_heads=2, head_dim=16, block_size=4, seed=10)
    out = decode(batch, scale=0.25, window=window, num_splits=3, config=SMALL)
    assert_matches(out, sdpa_reference(batch, batch.q, scale=0.25, window=window), torch.float32)


@pytest.mark.parametrize("dtype,cache_dtype,num_splits", [(torch.bfloat16, torch.bfloat16, 3),
                                                          (torch.float16, torch.float16, 1),
                                                          (torch.float32, torch.int8, 4),
                                                          (torch.float16, torch.float8_e4m3fn, 2)])
def test_decode_dtypes_and_quantised_caches(dtype, cache_dtype, num_splits):
    batch = decode_batch([70, 5, 33], heads=4, kv_heads=2, head_dim=48, block_size=8, dtype=dtype,
                         cache_dtype=cache_dtype, seed=11)
    out = decode(batch, scale=48 ** -0.5, num_splits=num_splits, config=SMALL)
    assert_matches(out, sdpa_reference(batch, batch.q, scale=48 ** -0.5), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rotates_the_query_as_apply_rope(num_splits):
    batch = decode_batch([40, 7], heads=4, kv_heads=2, head_dim=24, block_size=4, seed=12)
    positions = batch.context_lens.long() - 1
    inv_freq = inv_freq_for(24, base=500.0)
    out = decode(batch, scale=0.2, num_splits=num_splits, positions=positions, inv_freq=inv_freq, config=SMALL)
    ref = sdpa_reference(batch, batch.q, scale=0.2, positions=positions, inv_freq=inv_freq)
    assert_matches(out, ref, torch.float32)


def test_decode_with_target_tiles_and_its_own_split_choice():
    batch = decode_batch([300, 20], heads=2, kv_heads=1, head_dim=32, block_size=16, seed=13)
    config = attention_config("h100-fp8")
    assert decode_num_splits(config, 300, 2, 1) == 2      # 300 keys / 256 a split
    out = decode(batch, scale=0.2, target="h100-fp8")
    assert_matches(out, sdpa_reference(batch, batch.q, scale=0.2), torch.float32)


# --- split policy, rendering, operand checks ---------------------------------------------------

def test_split_policy_follows_context_length_and_occupancy():
    h100 = attention_config("h100")
    assert decode_num_splits(h100, 100, 1, 8) == 1                 # short context: one split
    assert decode_num_splits(h100, 1000, 1, 8) == 4                # 256 keys a split at least
    assert decode_num_splits(h100, 100_000, 1, 8) == h100.max_splits
    assert decode_num_splits(h100, 100_000, 64, 8) == 1            # 512 programs fill 132 SMs already
    assert decode_num_splits(h100, 100_000, 4, 8) == 5             # 32 programs * 5 >= 132


def test_rendering_is_deterministic_and_constants_change_the_source():
    def prefill_kernel(**kw):
        args = dict(num_heads=4, num_kv_heads=2, block_size=16) | kw
        return render_prefill("h100", torch.bfloat16, torch.bfloat16, 64, **args)
    base = prefill_kernel()
    assert base.source == render_prefill("h100", "bfloat16", "bfloat16", 64, num_heads=4, num_kv_heads=2,
                                         block_size=16).source
    variants = [prefill_kernel(num_kv_heads=1), prefill_kernel(causal=False), prefill_kernel(window=True),
                prefill_kernel(rope=True), prefill_kernel(block_size=32), prefill_kernel(config=SMALL),
                render_prefill("a100", "bfloat16", "bfloat16", 64, num_heads=4, num_kv_heads=2, block_size=16),
                render_prefill("h100", "bfloat16", "float8_e4m3fn", 64, num_heads=4, num_kv_heads=2, block_size=16),
                render_prefill("h100", "float32", "bfloat16", 80, num_heads=4, num_kv_heads=2, block_size=16)]
    others = [render_decode("h100", "float16", "int8", 96, num_heads=8, num_kv_heads=2, block_size=16, split_k=k,
                            window=w, rope=r) for k, w, r in ((True, False, False), (False, True, True))]
    others += [render_decode_reduce("h100", "bfloat16", 96, num_splits=4),
               render_kv_cache_write("h100", "bfloat16", "float8_e4m3fn", 96, num_kv_heads=2, block_size=16,
                                     rope=True),
               render_kv_cache_write("h100", "bfloat16", "int8", 96, num_kv_heads=2, block_size=16)]
    kernels = [base] + variants + others
    assert len({k.sha256 for k in kernels}) == len(kernels)
    for kernel in kernels:
        assert "{{" not in kernel.source and "{%" not in kernel.source
        compile(kernel.source, kernel.template, "exec")  # valid Python
        assert f"def {kernel.name}(" in kernel.source


def test_launches_run_the_sources_their_render_functions_give():
    batch = decode_batch([30, 9], heads=2, kv_heads=1, head_dim=16, block_size=4, dtype=torch.float16, seed=14)
    decode(batch, scale=0.25, num_splits=3, config=SMALL)
    kernels = [render_decode("h100", torch.float16, torch.float16, 16, num_heads=2, num_kv_heads=1, block_size=4,
                             split_k=True, config=SMALL),
               render_decode_reduce("h100", torch.float16, 16, num_splits=3)]
    for kernel in kernels:
        assert (kernel_cache_dir() / f"{kernel.sha256}.py").read_text(encoding="utf-8") == kernel.source


def test_unknown_targets_and_mismatched_operands_are_refused():
    batch = paged_batch([(0, 3)], heads=4, kv_heads=2, head_dim=16, block_size=4)
    k_cache, v_cache = batch.caches()
    with pytest.raises(TargetError, match="mi300"):
        attention_config("mi300")
    with pytest.raises(ValueError, match="holds 2 heads of 16 dims"):
        paged_prefill_attention(
            batch.q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens, batch.context_starts, num_heads=4,
            num_kv_heads=1, head_dim=16, scale=0.25)
    with pytest.raises(ValueError, match="window must be at least 1"):
        prefill(batch, scale=0.25, window=0)
    with pytest.raises(ValueError, match="both positions and inv_freq"):
        prefill(batch, scale=0.25, positions=torch.arange(3))
    with pytest.raises(ValueError, match="int8 KV cache needs kv_scales"):
        write_kv_cache(torch.randn(1, 32), torch.randn(1, 32), k_cache.to(torch.int8), v_cache.to(torch.int8),
                       torch.tensor([0]))
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        write_kv_cache(torch.randn(2, 32), torch.randn(2, 32), k_cache, v_cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="context_lens must have shape"):
        paged_decode_attention(batch.q[:1], k_cache, v_cache, batch.block_tables, torch.tensor([3, 4]), num_heads=4,
                               num_kv_heads=2, head_dim=16, scale=0.25)


def test_no_tokens_give_an_empty_result():
    batch = paged_batch([(0, 3)], heads=2, kv_heads=1, head_dim=16, block_size=4)
    k_cache, v_cache = batch.caches()
    out = paged_prefill_attention(torch.randn(0, 32), k_cache, v_cache, torch.zeros(0, 1, dtype=torch.int32),
                                  torch.tensor([0]), torch.zeros(0, dtype=torch.int32), num_heads=2, num_kv_heads=1,
                                  head_dim=16, scale=0.25)
    assert out.shape == (0, 32)
    write_kv_cache(torch.randn(0, 16), torch.randn(0, 16), k_cache, v_cache, torch.zeros(0, dtype=torch.long))
