"""shard_pipeline in one process: layers per stage at pp 2 and 3 (balanced, and --pp-split), the
refusal of bad splits and of more stages than layers, what each stage holds (params, send/recv,
local layer numbers), and the stages run one after another (send handing recv its tensor, as the
process group would) against the unsharded graph."""

import pytest
import torch

from llmc.compiler.ops import run_reference
from llmc.errors import PassError
from llmc.passes.base import PassContext, get_pass
from llmc.passes.decoder_structure import param_count
from llmc.passes.shard_pipeline import balanced_split
from tests.runtime.tiny_llama import VOCAB, build_tiny_llama, reference_outputs


def stages(graph, pp: int, split: str = "") -> list:
    graphs = []
    for stage in range(pp):
        g = graph.copy()
        get_pass("shard_pipeline", pp=pp, stage=stage, split=split).run(g, PassContext())
        g.verify()
        graphs.append(g)
    return graphs


def layers(graph) -> list[int]:
    return [n.attrs["layer"] for n in graph.nodes if n.op == "attention"]


def run_stages(graphs, inputs: dict) -> torch.Tensor:
    """Each stage's graph in turn; a send puts its tensor in the peer's mailbox, a recv takes it."""
    mailbox = {}
    for stage, g in enumerate(graphs):
        env = dict(g.weights) | inputs
        for n in g.nodes:
            if n.op == "recv":
                env[n.out.name] = mailbox.pop(stage)
            elif n.op == "send":
                mailbox[n.attrs["peer"]] = env[n.out.name] = env[n.inputs[0]]
            else:
                env.update(zip((v.name for v in n.outputs), run_reference(n, [env[i] for i in n.inputs])))
    return mailbox.pop(0)


def inputs(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (9,), generator=gen), "positions": torch.arange(9),
            "logits_indices": torch.tensor([3, 8])}


@pytest.mark.parametrize("num_layers, pp, split", [(4, 2, [2, 2]), (6, 3, [2, 2, 2]), (5, 3, [2, 2, 1]),
                                                   (2, 2, [1, 1])])
def test_balanced_stages_hold_their_layers_numbered_from_zero(num_layers, pp, split):
    graph = build_tiny_llama(num_layers=num_layers, select_rows=True)
    graphs = stages(graph, pp)
    assert [len(layers(g)) for g in graphs] == split
    assert all(layers(g) == list(range(n)) for g, n in zip(graphs, split))
    ops = [[n.op for n in g.nodes] for g in graphs]
    assert ops[0][0] == "embedding" and all(o[0] == "recv" for o in ops[1:])
    assert all(o[-1] == "send" for o in ops)
    assert [g.nodes[-1].attrs["peer"] for g in graphs] == [*range(1, pp), 0]
    assert graphs[-1].outputs == ["logits"] and "lm_head" in graphs[-1].params
    assert "embed_tokens" in graphs[0].params and all("embed_tokens" not in g.params for g in graphs[1:])
    # every layer's params on exactly one stage; the rope table on each
    assert sum(param_count(g) for g in graphs) == param_count(graph) + (pp - 1) * 4


@pytest.mark.parametrize("num_layers, pp, split", [(4, 2, ""), (6, 3, ""), (5, 3, "1,3,1"), (3, 2, "2,1")])
def test_stages_in_turn_equal_the_unsharded_graph(num_layers, pp, split):
    graph = build_tiny_llama(seed=num_layers, num_layers=num_layers, select_rows=True)
    x = inputs(pp)
    want = reference_outputs(graph, x)["logits"]
    torch.testing.assert_close(run_stages(stages(graph, pp, split), x), want, atol=1e-5, rtol=1e-5)


def test_stages_cast_to_bf16_still_send_and_receive_float32():
    # each stage's graph is cast on its own: what one sends must be what the next one's recv was typed
    graphs = stages(build_tiny_llama(seed=3, select_rows=True), 2)
    for g in graphs:
        get_pass("cast_bf16", dtype="bfloat16").run(g, PassContext())
        g.verify()
    x = inputs(7)
    sends = [(n, g) for g in graphs for n in g.nodes if n.op == "send"]
    assert [g.type_of(n.inputs[0]).dtype for n, g in sends] == ["float32", "float32"]
    assert [n.attrs["dtype"] for n in graphs[1].nodes if n.op == "recv"] == ["float32"]
    want = reference_outputs(build_tiny_llama(seed=3, select_rows=True), x)["logits"]
    torch.testing.assert_close(run_stages(graphs, x), want, atol=0.05, rtol=0.05)  # bf16 activations


def test_pp_split_overrides_the_balance():
    graph = build_tiny_llama(num_layers=5, select_rows=True)
    assert [len(layers(g)) for g in stages(graph, 2, "4,1")] == [4, 1]


@pytest.mark.parametrize("split", ["3,2", "2,1,1", "0,4", "a,b", "2,"])
def test_bad_splits_are_refused_in_one_line(split):
    with pytest.raises(PassError, match=rf"^--pp-split {split}: give 2 layer counts of at least 1 adding up to "
                                        r"this model's 4 decoder layers \(e.g. 2,2\)$"):
        stages(build_tiny_llama(num_layers=4, select_rows=True), 2, split)


def test_more_stages_than_layers_are_refused():
    with pytest.raises(PassError, match=r"^--pp 3: this model has 2 decoder layers and a pipeline stage needs at "
                                        r"least one; give --pp 2 or fewer$"):
        stages(build_tiny_llama(select_rows=True), 3)


def test_the_lm_heads_cost_shortens_the_last_stage():
    # 30 layers of 3.5M multiply-adds and a head of 28M (SmolLM2-135M's shapes)
    assert balanced_split([3_540_000] * 30, 28_311_552, 2) == [19, 11]
    assert balanced_split([1] * 30, 0, 2) == [15, 15]
    assert balanced_split([5, 1, 1, 1, 1, 1], 0, 3) == [1, 4, 1]  # ties: earlier stages longer


def test_pp_split_without_pp_is_refused():
    from llmc.compiler.parallel_build import pipeline_size
    from llmc.compiler.recipes import shard_passes

    with pytest.raises(PassError, match=r"^--pp-split 2,2 splits pipeline stages; give --pp N with it$"):
        shard_passes(1, 1, "2,2")
    assert pipeline_size(shard_passes(1, 3)) == 3
    assert pipeline_size(shard_passes(2, 2)) == 2  # with --tp: tests/parallel/test_tp_pp.py
