"""The int8/fp8 KV cache: per-head quantisation within its rounding bound of float64, paged
attention over a quantised cache equal to exact attention over the dequantised context and close
to the fp32 cache, and tiny-llama compiled with `--kv-cache` generating nearly what fp32 does
from a pool that holds 4x the tokens in the same --kv-memory."""

import json

import pytest
import torch
import torch.nn.functional as F

import llmc
from llmc.cli import main
from llmc.compiler.options import CompileOptions
from llmc.compiler.pipeline import pass_configs
from llmc.compiler.quant import fake_quant_kv
from llmc.compiler.targets import get_target
from llmc.errors import ArtifactError, PassError
from llmc.passes.quantize_kv import KV_FORMATS
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.kv_quant import KV_QMAX, dequantize_kv, load_kv_scales, quantize_kv
from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata
from llmc.runtime.sampling_params import SamplingParams

STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 4, 2, 8, 4, 32, 2
VOCAB = 512


def head_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """absmax per head of x [..., kv_heads, head_dim] onto the dtype's range."""
    return x.abs().amax(dim=tuple(i for i in range(x.dim()) if i != x.dim() - 2)) / KV_QMAX[dtype]


# --- arithmetic -------------------------------------------------------------------------

def test_int8_per_head_error_is_at_most_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) * torch.tensor([0.5, 7.0])[:, None]
    scale = head_scales(x, torch.int8).float()
    codes = quantize_kv(x.float(), scale, torch.int8)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    err = (dequantize_kv(codes, scale, torch.float64) - x).abs()
    bound = scale.double()[:, None] / 2 * (1 + 1e-5)   # plus the fp32 division's rounding
    assert bool((err <= bound).all())
    assert not bool((err[:, 0] <= bound[1] / 20).all())  # each head has its own step


def test_fp8_per_head_error_is_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) * torch.tensor([0.1, 3.0])[:, None]
    scale = head_scales(x, torch.float8_e4m3fn).float()
    codes = quantize_kv(x.float(), scale, torch.float8_e4m3fn)
    err = (dequantize_kv(codes, scale, torch.float64) - x).abs()
    # 3 mantissa bits: half an ulp is 2^-4 of |x| for normals, 2^-10 * s among subnormals
    bound = x.abs() * 2.0 ** -4 + scale.double()[:, None] * 2.0 ** -10
    assert bool((err <= bound * (1 + 1e-5)).all())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_values_past_the_calibrated_range_saturate(dtype):
    scale = torch.tensor([0.5, 2.0])
    x = torch.tensor([[1e4, -1e4], [-1e4, 3.0]])[..., None].expand(2, 2, 4).transpose(0, 1)
    back = dequantize_kv(quantize_kv(x, scale, dtype), scale)
    assert not bool(back.isnan().any())
    assert back[0, 0, 0] == KV_QMAX[dtype] * 0.5 and back[1, 0, 0] == -KV_QMAX[dtype] * 0.5


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_ir_reads_keys_and_values_exactly_as_the_runtime_stores_them(kind):
    storage, _ = KV_FORMATS[kind]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(33, KV_HEADS, HEAD_DIM, generator=gen) * 2
    scale = torch.rand(KV_HEADS, generator=gen) / 40 + 0.01   # some values saturate
    runtime = dequantize_kv(quantize_kv(x, scale, STORAGE[kind]), scale)
    assert torch.equal(fake_quant_kv(x, scale, storage), runtime)


# --- paged attention --------------------------------------------------------------------

def exact_attention(q, k, v, start):
    """float64 SDPA: q [t, heads*hd] at positions start..; k/v [ctx, kv_heads, hd]."""
    t, ctx = q.shape[0], k.shape[0]
    qh = q.double().reshape(t, HEADS, HEAD_DIM).transpose(0, 1)
    kh, vh = (x.double().repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1) for x in (k, v))
    visible = torch.arange(ctx)[None, :] <= (start + torch.arange(t))[:, None]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=HEAD_DIM ** -0.5)
    return out.transpose(0, 1).reshape(t, HEADS * HEAD_DIM)


def run_batch(cache: PagedKVCache, seqs, gen):
    """Write each sequence's whole context through the cache in two steps (prefill of all but
    the last token, then a batched decode of the last); returns the decode step's outputs per
    layer and the float k/v that went in."""
    attn = PagedAttention(cache)
    ctxs = [(torch.randn(LAYERS, n, KV_HEADS, HEAD_DIM, generator=gen) * 3,
             torch.randn(LAYERS, n, KV_HEADS, HEAD_DIM, generator=gen)) for _, n in seqs]
    q = torch.randn(len(seqs), HEADS * HEAD_DIM, generator=gen)
    attn.metadata = StepMetadata.build([(t, 0, n - 1) for t, n in seqs], BLOCK)
    for layer in range(LAYERS):
        k = torch.cat([kv[0][layer, :-1] for kv in ctxs]).flatten(1)
        v = torch.cat([kv[1][layer, :-1] for kv in ctxs]).flatten(1)
        attn.forward(layer, torch.randn(k.shape[0], HEADS * HEAD_DIM, generator=gen), k, v, num_heads=HEADS,
                     num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM ** -0.5, causal=True)
    attn.metadata = StepMetadata.build([(t, n - 1, 1) for t, n in seqs], BLOCK)
    outs = [attn.forward(layer, q, torch.stack([kv[0][layer, -1] for kv in ctxs]).flatten(1),
                         torch.stack([kv[1][layer, -1] for kv in ctxs]).flatten(1), num_heads=HEADS,
                         num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM ** -0.5, causal=True)
            for layer in range(LAYERS)]
    return outs, ctxs, q


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_paged_attention_over_a_quantised_cache(kind):
    dtype = STORAGE[kind]
    seqs = [([3, 7, 1], 11), ([0, 9], 5), ([12, 4, 30, 2], 14)]
    gen = torch.Generator().manual_seed(3)
    # absmax per head a little above what the data (k ~ 3 N(0,1), v ~ N(0,1)) reaches
    scales = [torch.stack([torch.rand(KV_HEADS, generator=gen) + 14, torch.rand(KV_HEADS, generator=gen) + 5])
              / KV_QMAX[dtype] for _ in range(LAYERS)]
    quant = PagedKVCache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype, kv_scales=scales)
    assert quant.k_cache[0].dtype == dtype and quant.k_cache[0].element_size() == 1
    outs, ctxs, q = run_batch(quant, seqs, torch.Generator().manual_seed(4))
    plain, _, _ = run_batch(PagedKVCache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), seqs,
                            torch.Generator().manual_seed(4))
    for layer in range(LAYERS):
        s = scales[layer]
        for i, (k, v) in enumerate(ctxs):
            k_hat = dequantize_kv(quantize_kv(k[layer], s[0], dtype), s[0])
            v_hat = dequantize_kv(quantize_kv(v[layer], s[1], dtype), s[1])
            want = exact_attention(q[i:i + 1], k_hat, v_hat, start=k.shape[1] - 1)
            torch.testing.assert_close(outs[layer][i:i + 1].double(), want, rtol=1e-5, atol=1e-5)
        # and near the fp32 cache's answer: the quantisation error, not a wrong read
        err = (outs[layer] - plain[layer]).abs().max().item()
        assert 0 < err < (0.05 if kind == "int8" else 0.3)


def test_copy_on_write_copies_quantised_blocks():
    scales = [torch.ones(2, KV_HEADS) / 127] * LAYERS
    cache = PagedKVCache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, torch.int8, kv_scales=scales)
    gen = torch.Generator().manual_seed(5)
    cache.write(1, torch.arange(BLOCK) + 2 * BLOCK, torch.rand(BLOCK, KV_HEADS, HEAD_DIM, generator=gen),
                torch.rand(BLOCK, KV_HEADS, HEAD_DIM, generator=gen))
    cache.copy_blocks([(2, 9)])
    k2, v2 = cache.read(1, torch.tensor([2]), torch.float32)
    k9, v9 = cache.read(1, torch.tensor([9]), torch.float32)
    assert torch.equal(k2, k9) and torch.equal(v2, v9) and k9.abs().sum() > 0


def test_missing_scales_are_an_artifact_error():
    with pytest.raises(ArtifactError, match="kv_scales.1"):
        load_kv_scales({"kv_scales.0": torch.ones(2, 2)}, {"dtype": "int8", "scale_params": "kv_scales.{layer}"},
                       num_layers=2, num_kv_heads=2)


# --- compiled tiny-llama ----------------------------------------------------------------

def test_kv_cache_pass_runs_last_and_once():
    entries = [c.spec() for c in pass_configs(get_target("cpu"), CompileOptions(kv_cache="fp8", quant="int8"))]
    assert entries[-1] == "quantize_kv_cache:dtype=fp8" and "quantize_int8" in entries
    with pytest.raises(PassError, match="one or the other"):
        pass_configs(get_target("cpu"), CompileOptions(passes="dce,quantize_kv_cache", kv_cache="int8"))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-quant")
    shared = tmp_path_factory.getbasetemp() / "runtime-tiny-llama-cpu.llmc"  # test_engine's, if built
    out = {"fp32": shared if shared.exists() else llmc.compile("tiny-llama", output=root / "fp32")}
    for kind in ("int8", "fp8"):
        out[kind] = llmc.compile("tiny-llama", output=root / kind, kv_cache=kind, calib_samples=4, calib_seq_len=64)
    return out


def make_engine(path, kv_memory="4MiB") -> Engine:
    return Engine(path, EngineConfig(kv_memory=kv_memory, block_size=16))


def first_step_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids, params=SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    return engine.runner.execute(out.scheduled, out.sampled, out.blocks_to_copy)


def greedy_tokens(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"g{i}", prompt_token_ids=ids, params=params)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[f"g{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantised_kv_tiny_llama_generates_like_fp32(artifacts, kind):
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in (9, 23, 40)]
    engine, ref = make_engine(artifacts[kind]), make_engine(artifacts["fp32"])
    assert engine.cache.k_cache[0].dtype == STORAGE[kind]
    ours, theirs = first_step_logits(engine, prompts), first_step_logits(ref, prompts)
    assert not torch.equal(ours, theirs)   # the cache really was quantised
    assert F.cosine_similarity(ours, theirs, dim=-1).min() > 0.99
    a, b = greedy_tokens(make_engine(artifacts[kind]), prompts, 16), greedy_tokens(ref, prompts, 16)
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    assert same >= 0.75 * 48, (a, b)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_same_kv_memory_holds_four_times_the_fp32_blocks(artifacts, kind):
    quantised, fp32 = make_engine(artifacts[kind]), make_engine(artifacts["fp32"])
    assert quantised.block_manager.num_blocks == 4 * fp32.block_manager.num_blocks == 4 * (4 << 20) // (512 * 16)
    assert quantised.cache.k_cache[0].shape[0] == quantised.block_manager.num_blocks


def test_inspect_and_manifest_show_the_quantised_cache(artifacts, capsys):
    def inspect(path):
        main(["inspect", str(path), "--json"])
        return json.loads(capsys.readouterr().out)
    fp32, int8 = inspect(artifacts["fp32"]), inspect(artifacts["int8"])
    assert int8["kv_bytes_per_token"] * 4 == fp32["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    manifest = json.loads((artifacts["int8"] / "manifest.json").read_text())
    assert manifest["model"]["kv_cache"] == {"dtype": "int8", "scales": "static", "scale_params": "kv_scales.{layer}"}
    record = manifest["pipeline"][-1]
    assert record["name"] == "quantize_kv_cache" and record["matches"] == 2
    assert record["accuracy"]["kl"] > 0 and record["accuracy"]["calibration"]["samples"] == 4
