"""fuse_attention: `attention` (with the `rope` on its q and k) becomes one `flash_attention` op.
Its reference and the CPU backends (with and without a sliding window, GQA, ragged lengths, a
paged mixed batch) equal float64 attention; the fused graph computes what the unfused one did,
whatever produces q/k/v; the compiled tiny-llama gives the same greedy tokens through the engine,
and still compiles with an int8 KV cache."""

import sys
from pathlib import Path

import pytest
import torch
from contiguous_kv_cache import ContiguousKVCache

import llmc
from llmc.codegen.plan import build_plan
from llmc.codegen.torch_cpu.cpu_kernels import RopeCache, resolve_kernel
from llmc.compiler.inspect import report
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.ops import OPS, infer_types, run_reference
from llmc.errors import IRError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import build_pipeline, get_pass
from llmc.runtime.attention import NoCacheAttention
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata
from llmc.runtime.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from tiny_llama import HEAD_DIM, KV_HEADS, build_tiny_llama, random_tokens  # noqa: E402

UNFUSED = "remove_noops,fold_constants,dce"
FUSED = UNFUSED + ",fuse_attention,dce"


# -- independent float64 references ---------------------------------------------------------
def rope64(x, positions, inv_freq, head_dim, scaling):
    """Rotate-half rotary in float64, one head at a time."""
    x = x.double().reshape(x.shape[0], -1, head_dim)
    angle = positions.double()[:, None] * inv_freq.double()[None, :]        # [t, hd/2]
    cos, sin = angle.cos() * scaling, angle.sin() * scaling
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    out = torch.cat([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], dim=-1)
    return out.reshape(x.shape[0], -1)


def attention64(q, k, v, *, heads, kv_heads, head_dim, scale, start=0, window=None):
    """q: [t, heads*hd] at positions start..; k/v: [ctx, kv_heads*hd] at 0..ctx-1 (any layout
    that reshapes so). Scores masked to (p - window, p], softmax, weighted sum, head by head."""
    t = q.shape[0]
    k, v = k.double().reshape(-1, kv_heads, head_dim), v.double().reshape(-1, kv_heads, head_dim)
    pos, keys = start + torch.arange(t)[:, None], torch.arange(k.shape[0])[None, :]
    visible = (keys <= pos) & ((keys > pos - window) if window is not None else True)
    out = torch.empty(t, heads * head_dim, dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        scores = q.double()[:, h * head_dim:(h + 1) * head_dim] @ k[:, kv].T * scale
        out[:, h * head_dim:(h + 1) * head_dim] = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v[:, kv]
    return out


def random_attention_inputs(gen, t, heads, kv_heads, head_dim=8):
    q = torch.randn(t, heads * head_dim, generator=gen)
    k, v = (torch.randn(t, kv_heads * head_dim, generator=gen) for _ in range(2))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(t) + int(torch.randint(0, 50, (1,), generator=gen))
    return q, k, v, positions, inv_freq


def attrs_of(heads, kv_heads, head_dim=8, window=None, rope=None):
    return {"layer": 0, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "scale": head_dim ** -0.5, "causal": True, "window": window, "rope": rope}


# -- the op's reference -----------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("t", [1, 6, 13])
def test_flash_attention_reference_matches_float64_rope_then_attention(heads, kv_heads, window, t):
    gen = torch.Generator().manual_seed(t * 100 + heads * 10 + kv_heads)
    q, k, v, positions, inv_freq = random_attention_inputs(gen, t, heads, kv_heads)
    attrs = attrs_of(heads, kv_heads, window=window, rope={"scaling": 0.9})
    got = OPS["flash_attention"].reference(q, k, v, positions, inv_freq, **attrs)[0]
    expected = attention64(rope64(q, positions, inv_freq, 8, 0.9), rope64(k, positions, inv_freq, 8, 0.9), v,
                           heads=heads, kv_heads=kv_heads, head_dim=8, scale=8 ** -0.5, window=window)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    plain = OPS["flash_attention"].reference(q, k, v, **attrs_of(heads, kv_heads, window=window))[0]
    torch.testing.assert_close(plain.double(), attention64(q, k, v, heads=heads, kv_heads=kv_heads, head_dim=8,
                                                           scale=8 ** -0.5, window=window), atol=1e-5, rtol=1e-5)


def test_attention_reference_window_matches_sdpa_with_a_band_mask():
    gen = torch.Generator().manual_seed(11)
    q, k, v, _, _ = random_attention_inputs(gen, 12, 4, 4)
    got = OPS["attention"].reference(q, k, v, **attrs_of(4, 4, window=5))[0]
    band = torch.ones(12, 12, dtype=torch.bool).tril() & ~torch.ones(12, 12, dtype=torch.bool).tril(-5)
    heads = [x.reshape(12, 4, 8).transpose(0, 1) for x in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*heads, attn_mask=band, scale=8 ** -0.5)
    torch.testing.assert_close(got, expected.transpose(0, 1).reshape(12, 32), atol=1e-6, rtol=1e-5)
    # a window wider than the sequence is plain causal attention
    wide = OPS["attention"].reference(q, k, v, **attrs_of(4, 4, window=64))[0]
    torch.testing.assert_close(wide, OPS["attention"].reference(q, k, v, **attrs_of(4, 4))[0])


def _types(*shapes):
    return [TensorType(s, "float32") for s in shapes]


@pytest.mark.parametrize("inputs,attrs,message", [
    (_types(("tokens", 32), ("tokens", 16), ("tokens", 16)), attrs_of(4, 2, rope={"scaling": 1.0}),
     "3 inputs, expected 5 (q, k, v, positions, inv_freq)"),
    (_types(("tokens", 32), ("tokens", 16), ("tokens", 16)), attrs_of(4, 2, rope={"factor": 2}), "rope="),
    (_types(("tokens", 32), ("tokens", 32), ("tokens", 16)), attrs_of(4, 2), "k is float32[tokens, 32]"),
    (_types(("tokens", 32), ("tokens", 24), ("tokens", 24)), attrs_of(4, 3), "not a multiple"),
    (_types(("tokens", 32), ("tokens", 16), ("tokens", 16)), attrs_of(4, 2, window=0), "window=0"),
    (_types(("tokens", 32), ("tokens", 16), ("tokens", 16)), {**attrs_of(4, 2, window=4), "causal": False},
     "on causal attention"),
])
def test_flash_attention_type_rule_names_what_is_wrong(inputs, attrs, message):
    node = Graph().make_node("flash_attention", [f"x{i}" for i in range(len(inputs))], [], attrs)
    with pytest.raises(IRError, match="attention") as err:
        infer_types(node, inputs)
    assert message in str(err.value)


# -- the CPU backends with a sliding window ----------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 4])
def test_contiguous_cache_decode_with_window_matches_float64(window):
    gen = torch.Generator().manual_seed(window or 0)
    q, k, v, _, _ = random_attention_inputs(gen, 11, 4, 2)
    opts = dict(num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5, causal=True, window=window)
    expected = attention64(q, k, v, heads=4, kv_heads=2, head_dim=8, scale=8 ** -0.5, window=window)
    torch.testing.assert_close(NoCacheAttention().forward(0, q, k, v, **opts).double(), expected,
                               atol=1e-5, rtol=1e-5)
    cache = ContiguousKVCache(1, 16, 2, 8)
    rows = []
    for lo, hi in [(0, 6), (6, 7), (7, 8), (8, 11)]:  # a prefill, two decodes, a chunk
        rows.append(cache.forward(0, q[lo:hi], k[lo:hi], v[lo:hi], **opts))
        cache.advance(hi - lo)
    torch.testing.assert_close(torch.cat(rows).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [2, 7])
def test_paged_mixed_batch_with_window_matches_float64(window):
    gen = torch.Generator().manual_seed(window)
    block, heads, kv_heads, hd = 4, 4, 2, 8
    cache = PagedKVCache(1, 40, block, kv_heads, hd)
    for t in cache.k_cache + cache.v_cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    # (cached tokens, new tokens): a chunk from mid-sequence, decodes (one past a block edge), a fresh prefill
    shapes = [(6, 5), (9, 1), (16, 1), (3, 1), (0, 7)]
    ids = torch.randperm(40, generator=gen).tolist()
    tables = []
    for start, n in shapes:
        need = -(-(start + n) // block)
        tables, ids = tables + [ids[:need]], ids[need:]
    total = sum(n for _, n in shapes)
    q, k, v = (torch.randn(total, h * hd, generator=gen) for h in (heads, kv_heads, kv_heads))
    backend = PagedAttention(cache)
    backend.metadata = StepMetadata.build([(t, s, n) for t, (s, n) in zip(tables, shapes)], block)
    out = backend.forward(0, q, k, v, num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, scale=0.3,
                          causal=True, window=window)
    row = 0
    for table, (start, n) in zip(tables, shapes):
        ctx = torch.stack([cache.k_cache[0][table[p // block], p % block] for p in range(start + n)])
        vals = torch.stack([cache.v_cache[0][table[p // block], p % block] for p in range(start + n)])
        expected = attention64(q[row:row + n], ctx, vals, heads=heads, kv_heads=kv_heads, head_dim=hd,
                               scale=0.3, start=start, window=window)
        torch.testing.assert_close(out[row:row + n].double(), expected, atol=1e-5, rtol=1e-5)
        row += n


def test_cpu_flash_attention_kernel_equals_its_reference_with_and_without_rope_cache():
    gen = torch.Generator().manual_seed(5)
    q, k, v, positions, inv_freq = random_attention_inputs(gen, 9, 4, 2)
    attrs = attrs_of(4, 2, window=4, rope={"scaling": 1.0})
    expected = OPS["flash_attention"].reference(q, k, v, positions, inv_freq, **attrs)[0]
    kernel = resolve_kernel("cpu.flash_attention")
    for rope_cache in (None, RopeCache()):
        got = kernel(q, k, v, positions, inv_freq, backend=NoCacheAttention(), rope_cache=rope_cache, **attrs)[0]
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


# -- the pass on graphs -------------------------------------------------------------------------
def fuse(graph: Graph, disable=()) -> list:
    return PassManager(build_pipeline(["fuse_attention", "dce"], disable=disable), PassContext(quiet=True)).run(graph)


def test_fuse_attention_folds_both_ropes_and_keeps_the_logits():
    graph = build_tiny_llama(seed=3)
    ids, positions = random_tokens(12, seed=4)
    before = interpret(graph, {"input_ids": ids, "positions": positions})["logits"]
    records = fuse(graph)
    assert records[0].matches == 2 and records[0].details == {"flash_attention": 2, "rope_folded": 4}
    counts = graph.op_counts()
    assert counts["flash_attention"] == 2 and "attention" not in counts and "rope" not in counts
    flash = [n for n in graph.nodes if n.op == "flash_attention"]
    assert [n.attrs["layer"] for n in flash] == [0, 1]
    assert all(n.attrs["rope"] == {"scaling": 1.0} and n.inputs[3:] == ["positions", "inv_freq"] for n in flash)
    after = interpret(graph, {"input_ids": ids, "positions": positions})["logits"]
    torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)


def test_fused_plan_decodes_through_a_kv_cache_like_the_unfused_one():
    graph = build_tiny_llama(seed=5)
    fused = graph.copy()
    fuse(fused)
    ids, positions = random_tokens(10, seed=6)
    outs = []
    for g in (graph, fused):
        plan = build_plan(g, "cpu", max_tokens=16)
        assert plan.kv_layout() == {"num_layers": 2, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
        executor, cache, rows = PlanExecutor(plan, g.weights), ContiguousKVCache(2, 16, KV_HEADS, HEAD_DIM), []
        for lo, hi in [(0, 7), (7, 8), (8, 9), (9, 10)]:
            rows.append(executor.run(ids[lo:hi], positions[lo:hi], cache))
            cache.advance(hi - lo)
        outs.append(torch.cat(rows))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)


def split_qkv_graph(share_rotated_k: bool = False, k_inv_freq: str = "inv_freq", window=None) -> Graph:
    """x -> one qkv linear -> split -> rope q, rope k -> attention -> out; optionally the rotated
    k also feeds an add, or k rotates by its own frequencies."""
    gen = torch.Generator().manual_seed(8)
    g = Graph("split_qkv")
    g.add_input("x", TensorType(("tokens", 16), "float32"))
    g.add_input("positions", TensorType(("tokens",), "int64"))
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    g.add_param("inv_freq", TensorType((4,), "float32"), inv)
    g.add_param("inv_freq_k", TensorType((4,), "float32"), inv * 0.5)
    g.add_param("w_qkv", TensorType((64, 16), "float32"), torch.randn(64, 16, generator=gen))

    def add(op, inputs, features, **attrs):
        n = g.make_node(op, inputs, [TensorType(("tokens", f), "float32") for f in features], attrs)
        g.nodes.append(n)
        return [v.name for v in n.outputs]
    qkv = add("linear", ["x", "w_qkv"], [64])[0]
    q, k, v = add("split", [qkv], [32, 16, 16], sizes=[32, 16, 16])
    q = add("rope", [q, "positions", "inv_freq"], [32], head_dim=8, scaling=1.0)[0]
    k = add("rope", [k, "positions", k_inv_freq], [16], head_dim=8, scaling=1.0)[0]
    g.outputs = add("attention", [q, k, v], [32], **attrs_of(4, 2, window=window))
    if share_rotated_k:
        g.outputs.append(add("add", [k, k], [16])[0])
    g.verify()
    return g


def run_split_graph(g: Graph, t: int = 9) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(t)
    inputs = {"x": torch.randn(t, 16, generator=gen), "positions": torch.arange(t) + 3}
    return list(interpret(g, inputs).values())


@pytest.mark.parametrize("window", [None, 3])
def test_q_k_v_from_a_split_fuse_and_keep_the_window(window):
    graph = split_qkv_graph(window=window)
    before = run_split_graph(graph)
    fuse(graph)
    (flash,) = [n for n in graph.nodes if n.op == "flash_attention"]
    split = next(n for n in graph.nodes if n.op == "split")
    assert flash.inputs[:3] == [v.name for v in split.outputs] and flash.attrs["window"] == window
    assert "rope" not in graph.op_counts()
    torch.testing.assert_close(run_split_graph(graph), before, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["rotated k read elsewhere", "k rotates by other frequencies"])
def test_ropes_that_cannot_fold_stay_and_the_attention_still_fuses(case):
    graph = split_qkv_graph(share_rotated_k=case == "rotated k read elsewhere",
                            k_inv_freq="inv_freq_k" if case == "k rotates by other frequencies" else "inv_freq")
    before = run_split_graph(graph)
    records = fuse(graph)
    assert records[0].details == {"flash_attention": 1, "rope_folded": 0}
    (flash,) = [n for n in graph.nodes if n.op == "flash_attention"]
    assert flash.attrs["rope"] is None and len(flash.inputs) == 3
    assert graph.op_counts()["rope"] == 2
    torch.testing.assert_close(run_split_graph(graph), before, atol=1e-6, rtol=1e-6)


def test_disable_pass_leaves_attention_unfused():
    graph = build_tiny_llama()
    records = fuse(graph, disable=["fuse_attention"])
    assert [r.name for r in records] == ["dce"]
    assert graph.op_counts()["attention"] == 2 and "flash_attention" not in graph.op_counts()
    assert get_pass("fuse_attention").name == "fuse_attention"


# -- the compiled model through the engine ---------------------------------------------------
def engine_tokens(artifact) -> dict[str, list[int]]:
    """Greedy tokens of a mixed batch: prompts of ragged lengths (two longer than a block, one
    sharing a prefix), prefill chunked by a small token budget, decodes batched with prefills."""
    engine = Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=16, max_num_batched_tokens=48, max_num_seqs=8))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 37, 1, 20)]
    prompts.append(prompts[1][:30] + [7, 8, 9])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids, params=params)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return done


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuse_attention")
    return {name: llmc.compile("tiny-llama", output=root / f"{name}.llmc", passes=passes)
            for name, passes in (("unfused", UNFUSED), ("fused", FUSED))}


def test_tiny_llama_fused_gives_the_same_greedy_tokens_through_the_engine(compiled):
    fused_ops = report(compiled["fused"])["op_counts"]
    assert fused_ops["flash_attention"] == 2 and "attention" not in fused_ops and "rope" not in fused_ops
    fused, unfused = engine_tokens(compiled["fused"]), engine_tokens(compiled["unfused"])
    assert fused == unfused and len(fused) == 5 and all(len(t) == 12 for t in fused.values())


def test_int8_kv_cache_compiles_after_fusion_with_the_same_scales_and_tokens(tmp_path):
    paths = {name: llmc.compile("tiny-llama", output=tmp_path / f"{name}.llmc", passes=passes, kv_cache="int8",
                                calib_samples=2, calib_seq_len=32)
             for name, passes in (("unfused", UNFUSED), ("fused", FUSED))}
    reports = {name: report(p) for name, p in paths.items()}
    kv = [next(r for r in reports[name]["passes"] if r["name"] == "quantize_kv_cache") for name in paths]
    assert kv[0]["matches"] == kv[1]["matches"] == 2
    assert kv[0]["details"] == kv[1]["details"] and kv[0]["accuracy"] == kv[1]["accuracy"]
    assert reports["fused"]["model"]["kv_dtype"] == "int8"
    assert engine_tokens(paths["fused"]) == engine_tokens(paths["unfused"])


def test_a_window_of_one_sees_only_the_token_itself_in_kernel_and_reference():
    gen = torch.Generator().manual_seed(2)
    q, k, v, _, _ = random_attention_inputs(gen, 5, 4, 4)
    attrs = attrs_of(4, 4, window=1)
    torch.testing.assert_close(resolve_kernel("cpu.attention")(q, k, v, backend=NoCacheAttention(), **attrs)[0], v)
    torch.testing.assert_close(run_reference(Graph().make_node("attention", [], [], attrs), [q, k, v])[0], v)
