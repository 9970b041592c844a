"""shard_tensor_parallel in one process: per-rank params and collectives at world sizes 1, 2, 3, 4
and 8, refusal of sizes that do not divide, and the ranks' graphs run in lockstep (collectives summed or
joined across them by this test) against the unsharded graph, float and quantised."""

import pytest
import torch

from llmc.compiler.ops import COLLECTIVE_OPS, run_reference
from llmc.errors import PassError
from llmc.passes.base import PassContext, get_pass
from llmc.passes.decoder_structure import param_count
from tests.runtime.tiny_llama import FFN, HEADS, HIDDEN, KV_HEADS, VOCAB, build_tiny_llama, reference_outputs

LAYERS = 2


def shard(graph, tp: int) -> list:
    graphs = []
    for rank in range(tp):
        g = graph.copy()
        get_pass("shard_tensor_parallel", tp=tp, rank=rank).run(g, PassContext())
        g.verify()
        graphs.append(g)
    return graphs


def run_ranks(graphs, inputs: dict) -> torch.Tensor:
    """Every rank's graph node by node; a collective sums (all_reduce) or joins (all_gather) the
    ranks' inputs, as the process group would."""
    envs = [dict(g.weights) | inputs for g in graphs]
    for nodes in zip(*(g.nodes for g in graphs)):
        if nodes[0].op in COLLECTIVE_OPS:
            parts = [env[n.inputs[0]] for env, n in zip(envs, nodes)]
            joined = sum(parts) if nodes[0].op == "all_reduce" else torch.cat(parts, dim=-1)
            for env, n in zip(envs, nodes):
                env[n.out.name] = joined
            continue
        for env, n in zip(envs, nodes):
            env.update(zip((v.name for v in n.outputs), run_reference(n, [env[i] for i in n.inputs])))
    return envs[0][graphs[0].outputs[0]]


def counts(graph) -> dict:
    return {op: sum(n.op == op for n in graph.nodes) for op in COLLECTIVE_OPS}


def inputs(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    n = 7
    return {"input_ids": torch.randint(0, VOCAB, (n,), generator=gen), "positions": torch.arange(n),
            "logits_indices": torch.tensor([2, n - 1])}


def test_world_size_one_changes_nothing():
    graph = build_tiny_llama(select_rows=True)
    (only,) = shard(graph, 1)
    assert str(only) == str(graph)


def test_tp2_splits_heads_channels_and_vocab():
    graph = build_tiny_llama(select_rows=True)
    ranks = shard(graph, 2)
    for g in ranks:
        # per layer after o_proj and down_proj; after the embedding; the logits gathered
        assert counts(g) == {"all_reduce": 2 * LAYERS + 1, "all_gather": 1}
        assert [n.op for n in g.nodes if n.op.endswith("embedding")] == ["vocab_embedding"]
        attn = [n for n in g.nodes if n.op == "attention"]
        assert {(n.attrs["num_heads"], n.attrs["num_kv_heads"]) for n in attn} == {(HEADS // 2, KV_HEADS // 2)}
    sharded = LAYERS * (2 * HIDDEN * (HEADS + KV_HEADS) * 8 + 3 * HIDDEN * FFN) + 2 * VOCAB * HIDDEN
    assert param_count(ranks[0]) == param_count(graph) - sharded // 2


def test_tp8_replicates_attention_whose_kv_heads_do_not_divide():
    graph = build_tiny_llama(select_rows=True)
    for g in shard(graph, 8):
        # the MLP splits (64 channels); attention (2 KV heads), the embedding and head (50 rows) stay whole
        assert counts(g) == {"all_reduce": LAYERS, "all_gather": 0}
        assert param_count(g) == param_count(graph) - LAYERS * 3 * HIDDEN * FFN * 7 // 8


def test_a_size_that_does_not_divide_the_mlp_is_refused_naming_those_that_do():
    with pytest.raises(PassError, match=r"--tp 3: the MLP's 64 channels .* sizes that work for this model: "
                                        r"2, 4, 8, 16 \(attention heads split too for: 2\)"):
        shard(build_tiny_llama(select_rows=True), 3)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_ranks_in_lockstep_equal_the_unsharded_graph(tp):
    graph = build_tiny_llama(seed=tp, select_rows=True)
    x = inputs(tp)
    want = reference_outputs(graph, x)["logits"]
    got = run_ranks(shard(graph, tp), x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def lowered_tiny_llama():
    """The tiny-llama sample lowered (hidden 64: int4 groups of 32 split evenly over 2 ranks)."""
    from llmc.compiler.frontends import load_model
    from llmc.compiler.pipeline import trace_and_lower

    return trace_and_lower(load_model("tiny-llama").module, 16, lambda *a: None)


def test_tp3_splits_6_heads_3_kv_heads_and_96_channels_and_keeps_a_vocabulary_of_512_whole():
    from tiny_hf_models import SPECIAL, tiny_module
    from tiny_hf_models import VOCAB as HF_VOCAB
    from transformers import LlamaConfig

    from llmc.compiler.pipeline import trace_and_lower

    h, inter, heads, kv_heads, layers = 48, 96, 6, 3, 2
    config = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, **SPECIAL)
    graph = trace_and_lower(tiny_module(config, 3), 16, lambda *a: None)
    ranks = shard(graph, 3)
    d = h // heads
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter   # q/k/v, o, gate/up/down
    assert HF_VOCAB % 3 and [param_count(g) for g in ranks] == [param_count(graph) - layers * per_layer * 2 // 3] * 3
    for g in ranks:  # after o_proj and down_proj; the 512-row embedding and head stay whole
        assert counts(g) == {"all_reduce": 2 * layers, "all_gather": 0}
        assert {(n.attrs["num_heads"], n.attrs["num_kv_heads"]) for n in g.nodes if n.op == "attention"} == {(2, 1)}
    x = inputs(9)
    torch.testing.assert_close(run_ranks(ranks, x), reference_outputs(graph, x)["logits"], atol=1e-5, rtol=1e-5)


def test_a_tied_head_and_embedding_share_one_slice():
    graph = build_tiny_llama(seed=4, select_rows=True)
    head = next(n for n in graph.nodes if n.name == "logits")
    graph.replace_uses(head.inputs[1], "embed_tokens")
    graph.prune_params()
    x = inputs(6)
    want = reference_outputs(graph, x)["logits"]
    ranks = shard(graph, 2)
    for g in ranks:
        lookup = next(n for n in g.nodes if n.op == "vocab_embedding")
        gather = next(n for n in g.nodes if n.op == "all_gather")
        assert lookup.inputs[1] == g.producers()[gather.inputs[0]].inputs[1]
        assert g.type_of(lookup.inputs[1]).shape == (VOCAB // 2, HIDDEN)
    torch.testing.assert_close(run_ranks(ranks, x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant, options", [("quantize_int8", {}),
                                            ("quantize_int4", {"method": "rtn", "group_size": 32})])
def test_quantised_weights_shard_with_their_scales_and_zeros(lowered_tiny_llama, quant, options):
    graph = lowered_tiny_llama.copy()
    get_pass(quant, **options).run(graph, PassContext())
    x = inputs(5)
    want = reference_outputs(graph, x)["logits"]
    ranks = shard(graph, 2)
    assert sum(n.op == "qlinear" for n in ranks[0].nodes) == sum(n.op == "qlinear" for n in graph.nodes)
    torch.testing.assert_close(run_ranks(ranks, x), want, atol=1e-5, rtol=1e-5)


def test_int4_groups_that_straddle_ranks_are_refused():
    graph = build_tiny_llama(select_rows=True)
    get_pass("quantize_int4", method="rtn", group_size=32).run(graph, PassContext())
    # o_proj reads 32 features: 16 a rank at tp 2, half a group of 32
    with pytest.raises(PassError, match=r"int4 groups of 32 straddle the tensor-parallel cut .* give "
                                        r"--group-size a divisor of 16"):
        shard(graph, 2)
