"""Every pass on every architecture: int8, int4, fp8 and w8a8 quantisation, the CPU fusions,
cast_bf16, KV-head conversion and pruning, each run on each tiny architecture's lowered graph
(traced once per architecture) either works or refuses in one line naming what it cannot do. A
quantising pass that works quantises every linear except those its record names as kept (GPT-2's
Conv1D projections included); int8 then agrees with fp32 on the top-1 token at >= 95% of a prompt's
positions, the fusions are lossless, and what the others leave computes finite logits."""

import copy
import re

import pytest
import tiny_hf_models as tiny
import torch

from llmc.compiler.architectures import PASSES, SUPPORTED
from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret
from llmc.compiler.options import CompileOptions
from llmc.compiler.parallel_build import run_passes
from llmc.compiler.pipeline import pass_configs, trace
from llmc.compiler.targets import get_target
from llmc.errors import LlmcError
from llmc.passes.base import PassContext

CASES = {
    "int8": dict(quant="int8"),
    "int4": dict(quant="int4-rtn", group_size=32),
    "fp8": dict(quant="fp8"),
    "w8a8": dict(quant="w8a8"),
    "fuse": dict(),  # the cpu target's pipeline: fuse_qkv, fuse_gate_up, fuse_swiglu, fuse_rms_norm, fuse_attention
    "cast_bf16": dict(add=["cast_bf16"]),
    "kv_heads": dict(kv_heads=1, kv_grouping="index"),
    "prune": dict(prune="heads:0.5,ffn:0.25"),
}
QUANT_PASSES = {"int8": "quantize_int8", "int4": "quantize_int4", "fp8": "quantize_fp8", "w8a8": "quantize_w8a8"}
# (arch, case) pairs that refuse, and how their one line starts: the README's table shows these
REFUSALS = {(a.key, case): re.escape(why) for a in SUPPORTED for case, why, _ in a.refused_passes}
PROMPT = tiny.prompt_ids(24, seed=5)


def test_the_cases_are_the_passes_the_architecture_table_lists():
    assert tuple(CASES) == PASSES and set(QUANT_PASSES) <= set(PASSES)


@pytest.fixture(scope="module", params=sorted(tiny.ARCHS))
def arch(request, tmp_path_factory):
    """(name, traced graph, its float logits on PROMPT after the cpu pipeline) of one architecture."""
    source = tmp_path_factory.mktemp(request.param)
    # one layer traces twice as fast, and every pass sees the same block
    config = tiny.ARCHS[request.param](**{"n_layer" if request.param == "gpt2" else "num_hidden_layers": 1})
    tiny.save_checkpoint(config, source, seed=23)
    graph = trace(load_model(str(source)).module, 64, lambda *a: None)
    return request.param, graph, logits(compiled(graph, CompileOptions()))


def compiled(graph, opts: CompileOptions):
    ctx = PassContext(target=get_target("cpu"), quiet=True,
                      calibration=[torch.tensor(tiny.prompt_ids(32, seed=s)) for s in (1, 2)])
    graph = copy.deepcopy(graph)
    graph.records = run_passes(graph, pass_configs(get_target("cpu"), opts), ctx)[1]
    return graph


def logits(graph) -> torch.Tensor:
    n = len(PROMPT)
    inputs = {"input_ids": torch.tensor(PROMPT), "positions": torch.arange(n), "logits_indices": torch.arange(n)}
    return interpret(graph, inputs)["logits"].float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pass_works_or_refuses_in_one_line(arch, case):
    name, traced, reference = arch
    refusal = REFUSALS.get((name, case))
    if refusal is not None:
        with pytest.raises(LlmcError, match=refusal) as caught:
            compiled(traced, CompileOptions(**CASES[case]))
        assert "\n" not in str(caught.value)
        return
    graph = compiled(traced, CompileOptions(**CASES[case]))
    got = logits(graph)
    assert torch.isfinite(got).all()
    if case in QUANT_PASSES:
        check_every_linear_is_quantised_or_named(graph, QUANT_PASSES[case])
    if case == "int8":
        assert (got.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95
    if case == "fuse":
        assert tiny.max_relative_error(got, reference) < 1e-5


def check_every_linear_is_quantised_or_named(graph, pass_name):
    record = next(r for r in graph.records if r.name == pass_name)
    kept = {w for weights in record.details["skipped"].values() for w in weights}
    left = [n.inputs[1] for n in graph.nodes if n.op == "linear"]
    assert set(left) <= kept
    quantised = sum(n.op == "qlinear" for n in graph.nodes)
    details = record.details["quant"][pass_name.removeprefix("quantize_")]
    assert 0 < quantised <= details["linears"] + details.get("tied_heads", 0)


def test_gpt2_s_conv1d_projections_are_all_quantised(tmp_path):
    source = tmp_path / "gpt2"
    tiny.save_checkpoint(tiny.ARCHS["gpt2"](n_layer=1), source, seed=23)
    graph = compiled(trace(load_model(str(source)).module, 64, lambda *a: None), CompileOptions(quant="int8"))
    # per layer: c_attn's q, k and v columns, attn c_proj, c_fc and mlp c_proj; the tied head rides the embedding
    details = next(r for r in graph.records if r.name == "quantize_int8").details["quant"]["int8"]
    assert (details["linears"], details["kept_linears"], details["tied_heads"]) == (6, 0, 1)
    assert not [n for n in graph.nodes if n.op == "linear"]
