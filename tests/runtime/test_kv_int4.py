"""The int4 KV cache (`--kv-cache int4`): packed codes with a dynamic fp16 scale per token, KV head
and group of channels round-trip within a fourteenth of each group's absmax of float64; the paged
attention over such a cache (prefill, mixed, batched decode and the one-sequence span) equals
float64 SDPA over the dequantised context; tiny-llama compiled with it runs from the CLI and the
Python API near the fp32 cache; GPU targets, whose Triton kernels do not read it, are refused."""

import json

import pytest
import torch
import torch.nn.functional as F
from llmc_cli import error_line, llmc_in_process
from test_kv_quant import greedy_tokens, make_engine

import llmc
from llmc.codegen.native import cpu_native
from llmc.compiler.quant import fake_quant_kv_int4, kv_int4_group
from llmc.compiler.schemes import KV_CACHE_FORMATS
from llmc.runtime.batch_invariance import describe
from llmc.runtime.kv_quant import dequantize_kv_int4, quantize_kv_int4
from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata
from llmc.runtime.sampling_params import SamplingParams

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 64, 4, 40
GROUP = 32
VOCAB = 512


def round_trip(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    return dequantize_kv_int4(quantize_kv_int4(x.float(), group), x.shape[-1], group, torch.float64)


# --- arithmetic -------------------------------------------------------------------------

def test_int4_round_trip_is_within_a_fourteenth_of_each_groups_absmax():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    x[:, :, 5] *= 40                     # an outlier channel costs its own group only
    x[7] = 0                             # an all-zero token: scale 0, codes 0
    rows = quantize_kv_int4(x.float(), GROUP)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == KV_CACHE_FORMATS["int4"].head_bytes(HEAD_DIM) == 36
    err = (round_trip(x) - x).abs().reshape(48, KV_HEADS, 2, GROUP)
    amax = x.reshape(48, KV_HEADS, 2, GROUP).abs().amax(-1, keepdim=True)
    # half a step of absmax / 7, plus the scale's fp16 rounding (2^-11 relative) over 7 steps
    assert bool((err <= amax * (1 / 14 + 2.0 ** -10)).all())
    assert err[7].max() == 0
    outlier_free = err[:, :, 1].max() / x.reshape(48, KV_HEADS, 2, GROUP)[:, :, 1].abs().max()
    assert outlier_free < 1 / 13 and err[:, :, 0].max() > 3 * err[:, :, 1].max()


@pytest.mark.parametrize("head_dim", [64, 16, 48])
def test_the_ir_reads_keys_and_values_exactly_as_the_runtime_stores_them(head_dim):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(21, KV_HEADS, head_dim, generator=gen) * torch.rand(21, 1, 1, generator=gen) * 5
    group = kv_int4_group(head_dim)
    assert group == (32 if head_dim % 32 == 0 else head_dim)
    assert torch.equal(fake_quant_kv_int4(x, group), round_trip(x, group).float())


def test_values_past_fp16_scales_saturate_without_nans():
    x = torch.tensor([1e7, -3.0, 2.5, 1e-30] * 8).reshape(1, 1, 32)
    back = round_trip(x)
    assert bool(back.isfinite().all()) and back[0, 0, 0] == 7 * 65504


# --- paged attention --------------------------------------------------------------------

def exact_attention(q, k, v, start):
    """float64 SDPA with GQA: q [t, heads*hd] at positions start..; k/v [ctx, kv_heads, hd]."""
    qh = q.double().unflatten(-1, (HEADS, HEAD_DIM)).transpose(0, 1)
    kh, vh = (x.double().transpose(0, 1) for x in (k, v))
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=HEAD_DIM ** -0.5, enable_gqa=True)
    return out.transpose(0, 1).flatten(1)


def run_step(attn: PagedAttention, ctx: dict, step: list[tuple[str, int, int]], gen) -> None:
    """One step of (sequence, start, new tokens) through `attn`, each sequence's rows checked
    against float64 SDPA over its keys and values as the int4 cache gives them back."""
    tables, q = ctx["tables"], torch.randn(sum(n for *_, n in step), HEADS * HEAD_DIM, generator=gen)
    attn.metadata = StepMetadata.build([(tables[s], start, n) for s, start, n in step], BLOCK)
    k = torch.cat([ctx[s][0][start:start + n] for s, start, n in step]).flatten(1)
    v = torch.cat([ctx[s][1][start:start + n] for s, start, n in step]).flatten(1)
    out = attn.forward(0, q, k, v, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       scale=HEAD_DIM ** -0.5, causal=True)
    row = 0
    for s, start, n in step:
        keys, values = (round_trip(x[:start + n]) for x in ctx[s])
        want = exact_attention(q[row:row + n], keys, values, start)
        torch.testing.assert_close(out[row:row + n].double(), want, rtol=1e-5, atol=1e-5)
        row += n


def test_paged_attention_over_an_int4_cache_equals_sdpa_over_the_dequantised_context():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, torch.uint8, kv_group=GROUP)
    assert cache.quantized and cache.k_cache[0].shape == (NUM_BLOCKS, BLOCK, KV_HEADS, 36)
    attn = PagedAttention(cache)
    # "a" and "b" scattered over the blocks, "c" on consecutive ones (the decode-span path)
    ctx = {"tables": {"a": [3, 17, 5, 9, 1, 30], "b": [12, 2, 25, 7], "c": list(range(32, 40))}}
    for s, n in (("a", 22), ("b", 14), ("c", 29)):
        ctx[s] = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) * 3,
                  torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen))
    run_step(attn, ctx, [("a", 0, 12), ("b", 0, 9)], gen)               # prefills from position 0
    run_step(attn, ctx, [("a", 12, 8), ("b", 9, 1)], gen)               # a chunk past the cache + a decode
    run_step(attn, ctx, [("a", 20, 1), ("b", 10, 1)], gen)              # a batched decode
    run_step(attn, ctx, [("c", 0, 27)], gen)
    run_step(attn, ctx, [("c", 27, 1)], gen)                            # one sequence, consecutive blocks
    assert attn.metadata.decode_span is not None


def test_copy_on_write_and_block_export_carry_the_scales():
    gen = torch.Generator().manual_seed(5)
    cache = PagedKVCache(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, torch.uint8, kv_group=GROUP)
    k, v = (torch.randn(BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    cache.write(1, torch.arange(BLOCK) + 2 * BLOCK, k, v)
    cache.copy_blocks([(2, 9)])
    cache.import_blocks([11], cache.export_blocks([2]))
    k2, v2 = cache.read(1, torch.tensor([2]), torch.float32)
    torch.testing.assert_close(k2[0].double(), round_trip(k), rtol=0, atol=0)
    for block in (9, 11):
        kb, vb = cache.read(1, torch.tensor([block]), torch.float32)
        assert torch.equal(k2, kb) and torch.equal(v2, vb)


# --- compiled tiny-llama ----------------------------------------------------------------

@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-int4")
    shared = tmp_path_factory.getbasetemp() / "runtime-tiny-llama-cpu.llmc"  # test_engine's, if built
    return {"fp32": shared if shared.exists() else llmc.compile("tiny-llama", output=root / "fp32"),
            "int4": llmc.compile("tiny-llama", output=root / "int4", kv_cache="int4", calib_samples=2,
                                 calib_seq_len=32)}


def test_tiny_llama_with_an_int4_cache_generates_like_fp32_from_a_fifth_of_the_bytes(artifacts):
    manifest = json.loads((artifacts["int4"] / "manifest.json").read_text())
    assert manifest["model"]["kv_cache"] == {"dtype": "uint8", "format": "int4", "scales": "dynamic",
                                             "group_size": 16}
    # tiny-llama: 2 layers x 2 KV heads x head_dim 16; a head's 16 codes take 8 bytes, its scale 2
    assert manifest["model"]["kv_bytes_per_token"] == 2 * 2 * 2 * 10
    record = manifest["pipeline"][-1]
    assert record["name"] == "quantize_kv_cache" and record["accuracy"]["kl"] > 0
    executor = make_engine(artifacts["int4"]).executor
    assert not any(name.startswith("kv_scales") for name in executor.plan.params)
    assert "attention over the int4 KV cache" in describe(executor)   # not batch-invariant, as int8/fp8
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in (9, 23, 40)]
    ours = greedy_tokens(make_engine(artifacts["int4"]), prompts, 12)
    ref = greedy_tokens(make_engine(artifacts["fp32"]), prompts, 12)
    same = sum(x == y for s, t in zip(ours, ref) for x, y in zip(s, t))
    assert same >= 0.6 * 36, (ours, ref)


def test_python_api_generates_from_the_int4_artifact(artifacts):
    out = llmc.load(artifacts["int4"]).generate(["Once upon a time"], SamplingParams(max_tokens=6, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 6


def test_cli_compiles_and_runs_an_int4_cache(tmp_path, capsys):
    out = tmp_path / "int4.llmc"
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--kv-cache", "int4", "--calib-samples", "2",
                                   "--calib-seq-len", "16", "-o", out)
    assert code == 0, err
    code, stdout, err = llmc_in_process(capsys, "run", out, "--prompt", "hello", "--max-tokens", "4",
                                        "--temperature", "0")
    assert code == 0 and stdout.strip(), err


def test_cli_refuses_int4_for_a_gpu_target_in_one_line(tmp_path, capsys):
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--target", "h100-bf16", "--kv-cache", "int4",
                                   "-o", tmp_path / "gpu.llmc")
    assert code == 2 and "--kv-cache int4 is not read by the triton attention kernels" in error_line(err)
    assert not (tmp_path / "gpu.llmc").exists()


@pytest.mark.parametrize("window", [None, 9])
def test_native_decode_attention_reads_the_packed_cache(window):
    if not cpu_native.available():
        pytest.skip(f"native kernels: {cpu_native.status()}")
    gen = torch.Generator().manual_seed(8)
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, torch.uint8, kv_group=GROUP)
    tables, lens = [[3, 17, 5, 9, 1, 30], [12, 2, 25, 7]], [23, 13]
    ctx = [(torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) * 3, torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen))
           for n in lens]
    for table, (k, v) in zip(tables, ctx):
        cache.write(0, torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(k.shape[0])]), k, v)
    q = torch.randn(2, HEADS * HEAD_DIM, generator=gen)
    meta = StepMetadata.build([(t, n - 1, 1) for t, n in zip(tables, lens)], BLOCK)
    out = cpu_native.decode_attention_int4(q, *cache.layer_rows(0), meta.native_read_step(BLOCK), window, HEADS,
                                           KV_HEADS, HEAD_DIM, GROUP, HEAD_DIM ** -0.5)
    for i, (k, v) in enumerate(ctx):
        first = 0 if window is None else max(0, k.shape[0] - window)
        keys, values = (round_trip(x)[first:] for x in (k, v))
        want = exact_attention(q[i:i + 1], keys, values, keys.shape[0] - 1)
        torch.testing.assert_close(out[i:i + 1].double(), want, rtol=1e-5, atol=1e-5)


def test_decodes_over_an_int4_cache_read_through_torch_where_the_native_kernels_are_not_built(monkeypatch):
    """Without the native library the int4 decode attention says it does not apply (None) and the paged
    backend reads the packed cache through torch, still SDPA over the dequantised context."""
    monkeypatch.setattr(cpu_native, "_load", lambda: (None, "off (a test)"))
    gen = torch.Generator().manual_seed(5)
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, torch.uint8, kv_group=GROUP)
    attn = PagedAttention(cache)
    ctx = {"tables": {"a": [3, 17, 5, 9], "b": [12, 2, 25]}}
    for s, n in (("a", 15), ("b", 10)):
        ctx[s] = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen), torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen))
    run_step(attn, ctx, [("a", 0, 14), ("b", 0, 9)], gen)
    run_step(attn, ctx, [("a", 14, 1), ("b", 9, 1)], gen)               # a batched decode, no native kernel
