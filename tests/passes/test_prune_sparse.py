"""prune_sparse: 2:4 checked on every group of four along K of every sparsified linear, the
kept weights being each group's two highest scores; unstructured magnitude (per matrix) and
Wanda (per row) against numpy float64 references over HF activations; the LM head left dense;
shapes unchanged; and the per-target speedup the report promises."""

import numpy as np
import pytest
import torch
from prune_models import all_logits, build, capture, plan_logits, run_pass, tokens

from llmc.compiler.targets import TARGETS
from llmc.errors import PassError
from llmc.passes.prune_sparse import speedup_note


@pytest.fixture(scope="module", params=["gqa", "ragged"])
def model(request):
    return build(request.param, seed=6)


def linear_weights(graph):
    return {n.inputs[1]: graph.weights[n.inputs[1]] for n in graph.nodes if n.op == "linear"}


def numpy_input_norms(model, seqs, weights):
    """‖X_j‖₂ of each linear's input over the calibration tokens, from HF hooks (weight name ->
    norms; the test models keep HF's param names)."""
    modules = [w.removesuffix(".weight") for w in weights]
    acts = capture(model.module, modules, seqs)
    return {f"{m}.weight": np.sqrt((acts[m] ** 2).sum(0)) for m in modules}


def sparsified(graph):
    return {k: w for k, w in linear_weights(graph).items() if k != "lm_head.weight"}


@pytest.mark.parametrize("method", ["wanda", "magnitude"])
def test_2_4_keeps_the_two_highest_scores_of_every_group_of_four_along_k(model, method):
    seqs = tokens(41)
    graph = model.graph.copy()
    before = sparsified(model.graph)
    norms = numpy_input_norms(model, seqs, before) if method == "wanda" else {}
    record = run_pass(graph, "prune_sparse", seqs, pattern="2:4", method=method)
    after = sparsified(graph)
    skipped = [k for k, w in before.items() if w.shape[1] % 4]
    for name, w in after.items():
        old = before[name].double().numpy()
        assert w.shape == before[name].shape
        if name in skipped:
            assert torch.equal(w, before[name])
            continue
        groups = (w.numpy() != 0).reshape(w.shape[0], -1, 4)
        assert (groups.sum(-1) <= 2).all(), name  # every group of 4 consecutive along K
        score = np.abs(old) * (norms[name][None, :] if method == "wanda" else 1.0)
        top2 = np.argsort(-score.reshape(w.shape[0], -1, 4), axis=-1, kind="stable")[..., :2]
        expect = np.zeros_like(groups)
        np.put_along_axis(expect, top2, True, axis=-1)
        np.testing.assert_array_equal(w.numpy(), np.where(expect.reshape(w.shape), old, 0).astype(np.float32))
    assert torch.equal(graph.weights["lm_head.weight"], model.graph.weights["lm_head.weight"])
    d = record.details
    assert d["linears"] == len(before) - len(skipped) and d["params_removed"] == 0 and d["storage"] == "dense"
    assert d["zeros_after"] == sum(int((after[k] == 0).sum()) for k in after if k not in skipped)
    assert abs(d["sparsity_achieved"] - 0.5) < 1e-3
    ids = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(plan_logits(graph, ids), all_logits(graph, ids), rtol=1e-4, atol=1e-4)


def test_magnitude_zeroes_the_smallest_weights_of_each_matrix(model):
    graph = model.graph.copy()
    run_pass(graph, "prune_sparse", tokens(42, count=1), sparsity=0.6, method="magnitude")
    for name, w in sparsified(graph).items():
        old = model.graph.weights[name].double().abs().numpy().ravel()
        zeroed = w.numpy().ravel() == 0
        assert zeroed.sum() == round(0.6 * old.size)
        assert old[zeroed].max() <= old[~zeroed].min()


def test_wanda_zeroes_the_lowest_scores_of_each_output_row(model):
    seqs = tokens(43)
    graph = model.graph.copy()
    norms = numpy_input_norms(model, seqs, sparsified(model.graph))
    run_pass(graph, "prune_sparse", seqs, sparsity=0.5, method="wanda")
    for name, w in sparsified(graph).items():
        score = model.graph.weights[name].double().abs().numpy() * norms[name][None, :]
        zeroed = w.numpy() == 0
        assert (zeroed.sum(1) == round(0.5 * w.shape[1])).all(), name
        for row in range(w.shape[0]):
            assert score[row][zeroed[row]].max() <= score[row][~zeroed[row]].min() * (1 + 1e-6)


@pytest.mark.parametrize("options, message", [
    ({}, "exactly one of sparsity"),
    ({"sparsity": 0.5, "pattern": "2:4"}, "exactly one of sparsity"),
    ({"sparsity": 1.5}, "strictly between 0 and 1"),
    ({"pattern": "4:2"}, "not N:M"),
    ({"pattern": "2:x"}, "not N:M"),
    ({"sparsity": 0.5, "method": "random"}, "method='random' is unknown"),
])
def test_bad_options_name_the_problem(model, options, message):
    with pytest.raises(PassError, match=message):
        run_pass(model.graph.copy(), "prune_sparse", tokens(1, count=1), **options)


def test_the_report_says_plainly_which_targets_can_gain_from_the_zeros():
    assert speedup_note(TARGETS["cpu"], (2, 4)).startswith("none")
    assert speedup_note(TARGETS["cpu"], None).startswith("none")
    for name in ("h100-bf16", "a100-bf16", "orin-int4"):
        note = speedup_note(TARGETS[name], (2, 4))
        assert "sparse tensor cores" in note and "no speedup" in note
        assert speedup_note(TARGETS[name], None).startswith("none")
        assert speedup_note(TARGETS[name], (1, 4)).startswith("none")
