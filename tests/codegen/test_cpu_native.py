"""The native decode kernels (codegen/native/cpu_native.py) against float64 references: rotary, the cache
write and paged attention for several sequences with scattered block tables, sliding windows, GQA
groups and head sizes on and off the vector fast path; and the torch fallback."""

import os
import subprocess
import sys

import pytest
import torch

from llmc.codegen.native import cpu_native
from llmc.compiler.ops import apply_rope, rope_cos_sin
from llmc.compiler.quant import pack_int4
from llmc.errors import LlmcError

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"native kernels {cpu_native.status()}")

BLOCK = 4


def _reference(q, k, v, cos, sin, k_rows, v_rows, slots, tables, lens, window, heads, kv_heads, hd, scale):
    """float64: rotate, write, then attend per sequence and query head."""
    k_rows, v_rows = k_rows.double().clone(), v_rows.double().clone()
    q, k = (apply_rope(x.double(), c.double(), s.double(), hd) if cos is not None else x.double()
            for x, c, s in ((q, cos, sin), (k, cos, sin)))
    k_rows[slots], v_rows[slots] = k, v.double()
    return _attend_float64(q, k_rows, v_rows, tables, lens, window, heads, kv_heads, hd, scale), k_rows, v_rows


def _attend_float64(q, k_rows, v_rows, tables, lens, window, heads, kv_heads, hd, scale):
    """float64 attention per sequence and query head over the cache rows its block table names."""
    q, k_rows, v_rows = q.double(), k_rows.double(), v_rows.double()
    group, out = heads // kv_heads, torch.empty(q.shape, dtype=torch.float64)
    for s, n in enumerate(lens.tolist()):
        positions = torch.arange(max(0, n - window) if window else 0, n)
        rows = tables[s][positions // BLOCK] * BLOCK + positions % BLOCK
        for j in range(heads):
            h = j // group
            keys, values = k_rows[rows, h * hd:(h + 1) * hd], v_rows[rows, h * hd:(h + 1) * hd]
            p = torch.softmax(keys @ q[s, j * hd:(j + 1) * hd] * scale, dim=0)
            out[s, j * hd:(j + 1) * hd] = p @ values
    return out


def _on_threads(threads: int, fn):
    """fn() with torch (and so the native kernels) on `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("heads,kv_heads,hd,lens,window,rotary", [
    (9, 3, 64, [140], None, True),          # SmolLM2's attention, one sequence
    (8, 2, 128, [5, 37, 1, 64], None, True),
    (4, 4, 32, [23, 9], 8, True),           # sliding window, MHA
    (6, 1, 80, [17, 30, 2], None, False),   # MQA, a head size off the fast path, no rotary
    (4, 2, 96, [50], 16, True),
])
def test_decode_attention_matches_float64(heads, kv_heads, hd, lens, window, rotary, threads=None):
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
    got = _on_threads(threads or torch.get_num_threads(), lambda: cpu_native.decode_attention(
        q, k, v, (cos, sin) if rotary else None, cache, step, window, heads, kv_heads, hd, scale))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_rows.double(), want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_rows.double(), want_v, rtol=0, atol=0)


@pytest.mark.parametrize("threads,lens,window", [(2, [300], None), (4, [300], 200), (2, [130, 70, 1], None)])
def test_decode_attention_split_context_matches_float64(threads, lens, window):
    """3 KV heads a sequence do not divide over 2 or 4 threads: each pair's keys are split into parts
    whose softmax-normalised outputs are merged by their maxima and sums (a part of a 1-key sequence is
    empty)."""
    test_decode_attention_matches_float64(9, 3, 64, lens, window, True, threads)


def test_decode_attention_is_the_same_on_any_thread_count():
    """(sequence, KV head) pairs split over threads (evenly: no context split): each pair's arithmetic is
    the same on any of them."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, hd, lens = 8, 2, 64, [33, 70, 5]
    b, width = len(lens), max(lens) // BLOCK + 1
    tables = torch.randperm(b * width, generator=g).reshape(b, width).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    positions = lens_t.long() - 1
    slots = (tables[torch.arange(b), positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    q, k, v = (torch.randn(b, n * hd, generator=g) for n in (heads, kv_heads, kv_heads))

    def attend():
        rows = [torch.randn(b * width * BLOCK, kv_heads * hd, generator=torch.Generator().manual_seed(1))
                for _ in range(2)]
        return cpu_native.decode_attention(q, k, v, None, cpu_native.cache_pointers(*rows),
                                           cpu_native.decode_step(slots, tables, lens_t, max(lens), BLOCK),
                                           None, heads, kv_heads, hd, hd ** -0.5)
    outs = [_on_threads(threads, attend) for threads in (1, 2, 3)]
    assert outs[0] is not None
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("heads,kv_heads,hd,lens,window", [
    (9, 3, 64, [140, 37, 200, 1, 64, 90, 17, 130, 55, 12], None),   # SmolLM2, more rows than MAX_ROWS
    (4, 4, 32, [23, 9], 8),              # sliding window, MHA
    (6, 1, 80, [17, 30, 2], None),       # MQA, a head size off the fast path
])
def test_decode_attention_bf16_matches_float64(heads, kv_heads, hd, lens, window):
    """bf16 queries and cache read in place, fp32 inside: within one bf16 rounding of float64 attention over
    the same bf16 values, and the same on any thread count."""
    g = torch.Generator().manual_seed(sum(lens) + hd)
    b, width = len(lens), max(lens) // BLOCK + 1
    num_blocks = b * width + 3
    tables = torch.randperm(num_blocks, generator=g)[:b * width].reshape(b, width).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    row = kv_heads * hd
    k_rows, v_rows = (torch.randn(num_blocks * BLOCK, row, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(b, heads * hd, generator=g).bfloat16()
    scale = hd ** -0.5
    want = _attend_float64(q, k_rows, v_rows, tables, lens_t, window, heads, kv_heads, hd, scale)
    step = cpu_native.read_step(tables, lens_t, max(lens), BLOCK)
    outs = [_on_threads(threads, lambda: cpu_native.decode_attention_bf16(q, k_rows, v_rows, step, window, heads,
                                                                         kv_heads, hd, scale))
            for threads in (1, 2)]
    assert outs[0].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), want, rtol=2 ** -8, atol=1e-3)
    assert cpu_native.decode_attention_bf16(q.float(), k_rows, v_rows, step, window, heads, kv_heads, hd,
                                            scale) is None


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
    code = "from llmc.codegen.native import cpu_native; print(cpu_native.available(), cpu_native.status())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "LLMC_NATIVE": "0"}).stdout
    assert out.strip() == "False off (LLMC_NATIVE=0)"


def _generate(artifact, prompts, batch_invariant: bool | None = None):
    from llmc.runtime.engine import Engine, EngineConfig
    from llmc.runtime.sampling_params import SamplingParams

    engine = Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=16, batch_invariant=batch_invariant))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return {rid: (o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for rid, o in done.items()}


def test_engine_decodes_the_same_with_and_without_them(compiled, monkeypatch):
    """tiny-llama's decode steps (one sequence, and three at once) through the native decode program
    (runtime/native_decode.py), through the walk's native kernels launch by launch, and through torch's:
    the same greedy tokens, log-probabilities within fp32 rounding. Batch invariance off: on, prefills take
    the native attention too (tests/runtime/test_batch_invariance.py)."""
    from llmc.runtime import native_decode

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 40, 19)]

    def both():
        return {**_generate(compiled, prompts[:1], False),
                **{f"b{k}": v for k, v in _generate(compiled, prompts, False).items()}}

    program_rows, attention_rows = [], []
    run, attend = native_decode.NativeDecode.run, cpu_native.decode_attention

    def counted_run(self, regs, backend, rope_cache, borrow=False):
        ran = run(self, regs, backend, rope_cache, borrow)
        program_rows.extend([backend.metadata.native_step(backend.cache.block_size).rows] if ran else [])
        return ran

    def counted_attend(*args, **kwargs):
        out = attend(*args, **kwargs)
        attention_rows.extend([] if out is None else [out.shape[0]])
        return out
    monkeypatch.setattr(native_decode.NativeDecode, "run", counted_run)
    monkeypatch.setattr(cpu_native, "decode_attention", counted_attend)
    program = both()
    assert 1 in program_rows and 3 in program_rows and not attention_rows   # one call a step, every layer in it
    monkeypatch.setattr(native_decode, "build", lambda executor: None)
    walk = both()
    assert 1 in attention_rows and 3 in attention_rows   # the walk's launches took the native kernels
    monkeypatch.setattr(cpu_native, "_load", lambda: (None, "off (test)"))
    torch_ = both()
    assert program.keys() == walk.keys() == torch_.keys() and len(program) == 4
    for rid in program:
        assert program[rid][0] == walk[rid][0] == torch_[rid][0], rid
        for other in (walk, torch_):
            torch.testing.assert_close(torch.tensor(program[rid][1]), torch.tensor(other[rid][1]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows,residual", [(1, True), (3, True), (cpu_native.MAX_ROWS, True), (2, False)])
def test_add_rms_norm_matches_float64(rows, residual):
    """x a strided view (columns of a wider buffer, as a split leaves it), residual its own."""
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 200, generator=g) * 3
    x, res, weight = wide[:, 8:168], torch.randn(rows, 160, generator=g), torch.randn(160, generator=g)
    got, summed = cpu_native.add_rms_norm(x, res if residual else None, weight, 1e-5)
    s = x.double() + res.double() if residual else x.double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if residual:
        assert torch.equal(summed, x + res)
    else:
        assert summed is None


def test_add_rms_norm_declines_what_it_cannot_read():
    x, w = torch.randn(2, 16), torch.randn(16)
    assert cpu_native.add_rms_norm(torch.randn(cpu_native.MAX_ROWS + 1, 16), None, w, 1e-5) is None
    assert cpu_native.add_rms_norm(x.bfloat16(), None, w, 1e-5) is None
    assert cpu_native.add_rms_norm(x[None], None, w, 1e-5) is None
    assert cpu_native.add_rms_norm(x.t(), None, torch.randn(2), 1e-5) is None    # columns not contiguous
    assert cpu_native.add_rms_norm(x, None, torch.randn(15), 1e-5) is None
    assert cpu_native.add_rms_norm(x, torch.randn(1, 16), w, 1e-5) is None       # residual of another shape


def test_only_norms_that_quantised_gemms_read_go_native(tmp_path, compiled):
    """int8 tiny-llama: every norm but the last (its LM head stays fp32) is marked, none of the fp32
    plan's, and the int8 executor's logits
    with them native equal the torch kernels' to fp32 rounding."""
    import llmc
    from llmc.codegen.plan import Plan
    from llmc.compiler.artifact import read_artifact
    from llmc.runtime.executor import PlanExecutor

    int8 = llmc.compile("tiny-llama", target="cpu", output=tmp_path / "int8.llmc", kernels="cpu", quant="int8",
                        quiet=True)

    def executor(path):
        a = read_artifact(path)
        return PlanExecutor(Plan.from_json(a.plan_json), a.weights, data=a.data)

    def marked(ex):
        return [launch.attrs.get("feeds_qlinear", False) for launch, step in zip(ex._program, ex.plan.steps)
                if step.kernel in ("cpu.rms_norm", "cpu.add_rms_norm")]
    quantised, plain = executor(int8), executor(compiled)
    assert len(marked(quantised)) > 2 and marked(quantised) == [True] * (len(marked(quantised)) - 1) + [False]
    assert marked(plain) and not any(marked(plain))
    ids = torch.randint(3, 500, (5,), generator=torch.Generator().manual_seed(3))
    feed = {"input_ids": ids, "positions": torch.arange(5), "logits_indices": torch.arange(5)}
    native = quantised.run_values(feed)["logits"]
    unmarked = executor(int8)
    unmarked._program = [launch._replace(attrs={k: v for k, v in launch.attrs.items() if k != "feeds_qlinear"})
                         for launch in unmarked._program]
    torch.testing.assert_close(native, unmarked.run_values(feed)["logits"], rtol=1e-3, atol=1e-3)


def _random_q4(g: torch.Generator, n: int, k: int, group: int, zero_point: bool, half: bool,
               activations: str = "int16"):
    """Random 4-bit codes [n, k] with scales and zero points (or offsets) per group, fp16-exact where `half`,
    and their gemv_q4 weights (on `activations`)."""
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 1e-3
    second = torch.randint(0, 16, scales.shape, generator=g).float() if zero_point else \
        torch.randn(scales.shape, generator=g) * 0.05
    if half:
        scales, second = scales.half().float(), second.half().float()
    return codes, scales, second, cpu_native.q4_weights(pack_int4(codes), scales, second, zero_point, activations)


def _int16_rounded(x: torch.Tensor, largest: float = 32767.0, block: int = 64) -> torch.Tensor:
    """x [rows, k] as gemv_int16.c rounds it, in float64: per block, codes round(x * (largest / max|x|))
    (fp32 product, ties to even) times max|x| / largest; int16 codes: largest 32767, blocks of 64; int8 ones:
    127, blocks of 32"""
    blocks = x.reshape(x.shape[0], -1, block)
    top = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(largest) / top, torch.zeros(()))
    return (torch.round(blocks * inv).double() * (top / largest).double()).reshape(x.shape)


def _with_int16(on: bool, fn):
    if on:
        return fn()
    with cpu_native.fp32_activations():
        return fn()


def _takes_int16(k: int, group: int) -> bool:
    return cpu_native.int16_activations() and k % 64 == 0 and (group == 32 or group % 64 == 0)


@pytest.mark.parametrize("int16", [True, False])
@pytest.mark.parametrize("rows,n,k,groups,half,threads", [
    (1, 3072, 576, 1, False, 2),      # SmolLM2's gate/up, int8 per channel
    (3, 97, 1536, 1, False, 1),       # an odd row count of weights
    (cpu_native.MAX_ROWS, 40, 576, 18, True, 2),   # GGUF Q8_0: fp16 scales per 32 codes
    (2, 33, 256, 16, True, 2),        # groups of 16 (fp32 activations only)
    (1, 50, 288, 9, True, 1),         # groups of 32 not a multiple of four: the one-group tail; K off 64
    (2, 20, 384, 3, False, 2),        # groups of 128
])
def test_gemv_q8_matches_float64(rows, n, k, groups, half, threads, int16):
    """fp32 activations: the reference's arithmetic to fp32 rounding. int16 ones (where the CPU and shapes
    take them): exactly the rounded activations' dot, and within their rounding of the unrounded one."""
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, groups, generator=g) / 50 + 1e-3
    scales = scales.half() if half else scales.reshape(n) if groups == 1 else scales
    wide = torch.randn(rows, k + 24, generator=g)
    x = wide[:, 8:8 + k]    # rows a stride apart wider than k
    w = cpu_native.q8_weights(codes, scales)
    got = _with_int16(int16, lambda: _on_threads(threads, lambda: cpu_native.gemv_q8(x, w)))
    dense = (codes.double().view(n, groups, -1) * scales.double().reshape(n, groups, 1)).reshape(n, k)
    want = x.double() @ dense.T
    assert got.shape == (rows, n)
    rounded = int16 and _takes_int16(k, k // groups)
    if rounded:
        assert ((got.double() - _int16_rounded(x) @ dense.T).abs().max() / want.abs().max()) < 1e-6
    assert ((got.double() - want).abs().max() / want.abs().max()) < (1e-4 if rounded else 1e-6)


def test_gemv_q8_declines_what_it_cannot_run():
    codes, scales = torch.randint(-128, 128, (16, 64), dtype=torch.int8), torch.rand(16)
    w = cpu_native.q8_weights(codes, scales)
    assert cpu_native.q8_weights(codes, torch.rand(16, 8)) is None        # groups of 8 codes
    assert cpu_native.q8_weights(codes.to(torch.uint8), scales) is None
    assert cpu_native.gemv_q8(torch.randn(2, 64).bfloat16(), w) is None
    assert cpu_native.gemv_q8(torch.randn(cpu_native.MAX_ROWS + 1, 64), w) is None
    assert cpu_native.gemv_q8(torch.randn(2, 63), w) is None
    assert cpu_native.gemv_q8(torch.randn(64, 2).t(), w) is None          # columns not contiguous


@pytest.mark.parametrize("rows,n,k,bias,threads", [(1, 960, 576, False, 2), (3, 97, 1536, True, 1),
                                                   (cpu_native.MAX_ROWS, 40, 75, True, 3)])
def test_gemv_f32_matches_float64(rows, n, k, bias, threads):
    """The decode program's fp32 GEMV: rows of x strided (a split's view), k off the vector width (75)."""
    lib = cpu_native._load()[0]
    g = torch.Generator().manual_seed(n + k)
    wide = torch.randn(rows, k + 7, generator=g)
    x, w = wide[:, 3:3 + k], torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = torch.empty(rows, n)
    lib.llmc_gemv_f32(x.data_ptr(), x.stride(0), rows, w.data_ptr(), None if b is None else b.data_ptr(), n, k,
                      y.data_ptr(), threads)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 37)])
def test_swiglu_matches_float64(rows, inter):
    """silu(gate) * up over [gate | up] rows, gates spanning both signs and past e^±87 (no overflow)."""
    lib = cpu_native._load()[0]
    x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 8
    x[0, :4] = torch.tensor([-100.0, 100.0, -0.0, 90.0])
    out = torch.empty(rows, inter)
    lib.llmc_swiglu(x.data_ptr(), x.stride(0), rows, inter, out.data_ptr())
    gate, up = x.double().split(inter, dim=1)
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("int16", [True, False])
@pytest.mark.parametrize("rows,n,k,group,zero_point,half,threads", [
    (1, 960, 576, 32, False, True, 2),       # a GGUF Q4_1 projection: fp16 scales and minimums
    (3, 97, 1536, 64, True, True, 1),        # int4 with integer zero points, an odd row count of weights
    (cpu_native.MAX_ROWS, 40, 256, 128, True, False, 3),   # fp32 scales
    (2, 16, 64, 32, False, False, 2),
    (4, 24, 576, 64, True, False, 2),        # SmolLM2's AWQ groups: nine, paired but for the last
    (5, 30, 288, 96, False, False, 2),       # groups of 96, K off 64 (fp32 activations only)
    (6, 18, 192, 32, True, True, 2)])        # Q4_0-style zero points over three blocks
def test_gemv_q4_matches_float64(rows, n, k, group, zero_point, half, threads, int16):
    """Weights made as the reference dequantises them ((q - z) * s, or q * s + m), x a strided view; int16
    activations as test_gemv_q8's (a group's zero point or offset times its unrounded activations' sum)."""
    from llmc.compiler.quant import dequantize_affine_codes, dequantize_int4_codes

    g = torch.Generator().manual_seed(n + group)
    codes, scales, second, w = _random_q4(g, n, k, group, zero_point, half)
    assert w.scales.dtype == w.other.dtype == (torch.float16 if half else torch.float32)
    x = torch.randn(rows, k + 5, generator=g)[:, 2:2 + k]
    y = _with_int16(int16, lambda: _on_threads(threads, lambda: cpu_native.gemv_q4(x, w)))
    dense = (dequantize_int4_codes if zero_point else dequantize_affine_codes)(codes, scales, second).double()
    want = x.double() @ dense.T
    if not (int16 and _takes_int16(k, group)):
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
        return
    s, o = scales.double().repeat_interleave(group, 1), second.double().repeat_interleave(group, 1)
    offsets = -s * o if zero_point else o
    rounded = _int16_rounded(x) @ (s * codes.double()).T + x.double() @ offsets.T
    assert ((y.double() - rounded).abs().max() / want.abs().max()) < 1e-6
    assert ((y.double() - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.parametrize("rows,n,k,group,zero_point,half,threads", [
    (1, 70, 512, 32, False, True, 2),        # GGUF Q4_1: fp16 scales and offsets per 32 codes
    (3, 33, 384, 32, True, True, 1),         # Q4_0-style zero points, K three pairs of blocks (odd)
    (2, 45, 576, 32, False, True, 2),        # SmolLM2's K: four pairs of blocks and a half pair
    (cpu_native.MAX_ROWS, 40, 256, 64, True, False, 2),
    (4, 19, 320, 64, True, False, 2),        # groups of 64 with a half pair
    (2, 21, 1024, 128, False, False, 2),
    (5, 17, 768, 256, True, False, 1)])
def test_gemv_q4_on_int8_activations_is_its_rounding_exactly(rows, n, k, group, zero_point, half, threads):
    """Weights made for int8 activations compute sum(w * x8) on x rounded to int8 codes per block of 32
    (llama.cpp's Q8_1 activations: s * sum(q * x8) + o * sum(x8) per group), within fp32 summation of the
    float64 reference; the same codes made for int16 ones stay on int16 codes per 64."""
    if not cpu_native.takes_int8(k, group):
        pytest.skip("neither AVX-512 BW nor AVX2: the GEMVs multiply fp32 activations")
    from llmc.compiler.quant import dequantize_affine_codes, dequantize_int4_codes

    g = torch.Generator().manual_seed(n + group + k)
    codes, scales, second, w = _random_q4(g, n, k, group, zero_point, half, "int8")
    assert w.int8 and cpu_native.takes_int8(k, group)
    x = torch.randn(rows, k + 3, generator=g)[:, 1:1 + k]
    x[0, :32] *= 40.0   # one block's largest value far above its neighbours': blocks of 32 keep theirs exact
    y = _on_threads(threads, lambda: cpu_native.gemv_q4(x, w))
    s, o = scales.double().repeat_interleave(group, 1), second.double().repeat_interleave(group, 1)
    offsets = -s * o if zero_point else o
    dense = (dequantize_int4_codes if zero_point else dequantize_affine_codes)(codes, scales, second)
    want = _int16_rounded(x, 127.0, 32) @ dense.double().T
    exact = x.double() @ dense.double().T
    assert ((y.double() - want).abs().max() / exact.abs().max()) < 1e-6
    assert ((y.double() - exact).abs().max() / exact.abs().max()) < 2e-2     # 2^-8 of each block's largest
    if not cpu_native.int16_activations():
        return
    w16 = w._replace(int8=False)
    y16 = _on_threads(threads, lambda: cpu_native.gemv_q4(x, w16))
    rounded16 = _int16_rounded(x) @ (s * codes.double()).T + x.double() @ offsets.T
    assert ((y16.double() - rounded16).abs().max() / exact.abs().max()) < 1e-6


def _fma32(a, b, c):
    """float32 fused multiply-add: the product of two float32s is exact in float64 (one rounding left, to
    float32, but for a float64 sum that lands on a float32 tie: about 2^-29 a call)."""
    import numpy as np
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _q4_int8_lane_model(x, codes, scales, second, zero_point, group):
    """y [rows, n] as llmc_gemv_q4_int8 computes it, in float32 numpy, lane for lane: the activations to int8
    codes per block of 32; per 128 codes, lane L (of AVX-512's 16) sums codes 8L..8L + 7 in integers and
    takes one FMA with (weight scale x activation scale); pairs alternate between two chains; each lane adds
    its offsets term; then _mm512_reduce_add_ps's tree. The AVX-512 and the AVX2 kernel must both give it."""
    import numpy as np
    f32 = np.float32
    x, codes = x.numpy().astype(f32), codes.numpy().astype(np.int64)
    sc, zo = scales.numpy().astype(f32), second.numpy().astype(f32)
    rows, k = x.shape
    n, groups, pairs, kp = codes.shape[0], k // group, k // 128, (k + 127) // 128 * 128
    out = np.zeros((rows, n), f32)
    for r in range(rows):
        blocks = x[r].reshape(-1, 32)
        top = np.abs(blocks).max(axis=1)
        xs = np.zeros(kp // 32, f32)
        xs[:len(top)] = top / f32(127)
        inv = np.where(top == 0, f32(0), f32(127) / np.where(top == 0, f32(1), top)).astype(f32)
        a = np.zeros(kp, np.int64)
        a[:k] = np.clip(np.rint(blocks * inv[:, None]), -128, 127).reshape(-1)
        sums = np.zeros(groups, f32)
        for b in range(k // 32):
            g = b * 32 // group
            sums[g] = _fma32(xs[b:b + 1], f32([a[32 * b:32 * b + 32].sum()]), sums[g:g + 1])[0]
        lanes = np.arange(16)
        for j in range(n):
            w = np.zeros(kp, np.int64)
            w[:k] = codes[j]
            chains = [np.zeros(16, f32), np.zeros(16, f32)]
            for p in range(pairs + (k % 128 > 0)):
                d = (w[128 * p:128 * p + 128] * a[128 * p:128 * p + 128]).reshape(16, 8).sum(axis=1).astype(f32)
                half = p == pairs
                if group == 32:
                    s = np.array([sc[j, 4 * p + L // 4] if 4 * p + L // 4 < groups else 0 for L in lanes], f32)
                elif group == 64:
                    s = np.array([sc[j, 2 * p + L // 8] if not (half and L >= 8) else 0 for L in lanes], f32)
                else:
                    s = np.full(16, sc[j, p * 128 // group], f32)
                both = (s * xs[4 * p + lanes // 4]).astype(f32)
                chains[1 if half else p % 2] = _fma32(d, both, chains[1 if half else p % 2])
            total = (chains[0] + chains[1]).astype(f32)
            t = np.zeros(16, f32)
            for i in range(0, groups, 16):
                live = i + lanes < groups
                at = np.minimum(i + lanes, groups - 1)
                o = np.where(live, zo[j, at], 0).astype(f32)
                if zero_point:
                    o = (o * np.where(live, sc[j, at], 0)).astype(f32)
                t = _fma32(o, np.where(live, sums[at], 0).astype(f32), t)
            v = (total - t if zero_point else total + t).astype(f32)
            t3 = (v[8:] + v[:8]).astype(f32)
            t6 = (t3[4:] + t3[:4]).astype(f32)
            out[r, j] = (t6[0] + t6[2]) + (t6[1] + t6[3])
    return torch.from_numpy(out)


@pytest.mark.parametrize("rows,n,k,group,zero_point", [
    (1, 9, 576, 32, False),     # SmolLM2's K: four pairs of blocks and a half pair
    (3, 6, 512, 32, True),
    (2, 5, 320, 64, False),     # groups of 64 with a half pair
    (2, 4, 1024, 128, True),
    (1, 3, 768, 256, False),
    (7, 5, 576, 32, False),     # several rows: AVX2's loop for many rows (tiles of 4, then 3)
    (5, 3, 8192, 32, True)])    # a long K: AVX2 takes 2 rows a pass there
def test_gemv_q4_int8_is_its_lane_model_bitwise(rows, n, k, group, zero_point):
    """The int8-activation GEMV gives exactly the float32 lane model's bits, whether AVX-512 or AVX2 runs it:
    an artifact's outputs do not depend on which of the two CPUs serves it."""
    if not cpu_native.takes_int8(k, group):
        pytest.skip("neither AVX-512 BW nor AVX2")
    g = torch.Generator().manual_seed(k + group + rows)
    codes, scales, second, w = _random_q4(g, n, k, group, zero_point, True, "int8")
    x = torch.randn(rows, k, generator=g)
    x[0, :32] *= 40.0
    assert torch.equal(cpu_native.gemv_q4(x, w), _q4_int8_lane_model(x, codes, scales, second, zero_point, group))


def test_gemv_q4_int8_rows_are_batch_invariant():
    """On int8 activations a row's outputs are the same bits at every row count of a call (1..MAX_ROWS) and
    with rows fetched ahead or not, and a non-finite activation makes its row's outputs nan."""
    if not cpu_native.takes_int8(576, 32):
        pytest.skip("neither AVX-512 BW nor AVX2")
    g = torch.Generator().manual_seed(7)
    *_, w = _random_q4(g, 37, 576, 32, False, True, "int8")
    x = torch.randn(cpu_native.MAX_ROWS, 576, generator=g)
    alone = torch.cat([cpu_native.gemv_q4(x[r:r + 1], w) for r in range(len(x))])
    for rows in range(2, cpu_native.MAX_ROWS + 1):
        assert torch.equal(cpu_native.gemv_q4(x[:rows], w), alone[:rows])
    assert torch.equal(cpu_native.gemv_q4(x, w._replace(cached=True)), alone)   # fetching ahead changes no bits
    x[1, 100] = float("inf")
    y = cpu_native.gemv_q4(x[:2], w)
    assert torch.equal(y[0], alone[0]) and bool(y[1].isnan().all())


@pytest.mark.parametrize("cached", [False, True])
def test_gemm_q4_int8_takes_any_rows_in_one_call_with_each_rows_bits(cached):
    """cpu_native.gemm on int8 activations: one call for 9..70 rows (the weights read once), each row the bits
    it has alone; inside fp32_activations it goes back to MAX_ROWS rows a call. Weights that sit in the
    last-level cache (`cached`) run on AMX tiles where this CPU has them (gemm_amx.c), within fp32 summation
    of the VNNI GEMV's sums."""
    if not cpu_native.int16_activations():
        pytest.skip("no AVX-512 BW")
    g = torch.Generator().manual_seed(8)
    codes, scales, second, w = _random_q4(g, 45, 576, 32, False, True, "int8")
    w = w._replace(cached=cached, tiles=cpu_native.amx_tiles(w) if cached else None)
    assert (w.tiles is not None) == (cached and cpu_native.amx_ready())
    x = torch.randn(70, 576, generator=g)
    alone = torch.cat([cpu_native.gemv_q4(x[r:r + 1], w) for r in range(len(x))])
    for rows in (9, 16, 23, 70):
        assert torch.equal(cpu_native.gemm(x[:rows], w), alone[:rows])
    assert cpu_native.gemv_q4(x, w) is None   # more than MAX_ROWS only through gemm's any_rows
    with cpu_native.fp32_activations():
        y = cpu_native.gemm(x, w)
    assert not bool(y.isnan().any()) and ((y - alone).abs().max() / alone.abs().max()) < 2e-2
    vnni = cpu_native.gemm(x, w._replace(tiles=None))
    assert ((alone - vnni).abs().max() / vnni.abs().max()) < 1e-6


def test_gemm_outside_invariant_mode_takes_amx_on_the_stored_codes():
    """A prefill outside batch-invariant mode (cpu_native.gemm(..., invariant=False)) on weights without tiles
    runs the AMX GEMM on the stored codes: each row the bits the tiles give it at any row count; a decode's
    few rows stay on the GEMV; inside batch-invariant mode every row count is the GEMV's."""
    if not (cpu_native.int16_activations() and cpu_native.amx_ready()):
        pytest.skip("no AMX-INT8 here")
    g = torch.Generator().manual_seed(12)
    _, _, _, w = _random_q4(g, 45, 576, 32, False, True, "int8")
    assert w.tiles is None
    x = torch.randn(40, 576, generator=g)
    tiled = cpu_native.gemm(x, w._replace(tiles=cpu_native.amx_tiles(w)))
    for rows in (9, 17, 40):
        assert torch.equal(cpu_native.gemm(x[:rows], w, invariant=False), tiled[:rows])
        assert torch.equal(cpu_native.gemm(x[:rows], w), cpu_native.gemv_q4(x[:rows], w, any_rows=True))
    assert torch.equal(cpu_native.gemm(x[:8], w, invariant=False), cpu_native.gemv_q4(x[:8], w))
    assert cpu_native.gemm_q4_stored(x, w._replace(int8=False)) is None   # int16 activations: the GEMV's


def test_amx_tiles_only_for_weights_in_cache_unless_asked_everywhere(monkeypatch):
    """Tiles where the model's weights sit in the last-level cache (streaming from DRAM the VNNI GEMV is faster at
    one row); LLMC_AMX=all takes them for every model, LLMC_AMX=0 for none."""
    g = torch.Generator().manual_seed(10)
    args = (pack_int4(torch.randint(0, 16, (32, 256), generator=g, dtype=torch.uint8)),
            torch.rand(32, 8, generator=g).half().float() + 0.01, torch.randn(32, 8, generator=g).half().float(), False)
    ready = cpu_native.amx_ready() and cpu_native.takes_int8(256, 32)
    assert (cpu_native.q4_weights(*args, "int8", cached=True).tiles is not None) == ready
    assert cpu_native.q4_weights(*args, "int8", cached=False).tiles is None
    assert cpu_native.q4_weights(*args, "int16", cached=True).tiles is None
    monkeypatch.setenv(cpu_native.AMX_ENV, "all")
    assert (cpu_native.q4_weights(*args, "int8", cached=False).tiles is not None) == ready
    monkeypatch.setenv(cpu_native.AMX_ENV, "0")
    assert cpu_native.q4_weights(*args, "int8", cached=True).tiles is None


@pytest.mark.parametrize("group", [32, 64])
def test_gemm_q8_takes_any_rows_in_one_call_with_each_rows_bits(group):
    """int8 weights on int16 activation codes (the Q8_0 LM head): as the 4-bit GEMV, one call for any rows."""
    if not cpu_native.int16_activations():
        pytest.skip("no AVX-512 BW")
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(-127, 128, (53, 576), generator=g, dtype=torch.int8)
    w = cpu_native.q8_weights(codes, (torch.rand(53, 576 // group, generator=g) * 0.01 + 1e-3).half())
    assert cpu_native.q8_takes_int16(w)
    x = torch.randn(40, 576, generator=g)
    alone = torch.cat([cpu_native.gemv_q8(x[r:r + 1], w) for r in range(len(x))])
    for rows in (9, 17, 40):
        assert torch.equal(cpu_native.gemm(x[:rows], w), alone[:rows])


def test_q4_weights_refuse_an_unknown_activation_rounding():
    with pytest.raises(LlmcError, match="int4"):
        _random_q4(torch.Generator().manual_seed(1), 8, 256, 64, True, True, "int4")


def test_gemv_int16_activations_keep_non_finite_values():
    """an inf or nan activation makes the outputs nan, as fp32 ones would make them inf or nan; tiny ones
    keep their codes"""
    if not cpu_native.int16_activations():
        pytest.skip("this build multiplies fp32 activations only")
    q4 = cpu_native.q4_weights(torch.randint(0, 256, (8, 64), dtype=torch.uint8), torch.rand(8, 2), 8, True)
    q8 = cpu_native.q8_weights(torch.randint(-128, 128, (8, 128), dtype=torch.int8), torch.rand(8))
    for bad in (float("inf"), float("nan")):
        x = torch.randn(2, 128)
        x[0, 70] = bad
        for y in (cpu_native.gemv_q4(x, q4), cpu_native.gemv_q8(x, q8)):
            assert y[0].isnan().all() and y[1].isfinite().all()
    # under 1e-30 the codes come from a division (32767 / max|x| would near overflow): they are the codes
    # round(x / s), s = max|x| / 32767 per block of 64 in fp32, times s (a bound against fp32 activations
    # instead failed once in CI: 1.3e-4 over 1e-4, the int16 rounding's own error after cancellation)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)) * 1e-33
    blocks = x.reshape(1, -1, 64)
    s = blocks.abs().amax(-1, keepdim=True) / 32767
    rounded = (torch.round(blocks / s).double() * s.double()).reshape(1, 128)
    want = rounded @ (q8.codes.double() * q8.scales.double().reshape(-1, 1)).T
    assert ((cpu_native.gemv_q8(x, q8) - want).abs().max() / want.abs().max()) < 1e-6


def test_gemv_q4_refuses_what_it_cannot_run():
    packed = torch.randint(0, 256, (8, 24), dtype=torch.uint8)
    assert cpu_native.q4_weights(packed, torch.rand(8, 3), torch.zeros(8, 3), True) is None   # groups of 16
    assert cpu_native.q4_weights(packed.to(torch.int8), torch.rand(8, 1), 8, True) is None   # codes as stored
    w = cpu_native.q4_weights(torch.randint(0, 256, (8, 32), dtype=torch.uint8), torch.rand(8, 2), 8, True)
    assert cpu_native.gemv_q4(torch.randn(cpu_native.MAX_ROWS + 1, 64), w) is None
    assert cpu_native.gemv_q4(torch.randn(2, 32), w) is None
    assert cpu_native.gemv_q4(torch.randn(2, 64, dtype=torch.float64), w) is None


def test_q4_weights_read_gguf_blocks_in_place_and_share_a_constant_zero_point():
    """A GGUF's Q4_1 blocks (codes, fp16 scales and minimums) become the GEMV's weights without a copy: the
    same memory; a Q4_0 weight's one zero point is one row all rows read (row stride 0), and its GEMV
    equals the reference over the stored codes."""
    from llmc.compiler.quant import dequantize_int4_codes

    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (40, 256), dtype=torch.uint8, generator=g)
    stored, scales = pack_int4(codes), (torch.rand(40, 8, generator=g) / 8).half()
    mins = (-torch.rand(40, 8, generator=g)).half()
    w = cpu_native.q4_weights(stored, scales, mins, zero_point=False)
    assert (w.packed.data_ptr(), w.scales.data_ptr(), w.other.data_ptr()) == (
        stored.data_ptr(), scales.data_ptr(), mins.data_ptr())
    q4_0 = cpu_native.q4_weights(stored, scales, 8, zero_point=True)
    assert q4_0.other.shape == (1, 8) and cpu_native.q4_other_row(q4_0) == 0
    x = torch.randn(3, 256, generator=g)
    want = x.double() @ dequantize_int4_codes(codes, scales.float(), torch.full((40, 8), 8.0)).double().T
    for int16 in (True, False):
        y = _with_int16(int16, lambda: cpu_native.gemv_q4(x, q4_0))   # int16 codes err by 2^-16 of a block's top
        assert ((y.double() - want).abs().max() / want.abs().max()) < 1e-4
