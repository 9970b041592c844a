"""The native decode kernels (codegen/cpu_native.py) against float64 references: rotary, the cache
write and paged attention for several sequences with scattered block tables, sliding windows, GQA
groups and head sizes on and off the vector fast path; and the torch fallback."""

import os
import subprocess
import sys

import pytest
import torch

from llmc.codegen import cpu_native
from llmc.compiler.ops import apply_rope, rope_cos_sin

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"native kernels {cpu_native.status()}")

BLOCK = 4


def _reference(q, k, v, cos, sin, k_rows, v_rows, slots, tables, lens, window, heads, kv_heads, hd, scale):
    """float64: rotate, write, then attend per sequence and query head."""
    k_rows, v_rows = k_rows.double().clone(), v_rows.double().clone()
    q, k = (apply_rope(x.double(), c.double(), s.double(), hd) if cos is not None else x.double()
            for x, c, s in ((q, cos, sin), (k, cos, sin)))
    k_rows[slots], v_rows[slots] = k, v.double()
    group, out = heads // kv_heads, torch.empty(q.shape, dtype=torch.float64)
    for s, n in enumerate(lens.tolist()):
        positions = torch.arange(max(0, n - window) if window else 0, n)
        rows = tables[s][positions // BLOCK] * BLOCK + positions % BLOCK
        for j in range(heads):
            h = j // group
            keys, values = k_rows[rows, h * hd:(h + 1) * hd], v_rows[rows, h * hd:(h + 1) * hd]
            p = torch.softmax(keys @ q[s, j * hd:(j + 1) * hd] * scale, dim=0)
            out[s, j * hd:(j + 1) * hd] = p @ values
    return out, k_rows, v_rows


@pytest.mark.parametrize("heads,kv_heads,hd,lens,window,rotary", [
    (9, 3, 64, [140], None, True),          # SmolLM2's attention, one sequence
    (8, 2, 128, [5, 37, 1, 64], None, True),
    (4, 4, 32, [23, 9], 8, True),           # sliding window, MHA
    (6, 1, 80, [17, 30, 2], None, False),   # MQA, a head size off the fast path, no rotary
    (4, 2, 96, [50], 16, True),
])
def test_decode_attention_matches_float64(heads, kv_heads, hd, lens, window, rotary):
    g = torch.Generator().manual_seed(sum(lens) + hd)
    b, width = len(lens), max(lens) // BLOCK + 1
    num_blocks = b * width + 3
    perm = torch.randperm(num_blocks, generator=g)   # scattered, non-consecutive blocks
    tables = perm[:b * width].reshape(b, width).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    positions = lens_t.long() - 1
    slots = (tables[torch.arange(b), positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    row = kv_heads * hd
    k_rows, v_rows = (torch.randn(num_blocks * BLOCK, row, generator=g) for _ in range(2))
    qkv = torch.randn(b, (heads + 2 * kv_heads) * hd, generator=g)   # q, k, v as views of one buffer
    q, k, v = qkv.split([heads * hd, row, row], dim=-1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, torch.float32) if rotary else (None, None)
    scale = hd ** -0.5
    want, want_k, want_v = _reference(q, k, v, cos, sin, k_rows, v_rows, slots, tables, lens_t, window, heads,
                                      kv_heads, hd, scale)
    step = cpu_native.decode_step(slots, tables, lens_t, max(lens), BLOCK)
    cache = cpu_native.cache_pointers(k_rows, v_rows)
    got = cpu_native.decode_attention(q, k, v, (cos, sin) if rotary else None, cache, step, window, heads, kv_heads,
                                      hd, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_rows.double(), want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_rows.double(), want_v, rtol=0, atol=0)


def test_decode_attention_declines_what_it_cannot_read():
    slots, tables, lens = torch.tensor([5]), torch.arange(3)[None], torch.tensor([6], dtype=torch.int32)
    step = cpu_native.decode_step(slots, tables, lens, 6, BLOCK)
    rows = [torch.zeros(16, 2 * 8) for _ in range(2)]
    q, k, v = torch.randn(1, 4 * 8), torch.randn(1, 2 * 8), torch.randn(1, 2 * 8)
    assert cpu_native.decode_attention(q.double(), k, v, None, cpu_native.cache_pointers(*rows), step, None,
                                       4, 2, 8, 1.0) is None
    cache = cpu_native.cache_pointers(*rows)
    assert cpu_native.decode_attention(q, k, v, None, cache, step, None, 4, 2, 16, 1.0) is None
    assert cpu_native.cache_pointers(rows[0].bfloat16(), rows[1].bfloat16()) is None
    assert cpu_native.decode_step(torch.arange(cpu_native.MAX_ROWS + 1), tables.expand(9, 3).contiguous(),
                                  lens.expand(9).contiguous(), 6, BLOCK) is None
    with pytest.raises(ValueError, match="max_len 99"):
        cpu_native.decode_step(slots, tables, lens, 99, BLOCK)   # past the tables' blocks


def test_llmc_native_0_turns_them_off():
    code = "from llmc.codegen import cpu_native; print(cpu_native.available(), cpu_native.status())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "LLMC_NATIVE": "0"}).stdout
    assert out.strip() == "False off (LLMC_NATIVE=0)"


def _generate(artifact, prompts):
    from llmc.runtime.engine import Engine, EngineConfig
    from llmc.runtime.sampling_params import SamplingParams

    engine = Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=16))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return {rid: (o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for rid, o in done.items()}


def test_engine_decodes_the_same_with_and_without_them(compiled, monkeypatch):
    """tiny-llama's decode steps (one sequence, and three at once) through the native kernels and
    through torch's: the same greedy tokens, log-probabilities within fp32 rounding."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 40, 19)]
    calls, attend = [], cpu_native.decode_attention

    def counted(*args):
        out = attend(*args)
        calls.extend([] if out is None else [out.shape[0]])
        return out
    monkeypatch.setattr(cpu_native, "decode_attention", counted)
    native = {**_generate(compiled, prompts[:1]), **{f"b{k}": v for k, v in _generate(compiled, prompts).items()}}
    assert 1 in calls and 3 in calls   # it ran, for one sequence and for three
    monkeypatch.setattr(cpu_native, "_load", lambda: (None, "off (test)"))
    torch_ = {**_generate(compiled, prompts[:1]), **{f"b{k}": v for k, v in _generate(compiled, prompts).items()}}
    assert native.keys() == torch_.keys() and len(native) == 4
    for rid in native:
        assert native[rid][0] == torch_[rid][0], rid
        torch.testing.assert_close(torch.tensor(native[rid][1]), torch.tensor(torch_[rid][1]), rtol=1e-4, atol=1e-4)
