"""prune_heads: head-set scores against float64 numpy over HF activations, the heads it picks,
shapes and attention attrs that shrink, and GQA consistency: the pruned model computes exactly
what the original computes with the removed heads' outputs zeroed, so every kept query head still
reads its own KV head (group and query units, GQA, ragged and MHA shapes)."""

import numpy as np
import pytest
import torch
from prune_models import all_logits, build, capture, plan_logits, run_pass, tokens

from llmc.errors import PassError
from llmc.passes.base import PassContext
from llmc.passes.calibration_stats import gram_matrices
from llmc.passes.decoder_structure import attention_blocks
from llmc.passes.prune_heads import head_set_score


@pytest.fixture(scope="module", params=["gqa", "ragged", "mha"])
def model(request):
    return build(request.param, seed=3)


@pytest.fixture(scope="module")
def gqa():
    return build("gqa")


def numpy_head_scores(model, seqs, heads_of):
    """Per layer, per head set: Σ_t ‖W_o[:, S] a_t[S]‖² straight from o_proj's HF inputs."""
    layers = model.module.model.layers
    names = [f"model.layers.{i}.self_attn.o_proj" for i in range(len(layers))]
    acts = capture(model.module, names, seqs)
    out = []
    for i, name in enumerate(names):
        w = layers[i].self_attn.o_proj.weight.detach().double().numpy()
        hd = layers[i].self_attn.head_dim
        scores = []
        for heads in heads_of(layers[i].self_attn):
            cols = [h * hd + d for h in heads for d in range(hd)]
            contrib = acts[name][:, cols] @ w[:, cols].T   # [tokens, hidden]
            scores.append(float((contrib ** 2).sum()))
        out.append(scores)
    return out


def groups_of(attn):
    g = attn.config.num_attention_heads // attn.config.num_key_value_heads
    return [list(range(u * g, (u + 1) * g)) for u in range(attn.config.num_key_value_heads)]


def test_head_set_scores_match_float64_numpy_on_hf_activations(model):
    seqs = tokens(11)
    graph = model.graph
    blocks = attention_blocks(graph, "test")
    grams = gram_matrices(graph, PassContext(calibration=seqs), {b.attention.out.name for b in blocks}, "test")
    singles = numpy_head_scores(model, seqs, lambda attn: [[h] for h in range(attn.config.num_attention_heads)])
    groups = numpy_head_scores(model, seqs, groups_of)
    for i, b in enumerate(blocks):
        w_o, gram = graph.weights[b.o.inputs[1]], grams[b.attention.out.name]
        ours_single = [head_set_score(w_o, gram, [h], b.head_dim) for h in range(b.num_heads)]
        ours_group = [head_set_score(w_o, gram, list(range(u * b.group_size, (u + 1) * b.group_size)), b.head_dim)
                      for u in range(b.num_kv_heads)]
        np.testing.assert_allclose(ours_single, singles[i], rtol=1e-4)
        np.testing.assert_allclose(ours_group, groups[i], rtol=1e-4)


def masked_original(graph, removed):
    """The unpruned graph with o_proj's columns of the removed heads set to zero."""
    masked = graph.copy()
    for b, heads in zip(attention_blocks(masked, "test"), removed):
        w = masked.weights[b.o.inputs[1]].clone()
        for h in heads:
            w[:, h * b.head_dim:(h + 1) * b.head_dim] = 0
        masked.weights[b.o.inputs[1]] = w
    return masked


def test_group_pruning_removes_the_lowest_scoring_kv_groups_and_equals_zeroed_heads(model):
    seqs = tokens(5)
    graph = model.graph.copy()
    before = [(b.num_heads, b.num_kv_heads, b.head_dim) for b in attention_blocks(graph, "test")]
    heads, kv, hd = before[0]
    if kv == 1:
        pytest.skip("one KV group: nothing to remove")
    record = run_pass(graph, "prune_heads", seqs, fraction=0.34)
    cut = round(0.34 * kv)
    expected = []
    for scores in numpy_head_scores(model, seqs, groups_of):
        doomed = np.argsort(scores, kind="stable")[:cut]
        g = heads // kv
        expected.append(sorted(h for u in doomed for h in range(u * g, (u + 1) * g)))
    assert record.details["removed_heads"] == expected
    for b in attention_blocks(graph, "test"):
        assert (b.num_heads, b.num_kv_heads) == (heads - cut * heads // kv, kv - cut)
        assert tuple(graph.params[b.q.inputs[1]].type.shape)[0] == b.num_heads * hd
        assert tuple(graph.params[b.k.inputs[1]].type.shape)[0] == b.num_kv_heads * hd
        assert tuple(graph.params[b.v.inputs[1]].type.shape)[0] == b.num_kv_heads * hd
        assert tuple(graph.params[b.o.inputs[1]].type.shape)[1] == b.num_heads * hd
    d = record.details
    assert d["kv_bytes_per_token_after"] * kv == d["kv_bytes_per_token_before"] * (kv - cut)
    assert d["params_removed"] > 0 and d["bytes_removed"] == 4 * d["params_removed"] == record.bytes_saved
    ids = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(8))
    reference = all_logits(masked_original(model.graph, expected), ids)
    torch.testing.assert_close(all_logits(graph, ids), reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plan_logits(graph, ids), reference, rtol=1e-4, atol=1e-4)
    assert record.accuracy["ppl_after"] > 0 and record.accuracy["kl"] > 0


def test_query_pruning_keeps_every_kv_head_and_an_equal_count_per_group(model):
    seqs = tokens(6)
    graph = model.graph.copy()
    b0 = attention_blocks(graph, "test")[0]
    heads, kv, g = b0.num_heads, b0.num_kv_heads, b0.group_size
    if g == 1:
        with pytest.raises(PassError, match="unit=group"):
            run_pass(graph, "prune_heads", seqs, fraction=0.5, unit="query")
        return
    record = run_pass(graph, "prune_heads", seqs, fraction=0.5, unit="query")
    cut = round(0.5 * g)
    expected = []
    for scores in numpy_head_scores(model, seqs, lambda attn: [[h] for h in range(heads)]):
        expected.append(sorted(u * g + int(j) for u in range(kv)
                               for j in np.argsort(scores[u * g:(u + 1) * g], kind="stable")[:cut]))
    assert record.details["removed_heads"] == expected
    for removed in expected:  # the same number from every group
        assert [sum(1 for h in removed if h // g == u) for u in range(kv)] == [cut] * kv
    assert record.details["kv_bytes_per_token_after"] == record.details["kv_bytes_per_token_before"]
    assert all(b.num_kv_heads == kv and b.num_heads == heads - kv * cut for b in attention_blocks(graph, "t"))
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(all_logits(graph, ids), all_logits(masked_original(model.graph, expected), ids),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options, message", [
    ({"fraction": 1.0}, "strictly between 0 and 1"),
    ({"fraction": 0.1}, "rounds to none removed"),
    ({"fraction": 0.9}, "would remove all"),
    ({"unit": "layer"}, "unit='layer' is unknown"),
])
def test_bad_options_name_the_problem(gqa, options, message):
    with pytest.raises(PassError, match=message):
        run_pass(gqa.graph.copy(), "prune_heads", tokens(1, count=1), **options)


def test_without_calibration_the_error_says_how_to_give_it(gqa):
    with pytest.raises(PassError, match="calibration"):
        run_pass(gqa.graph.copy(), "prune_heads", None, fraction=0.5)
