"""prune_layers: block influence against float64 numpy over the HF decoder layers' input and
output hidden states, layers found from the dataflow alone (params renamed), the pruned model
equal to the HF model with the same layers deleted, and attention layers renumbered densely."""

import numpy as np
import pytest
import torch
from prune_models import all_logits, build, capture, plan_logits, run_pass, tokens
from renamed_params import renamed

from llmc.errors import PassError
from llmc.passes.base import PassContext
from llmc.passes.decoder_structure import decoder_layers
from llmc.passes.prune_layers import block_influence


@pytest.fixture(scope="module", params=["ragged", "mha"])
def model(request):
    return build(request.param, seed=5)


def numpy_block_influence(model, seqs):
    """1 − mean cos(h_in, h_out) per HF decoder layer, from forward hooks."""
    names = [f"model.layers.{i}" for i in range(len(model.module.model.layers))]
    h_in, h_out = capture(model.module, names, seqs), capture(model.module, names, seqs, output=True)
    out = []
    for n in names:
        a, b = h_in[n], h_out[n]
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        out.append(1.0 - cos.mean())
    return out


def test_block_influence_matches_float64_numpy_on_hf_hidden_states(model):
    seqs = tokens(31)
    graph = renamed(model.graph)
    layers = decoder_layers(graph, "test")
    assert len(layers) == len(model.module.model.layers)
    ours = block_influence(graph, PassContext(calibration=seqs), layers, "test")
    np.testing.assert_allclose(ours, numpy_block_influence(model, seqs), rtol=1e-5, atol=1e-9)


def hf_without(model, doomed, ids):
    """Logits of the HF model with the decoder layers `doomed` deleted."""
    module = model.module
    kept = [layer for i, layer in enumerate(module.model.layers) if i not in doomed]
    original = module.model.layers
    module.model.layers = torch.nn.ModuleList(kept)
    module.config.num_hidden_layers = len(kept)
    try:
        with torch.no_grad():
            return module(input_ids=ids[None], use_cache=False).logits[0]
    finally:
        module.model.layers = original
        module.config.num_hidden_layers = len(original)


def test_pruning_the_least_influential_layers_equals_hf_without_them(model):
    seqs = tokens(32)
    graph = renamed(model.graph)
    kv_before = sum(1 for n in graph.nodes if n.op == "attention")
    record = run_pass(graph, "prune_layers", seqs, count=2)
    doomed = sorted(np.argsort(numpy_block_influence(model, seqs), kind="stable")[:2].tolist())
    assert record.details["removed_layers"] == doomed
    attention = [n for n in graph.nodes if n.op == "attention"]
    assert [n.attrs["layer"] for n in attention] == list(range(kv_before - 2))
    d = record.details
    assert d["kv_bytes_per_token_after"] * kv_before == d["kv_bytes_per_token_before"] * (kv_before - 2)
    assert d["layers_after"] == kv_before - 2 and d["params_removed"] > 0
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(2))
    reference = hf_without(model, doomed, ids)
    torch.testing.assert_close(all_logits(graph, ids), reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plan_logits(graph, ids), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("count", [0, 3, 7])
def test_a_count_outside_one_to_layers_minus_one_is_refused(model, count):
    with pytest.raises(PassError, match=r"count=\d+ must be at least 1 and below the model's 3 decoder layers"):
        run_pass(model.graph.copy(), "prune_layers", tokens(3, count=1), count=count)
