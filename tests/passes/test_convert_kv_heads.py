"""convert_kv_heads on a tiny Qwen2 (8 query heads, 4 KV heads, k/v biases) whose KV heads 2 and 3
are near-copies of heads 0 and 1, so grouping by similarity ([0, 2], [1, 3]) and by index
([0, 1], [2, 3]) differ and similarity should win: the pooled weights against float64 means,
the converted graph against the float64 graph whose heads are replaced by their group means,
the KV bytes per token in the manifest and in the engine's cache, and the CLI's errors."""

import itertools
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import llmc
from llmc.cli import main
from llmc.compiler.frontends.samples import build_tiny_tokenizer, fill_seeded_weights
from llmc.compiler.interpreter import interpret
from llmc.compiler.ops import causal_attention
from llmc.compiler.options import CompileOptions
from llmc.compiler.pipeline import pass_configs, trace_and_lower
from llmc.compiler.targets import get_target
from llmc.errors import PassError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.convert_kv_heads import (
    convert_graph,
    find_sites,
    permute_head_cols,
    permute_head_rows,
    pool_head_rows,
    query_order,
)
from llmc.passes.kv_head_grouping import (
    HeadSimilarity,
    index_groups,
    similarity_groups,
    within_group_similarity,
)
from llmc.passes.registry import get_pass
from llmc.runtime.engine import Engine, EngineConfig

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8, 4, 8, 2
CALIB = dict(calib_samples=2, calib_seq_len=32)


def planted_qwen() -> Qwen2ForCausalLM:
    """Seeded O(1) weights; KV heads 2 and 3 (rows and biases of k/v) are heads 0 and 1 plus 5% noise."""
    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=HEADS * HEAD_DIM, intermediate_size=96,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=256, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         architectures=["Qwen2ForCausalLM"], attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        module = Qwen2ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(7)
    fill_seeded_weights(module, gen)
    with torch.no_grad():
        for layer in module.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                for p in (proj.weight, proj.bias):
                    heads = p.view(KV_HEADS, HEAD_DIM, *p.shape[1:])
                    heads[2:] = heads[:2] + 0.05 * heads[:2].std() * torch.randn(heads[:2].shape, generator=gen)
    return module


@pytest.fixture(scope="module")
def qwen_module():
    return planted_qwen()


@pytest.fixture(scope="module")
def graph(qwen_module):
    return trace_and_lower(qwen_module, 64, lambda *a: None)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, qwen_module):
    path = tmp_path_factory.mktemp("kvh") / "qwen-8q-4kv"
    qwen_module.save_pretrained(path, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def calibration(n=3, length=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (length,), generator=gen) for _ in range(n)]


def logits_of(graph, ids, weights=None):
    positions = torch.arange(len(ids))
    return interpret(graph, {"input_ids": ids, "positions": positions, "logits_indices": positions},
                     weights=weights)[graph.outputs[0]]


# -- weight arithmetic ------------------------------------------------------------------------
@pytest.mark.parametrize("heads,head_dim,groups", [
    (4, 8, [[0, 1], [2, 3]]), (4, 8, [[0, 3], [1, 2]]), (3, 64, [[0, 1, 2]]), (6, 5, [[1, 4, 5], [0, 2, 3]])])
def test_pooled_rows_are_float64_group_means(heads, head_dim, groups):
    gen = torch.Generator().manual_seed(heads * head_dim)
    weight, bias = torch.randn(heads * head_dim, 33, generator=gen), torch.randn(heads * head_dim, generator=gen)
    for w in (weight, bias):
        got = pool_head_rows(w, groups, head_dim)
        want = torch.cat([sum(w.double()[h * head_dim:(h + 1) * head_dim] for h in g) / len(g) for g in groups])
        assert got.dtype == w.dtype and got.shape == (len(groups) * head_dim, *w.shape[1:])
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)


def test_reordering_kv_heads_with_their_query_heads_leaves_attention_unchanged():
    """GQA attention (torch SDPA) with 3 KV heads, 2 query heads each: moving KV heads to the order
    [1, 2, 0] and the query heads with them, then the o-projection's columns back, is the identity."""
    gen = torch.Generator().manual_seed(3)
    hd, tokens = 4, 6
    x = torch.randn(tokens, 16, generator=gen)
    wq, wk, wv = (torch.randn(n * hd, 16, generator=gen) for n in (6, 3, 3))
    wo = torch.randn(16, 6 * hd, generator=gen)
    groups = [[1, 2], [0]]
    order = query_order(groups, queries_per_kv=2)
    assert order == [2, 3, 4, 5, 0, 1]

    def block(wq, wk, wv, wo):
        out = causal_attention(x @ wq.T, x @ wk.T, x @ wv.T, num_heads=6, num_kv_heads=3, head_dim=hd, scale=0.5)
        return out @ wo.T
    kv_order = [h for g in groups for h in g]
    moved = block(permute_head_rows(wq, order, hd), permute_head_rows(wk, kv_order, hd),
                  permute_head_rows(wv, kv_order, hd), permute_head_cols(wo, order, hd))
    torch.testing.assert_close(moved, block(wq, wk, wv, wo))
    assert not torch.allclose(block(permute_head_rows(wq, order, hd), wk, wv, permute_head_cols(wo, order, hd)),
                              block(wq, wk, wv, wo))


# -- grouping ---------------------------------------------------------------------------------
def test_similarity_grouping_recovers_planted_clusters():
    gen = torch.Generator().manual_seed(11)
    centres = torch.randn(4, 32, generator=gen)
    cluster = torch.tensor([2, 0, 3, 1, 1, 0, 2, 3])  # 8 heads, 4 clusters of 2, interleaved
    sim = HeadSimilarity(8, 32)
    for _ in range(3):
        k = (centres[cluster] + 0.3 * torch.randn(20, 8, 32, generator=gen)).reshape(20, -1)
        sim.add(k, k + 0.1 * torch.randn(k.shape, generator=gen))
    assert similarity_groups(sim.matrix(), 4) == [[0, 6], [1, 5], [2, 7], [3, 4]]
    assert similarity_groups(sim.matrix(), 2) in ([[0, 1, 5, 6], [2, 3, 4, 7]], [[0, 2, 6, 7], [1, 3, 4, 5]],
                                                  [[0, 3, 4, 6], [1, 2, 5, 7]])


@pytest.mark.parametrize("seed", range(5))
def test_similarity_grouping_of_four_heads_in_pairs_is_the_best_partition(seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    sim = (a + a.T) / 2
    partitions = [[[0, b], sorted({1, 2, 3} - {b})] for b in (1, 2, 3)]
    best = max(within_group_similarity(sim, p) for p in partitions)
    assert within_group_similarity(sim, similarity_groups(sim, 2)) == pytest.approx(best)


def test_head_similarity_is_mean_cosine_of_keys_and_values():
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(7, 3 * 4, generator=gen), torch.randn(7, 3 * 4, generator=gen)
    sim = HeadSimilarity(3, 4)
    sim.add(k[:3], v[:3])
    sim.add(k[3:], v[3:])
    kh, vh = k.double().reshape(7, 3, 4), v.double().reshape(7, 3, 4)
    want = torch.tensor([[0.5 * (torch.cosine_similarity(kh[:, a], kh[:, b], dim=-1).mean()
                                 + torch.cosine_similarity(vh[:, a], vh[:, b], dim=-1).mean()).item()
                          for b in range(3)] for a in range(3)], dtype=torch.float64)
    torch.testing.assert_close(sim.matrix(), want)


# -- the pass on a graph ----------------------------------------------------------------------
def expanded_reference(graph, plan):
    """float64 weights of `graph` with every KV head replaced by the mean of its group, the
    head count unchanged: what attention through the pooled heads must compute."""
    weights = {name: w.double() for name, w in graph.weights.items()}
    for site in find_sites(graph):
        for linear in (site.k, site.v):
            for name in linear.inputs[1:]:
                heads = weights[name].reshape(KV_HEADS, HEAD_DIM, *weights[name].shape[1:]).clone()
                for group in plan[site.attn.name]:
                    heads[group] = heads[group].mean(dim=0)
                weights[name] = heads.reshape(weights[name].shape)
    return weights


@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]], [[0, 1, 2, 3]]])
def test_converted_graph_matches_float64_graph_with_group_mean_heads(graph, groups):
    plan = {site.attn.name: groups for site in find_sites(graph)}
    converted = graph.copy()
    convert_graph(converted, plan)
    converted.verify()
    assert all(s.kv_heads == len(groups) for s in find_sites(converted))
    ref_weights = expanded_reference(graph, plan)
    for ids in calibration(n=2, length=13, seed=len(groups)):
        want = logits_of(graph, ids, weights=ref_weights)
        torch.testing.assert_close(logits_of(converted, ids).double(), want, atol=2e-4, rtol=1e-4)


def run_pass(graph, **options):
    g = graph.copy()
    records = PassManager([get_pass("convert_kv_heads", **options)], PassContext(calibration=calibration())).run(g)
    return g, records[0]


def test_similarity_pools_the_planted_near_copies_and_auto_keeps_it(graph):
    _, by_sim = run_pass(graph, kv_heads=2, grouping="similarity")
    _, by_index = run_pass(graph, kv_heads=2, grouping="index")
    assert by_sim.details["groups"] == [[[0, 2], [1, 3]]] * LAYERS
    assert by_index.details["groups"] == [[[0, 1], [2, 3]]] * LAYERS
    assert by_sim.accuracy["kl"] < 0.2 * by_index.accuracy["kl"]
    _, auto = run_pass(graph, kv_heads=2, grouping="auto")
    candidates = auto.details["candidates"]
    assert auto.details["grouping"] == "similarity" and candidates["similarity"]["kl"] < candidates["index"]["kl"]
    assert candidates["similarity"]["kl"] == pytest.approx(by_sim.accuracy["kl"], rel=1e-4)
    assert candidates["index"]["kl"] == pytest.approx(by_index.accuracy["kl"], rel=1e-4)


def test_pass_reports_kv_bytes_and_removed_params(graph):
    g, record = run_pass(graph, kv_heads=1, grouping="index")
    kv_per_layer = 2 * HEAD_DIM * 4  # keys and values, fp32
    assert record.details["kv_bytes_per_token_before"] == LAYERS * KV_HEADS * kv_per_layer
    assert record.details["kv_bytes_per_token_after"] == LAYERS * kv_per_layer
    removed = LAYERS * 2 * (KV_HEADS - 1) * HEAD_DIM * (HEADS * HEAD_DIM + 1)  # k and v: weight rows + bias
    assert record.details["params_removed"] == removed and record.bytes_saved == 4 * removed
    assert g.params["model.layers.0.self_attn.k_proj.bias"].type.shape == (HEAD_DIM,)


def test_kv_heads_equal_to_the_model_changes_nothing(graph):
    g, record = run_pass(graph, kv_heads=KV_HEADS, grouping="index")
    assert not record.changed and g.to_json() == graph.to_json()


@pytest.mark.parametrize("n", [3, 8])
def test_kv_heads_not_dividing_the_models_is_refused(graph, n):
    with pytest.raises(PassError, match=f"kv_heads={n} does not divide the 4 KV heads .* choose one of 1, 2, 4"):
        run_pass(graph, kv_heads=n, grouping="index")


def test_similarity_without_calibration_is_refused(graph):
    with pytest.raises(PassError, match="grouping=similarity compares heads on calibration text"):
        PassManager([get_pass("convert_kv_heads", kv_heads=2, grouping="similarity")]).run(graph.copy())


def test_conversion_after_quantisation_is_refused(graph):
    passes = [get_pass("quantize_int8"), get_pass("convert_kv_heads", kv_heads=2, grouping="index")]
    with pytest.raises(PassError, match="its weights are quantised; run convert_kv_heads before quantisation"):
        PassManager(passes).run(graph.copy())


def test_conversion_after_qkv_fusion_is_refused(graph):
    passes = [get_pass("fuse_qkv"), get_pass("convert_kv_heads", kv_heads=2, grouping="index")]
    with pytest.raises(PassError, match="slice of a fused projection; run convert_kv_heads before quantisation "
                                        "and fusion passes"):
        PassManager(passes).run(graph.copy())


# -- compiled artifacts -----------------------------------------------------------------------
def test_mqa_artifact_has_a_quarter_of_the_kv_bytes_and_runs_like_hf(qwen_dir, qwen_module, tmp_path):
    mqa = llmc.compile(str(qwen_dir), output=tmp_path / "mqa.llmc", kv_heads=1, kv_grouping="index", **CALIB)
    mqa_m = json.loads((mqa / "manifest.json").read_text())
    full = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # the source's fp32 keys and values
    assert mqa_m["model"]["num_kv_heads"] == 1 and mqa_m["report"]["kv_bytes_per_token"] * KV_HEADS == full
    record = mqa_m["pipeline"][0]
    assert record["name"] == "convert_kv_heads" and record["accuracy"]["ppl_after"] > 0
    engine = Engine(mqa, EngineConfig(kv_memory="256KiB"))
    k_cache = engine.cache.k_cache[0]
    assert len(engine.cache.k_cache) == LAYERS and k_cache.shape[1:] == (16, 1, HEAD_DIM)
    cache_bytes = sum(t.numel() * t.element_size() for t in engine.cache.k_cache + engine.cache.v_cache)
    assert cache_bytes // (k_cache.shape[0] * 16) == mqa_m["report"]["kv_bytes_per_token"]
    prompt = [5, 17, 200, 33, 7, 91]
    out = llmc.LLM(mqa).generate({"prompt_token_ids": prompt},
                                 llmc.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    want = mqa_reference(qwen_module).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert out[0].outputs[0].token_ids == want[0, len(prompt):].tolist()


def mqa_reference(module: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    """HF's own Qwen2 with one KV head, its k/v projections the float64 mean of the source's heads."""
    config = Qwen2Config.from_dict({**module.config.to_dict(), "num_key_value_heads": 1})
    state = {}
    for name, w in module.state_dict().items():
        if ".k_proj." in name or ".v_proj." in name:
            w = w.double().reshape(KV_HEADS, HEAD_DIM, *w.shape[1:]).mean(dim=0).float()
        state[name] = w
    with torch.random.fork_rng(devices=[]):
        mqa = Qwen2ForCausalLM(config).eval()
    mqa.load_state_dict(state)
    return mqa


def test_kv_heads_compose_with_int8_quantisation(qwen_dir, tmp_path):
    path = llmc.compile(str(qwen_dir), output=tmp_path / "gqa-int8.llmc", kv_heads=2, quant="int8", **CALIB)
    manifest = json.loads((path / "manifest.json").read_text())
    names = [p["name"] for p in manifest["pipeline"]]
    assert names.index("convert_kv_heads") < names.index("quantize_int8")
    assert manifest["pipeline"][0]["details"]["requested_grouping"] == "auto"
    assert manifest["model"]["num_kv_heads"] == 2
    out = llmc.LLM(path).generate("The river", llmc.SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("args,message", [
    (["--kv-heads", "3"], "kv_heads=3 does not divide the 4 KV heads"),
    (["--kv-heads", "0"], "--kv-heads 0 must be a positive number"),
    (["--kv-grouping", "index"], "--kv-grouping index needs --kv-heads N"),
])
def test_cli_bad_kv_heads_is_one_error_line_exit_2(qwen_dir, tmp_path, capfd, args, message):
    out = tmp_path / "bad.llmc"
    with pytest.raises(SystemExit) as e:
        main(["compile", str(qwen_dir), "-o", str(out), "-q", *args])
    # transformers' own "Loading weights" bar may precede it when the checkpoint loads
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("llmc: error: ") and message in err[0], err
    assert not out.exists()


def test_pipeline_order_is_pruning_then_kv_heads_then_quantisation_then_cleanup():
    opts = CompileOptions(prune="layers:1", kv_heads=1, kv_grouping="similarity", quant="int8")
    configs = [c for c in pass_configs(get_target("cpu"), opts) if c.origin != "lowering"]
    names = [c.name for c in configs]
    assert names[:3] == ["prune_layers", "convert_kv_heads", "quantize_int8"] and names[3] == "remove_noops"
    assert configs[1].options.to_dict() == {"kv_heads": 1, "grouping": "similarity"}


def test_index_groups_are_contiguous():
    assert index_groups(6, 2) == [[0, 1, 2], [3, 4, 5]]
    assert index_groups(3, 1) == [[0, 1, 2]]
    assert list(itertools.chain(*index_groups(8, 4))) == list(range(8))
