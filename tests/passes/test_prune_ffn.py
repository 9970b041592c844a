"""prune_ffn: Wanda channel scores against float64 numpy over HF down_proj inputs, the channels it
keeps (rounded to multiples of 8 where the width allows), gate/up rows and down columns cut to
match, and the pruned model equal to the original with the removed channels zeroed."""

import numpy as np
import pytest
import torch
from prune_models import all_logits, build, capture, plan_logits, run_pass, tokens

from llmc.errors import PassError
from llmc.passes.base import PassContext
from llmc.passes.calibration_stats import channel_norms
from llmc.passes.decoder_structure import mlp_blocks
from llmc.passes.prune_ffn import channel_scores, kept_channel_count


@pytest.fixture(scope="module", params=["gqa", "ragged"])
def model(request):
    return build(request.param, seed=4)


@pytest.fixture(scope="module")
def mha():
    return build("mha")


def numpy_channel_scores(model, seqs):
    """score_j = ‖X_j‖₂ · Σ_i |W_down[i, j]| per layer, from the HF model's down_proj inputs."""
    layers = model.module.model.layers
    names = [f"model.layers.{i}.mlp.down_proj" for i in range(len(layers))]
    acts = capture(model.module, names, seqs)
    return [np.sqrt((acts[n] ** 2).sum(0)) * np.abs(layers[i].mlp.down_proj.weight.detach().double().numpy()).sum(0)
            for i, n in enumerate(names)]


def test_channel_scores_match_float64_numpy_on_hf_activations(model):
    seqs = tokens(21)
    blocks = mlp_blocks(model.graph, "test")
    norms = channel_norms(model.graph, PassContext(calibration=seqs), {b.down.inputs[0] for b in blocks}, "test")
    for b, expected in zip(blocks, numpy_channel_scores(model, seqs), strict=True):
        ours = channel_scores(model.graph.weights[b.down.inputs[1]], norms[b.down.inputs[0]])
        np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-5)


@pytest.mark.parametrize("n, fraction, multiple_of, kept", [
    (128, 0.3, 8, 88), (128, 0.25, 8, 96), (76, 0.3, 8, 53), (1536, 0.25, 8, 1152), (10, 0.5, 1, 5)])
def test_kept_channels_round_to_the_alignment_when_the_width_has_it(n, fraction, multiple_of, kept):
    assert kept_channel_count(n, fraction, multiple_of) == kept


def test_pruning_keeps_the_top_scoring_channels_and_equals_zeroed_channels(model):
    seqs = tokens(22)
    graph = model.graph.copy()
    record = run_pass(graph, "prune_ffn", seqs, fraction=0.3)
    original = model.graph.copy()
    blocks, old_blocks = mlp_blocks(graph, "test"), mlp_blocks(original, "test")
    for b, old, scores in zip(blocks, old_blocks, numpy_channel_scores(model, seqs), strict=True):
        n = old.channels
        keep = np.sort(np.argsort(scores, kind="stable")[n - kept_channel_count(n, 0.3, 8):])
        assert b.channels == len(keep)
        for up, old_up in zip(b.up, old.up):  # gate and up rows
            torch.testing.assert_close(graph.weights[up.inputs[1]], original.weights[old_up.inputs[1]][keep])
        torch.testing.assert_close(graph.weights[b.down.inputs[1]], original.weights[old.down.inputs[1]][:, keep])
        down = original.weights[old.down.inputs[1]].clone()
        down[:, np.setdiff1d(np.arange(n), keep)] = 0
        original.weights[old.down.inputs[1]] = down
    d = record.details
    assert d["channels_after"] == [b.channels for b in blocks]
    assert d["channels_before"] == [o.channels for o in old_blocks]
    hidden = graph.type_of(graph.nodes[0].out.name).shape[-1]
    assert d["params_removed"] == sum(3 * hidden * (o.channels - b.channels) for b, o in zip(blocks, old_blocks))
    assert d["kv_bytes_per_token_after"] == d["kv_bytes_per_token_before"]
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(1))
    reference = all_logits(original, ids)
    torch.testing.assert_close(all_logits(graph, ids), reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plan_logits(graph, ids), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 0.01, 0.99])
def test_fractions_that_cut_nothing_or_everything_are_refused(mha, fraction):
    with pytest.raises(PassError, match="prune_ffn"):
        run_pass(mha.graph.copy(), "prune_ffn", tokens(2, count=1), fraction=fraction)
