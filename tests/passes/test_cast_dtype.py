"""cast_bf16 on tiny-llama: the bf16 graph computes the fp32 graph's logits within bf16 rounding,
every activation but the logits is 16-bit, and what must stay fp32 does (quant scales, rotary
inv_freq, aten fallbacks, the logits)."""

import pytest
import torch
import torch.nn.functional as F

from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.ops import TORCH_DTYPES
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.targets import get_target
from llmc.errors import PassError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass

HALF = {"bfloat16", "float16"}


@pytest.fixture(scope="module")
def lowered():
    return trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)


@pytest.fixture
def graph(lowered):
    return lowered.copy()


def cast(graph, target=None, **options):
    return PassManager([get_pass("cast_bf16", **options)], PassContext(target=target, quiet=True)).run(graph)[0]


def prompt(seed, tokens):
    ids = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "positions": torch.arange(tokens), "logits_indices": torch.arange(tokens)}


def activations(graph):
    return {v.name: v.type for n in graph.nodes for v in n.outputs}


@pytest.mark.parametrize("tokens, seed", [(1, 0), (7, 1), (13, 2)])
def test_bf16_logits_match_the_fp32_graph_within_bf16_rounding(lowered, graph, tokens, seed):
    cast(graph, dtype="bfloat16")
    inputs = prompt(seed, tokens)
    want, got = interpret(lowered, inputs)["logits"], interpret(graph, inputs)["logits"]
    assert got.dtype == torch.float32 and got.shape == want.shape
    # bf16 keeps 8 significant bits: a few ulps (2^-8 relative) over two layers
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.999
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_every_activation_is_bf16_but_the_fp32_logits(graph):
    record = cast(graph, target=get_target("h100-bf16"))
    graph.verify()
    types = activations(graph)
    assert types["logits"].dtype == "float32"
    assert {t.dtype for name, t in types.items() if name != "logits"} == {"bfloat16"}
    assert record.details["dtype"] == "bfloat16" and record.details["casts_inserted"] == 1
    [restore] = [n for n in graph.nodes if n.out.name == "logits"]
    assert restore.op == "cast" and restore.attrs == {"dtype": "float32"}


def test_weights_become_bf16_except_inv_freq(graph):
    before = {name: p.type.nbytes() for name, p in graph.params.items()}
    record = cast(graph)
    for name, p in graph.params.items():
        assert graph.weights[name].dtype == TORCH_DTYPES[p.type.dtype]
    kept = {name for name, p in graph.params.items() if p.type.dtype == "float32"}
    assert kept == {"model.rotary_emb.inv_freq"}
    # norm weights are cast too: rms_norm multiplies them in the activation dtype, as HF bf16 models do
    assert graph.params["model.norm.weight"].type.dtype == "bfloat16"
    assert record.bytes_saved == sum(b for name, b in before.items() if name not in kept) // 2
    assert record.details["params_kept_fp32"] == 1


def test_tied_weights_share_one_bf16_tensor(graph):
    graph.weights["lm_head.weight"] = graph.weights["model.embed_tokens.weight"]
    cast(graph)
    assert graph.weights["lm_head.weight"] is graph.weights["model.embed_tokens.weight"]
    assert graph.weights["lm_head.weight"].dtype == torch.bfloat16


def test_float16_option_and_a_bad_dtype_is_a_pass_error(graph):
    cast(graph, dtype="float16")
    assert {t.dtype for name, t in activations(graph).items() if name != "logits"} == {"float16"}
    with pytest.raises(PassError, match="cast_bf16.*dtype='float8'.*bfloat16, float16"):
        cast(graph.copy(), dtype="float8")


def test_a_second_run_changes_nothing(graph):
    cast(graph)
    text = graph.to_json()
    record = cast(graph)
    assert record.matches == 0 and not record.changed and graph.to_json() == text


def test_int8_quant_scales_stay_fp32_and_the_quantised_model_keeps_its_logits(graph):
    PassManager([get_pass("quantize_int8")], PassContext(quiet=True)).run(graph)
    fp32 = graph.copy()
    cast(graph)
    qlinears = [n for n in graph.nodes if n.op == "qlinear"]
    types = graph.types()
    assert qlinears
    for node in qlinears:
        x, qweight, scales = (types[i] for i in node.inputs[:3])
        assert (x.dtype, qweight.dtype, scales.dtype) == ("bfloat16", "int8", "float32")
    inputs = prompt(3, 9)
    want, got = interpret(fp32, inputs)["logits"], interpret(graph, inputs)["logits"]
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def fallback_graph() -> Graph:
    """ids -> embedding -> aten tanh (a fallback) -> linear -> logits, fp32."""
    g = Graph("fallback")
    g.add_input("input_ids", TensorType(("tokens",), "int64"))
    torch.manual_seed(0)
    g.add_param("emb", TensorType((32, 16), "float32"), torch.randn(32, 16))
    g.add_param("w", TensorType((8, 16), "float32"), torch.randn(8, 16))
    x = g.make_node("embedding", ["input_ids", "emb"], [TensorType(("tokens", 16), "float32")], name="x")
    t = g.make_node("aten", ["x"], [TensorType(("tokens", 16), "float32")],
                    {"target": "aten.tanh.default", "args": [{"$in": 0}], "kwargs": {}}, name="t")
    y = g.make_node("linear", ["t", "w"], [TensorType(("tokens", 8), "float32")], name="logits")
    g.nodes = [x, t, y]
    g.outputs = ["logits"]
    g.verify()
    return g


def test_aten_fallbacks_keep_fp32_between_casts():
    g = fallback_graph()
    fp32 = g.copy()
    record = cast(g)
    producers, types = g.producers(), g.types()
    aten = next(n for n in g.nodes if n.op == "aten")
    feeder = producers[aten.inputs[0]]
    assert feeder.op == "cast" and feeder.attrs["dtype"] == "float32" and types[feeder.inputs[0]].dtype == "bfloat16"
    assert aten.out.type.dtype == "float32"
    linear = next(n for n in g.nodes if n.op == "linear")
    assert producers[linear.inputs[0]].op == "cast" and types[linear.inputs[0]].dtype == "bfloat16"
    assert record.details["casts_inserted"] == 3  # into the fallback, out of it, and the logits back to fp32
    ids = torch.randint(0, 32, (10,), generator=torch.Generator().manual_seed(4))
    want, got = interpret(fp32, {"input_ids": ids})["logits"], interpret(g, {"input_ids": ids})["logits"]
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())
