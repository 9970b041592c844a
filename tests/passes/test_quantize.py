"""The weight-only quantisation passes on tiny-llama: which linears they rewrite, the params
and bytes they leave (int8 <= 30%, int4 <= 17% of the fp32 linears), what they report, the
GPTQ/AWQ hooks, and that the quantised model still computes the float model's logits."""

import pytest
import torch
import torch.nn.functional as F

from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.quant import dequantize_int4, dequantize_int8
from llmc.errors import PassError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.quantize import WeightFormat, quantize_linear_weights
from llmc.passes.quantize_calibrated import fold_input_scale
from llmc.passes.registry import get_pass

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lowered():
    return trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)


@pytest.fixture
def graph(lowered):
    return lowered.copy()


def run(graph, name, calibration=None, **options):
    messages = []
    ctx = PassContext(calibration=calibration, echo=messages.append)
    record = PassManager([get_pass(name, **options)], ctx).run(graph)[0]
    return record, messages


def linear_weights(graph):
    return {n.inputs[1]: graph.params[n.inputs[1]].type for n in graph.nodes if n.op == "linear"}


def prompt_inputs(seed, tokens=12):
    ids = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "positions": torch.arange(tokens), "logits_indices": torch.arange(tokens)}


def logits_cosine(a, b, inputs):
    return F.cosine_similarity(interpret(a, inputs)["logits"], interpret(b, inputs)["logits"], dim=-1).min().item()


def test_int8_rewrites_every_linear_but_the_lm_head_into_per_channel_int8(lowered, graph):
    fp32 = linear_weights(graph)
    record, _ = run(graph, "quantize_int8")
    graph.verify()
    assert graph.op_counts()["qlinear"] == 14 and graph.op_counts()["linear"] == 1
    assert "lm_head.weight" in graph.params
    for name, t in fp32.items():
        if name == "lm_head.weight":
            continue
        assert name not in graph.params and name not in graph.weights
        q, s = graph.params[f"{name}.qweight"], graph.params[f"{name}.scales"]
        assert (q.type.dtype, q.type.shape, s.type.dtype, s.type.shape) == ("int8", t.shape, "float32", t.shape[:1])
        assert (q.quant.method, q.quant.bits, q.quant.group_size, q.quant.symmetric) == ("rtn", 8, -1, True)
        assert q.quant.scales == f"{name}.scales" and q.quant.zeros == ""
        w_hat = dequantize_int8(graph.weights[f"{name}.qweight"], graph.weights[f"{name}.scales"])
        step = graph.weights[f"{name}.scales"][:, None]
        assert bool(((w_hat - lowered.weights[name]).abs() <= step / 2 + 1e-7).all())
    assert record.matches == 14
    assert record.details["skipped"] == {next(iter(record.details["skipped"])): ["lm_head.weight"]}


def test_int4_stores_packed_nibbles_with_group_scales_and_zeros(lowered, graph):
    run(graph, "quantize_int4", group_size=64)
    graph.verify()
    assert graph.op_counts()["qlinear"] == 14
    name = "model.layers.1.mlp.down_proj.weight"          # [64, 128]
    q, s, z = (graph.params[f"{name}.{k}"] for k in ("qweight", "scales", "zeros"))
    assert (q.type.dtype, q.type.shape) == ("uint8", (64, 64))
    assert s.type == z.type and (s.type.dtype, s.type.shape) == ("float32", (64, 2))
    assert (q.quant.bits, q.quant.group_size, q.quant.symmetric, q.quant.zeros) == (4, 64, False, f"{name}.zeros")
    node = next(n for n in graph.nodes if n.op == "qlinear" and n.inputs[1] == f"{name}.qweight")
    assert node.attrs == {"scheme": "int4", "group_size": 64, "in_features": 128, "out_features": 64,
                          "has_zeros": True, "has_act_scale": False, "has_bias": False}
    w_hat = dequantize_int4(*(graph.weights[f"{name}.{k}"] for k in ("qweight", "scales", "zeros")))
    step = graph.weights[f"{name}.scales"].repeat_interleave(64, 1)
    assert bool(((w_hat - lowered.weights[name]).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("name, options, limit", [("quantize_int8", {}, 0.30),
                                                   ("quantize_int4", {"group_size": 64}, 0.17),
                                                   ("quantize_int4", {"group_size": 128,
                                                                      "shrink_groups": True}, 0.17)])
def test_quantised_linears_shrink_to_the_issue_budget(lowered, graph, name, options, limit):
    fp32 = {k: t for k, t in linear_weights(lowered).items() if k != "lm_head.weight"}
    fp32_bytes = sum(t.nbytes() for t in fp32.values())
    record, _ = run(graph, name, include_embedding=False, **options)  # the linears' own budget
    stored = sum(t.numel() * t.element_size() for k, t in graph.weights.items()
                 if k.rsplit(".", 1)[0] in fp32)
    figures = next(iter(record.details["quant"].values()))
    assert figures["bytes_before"] == fp32_bytes and figures["bytes_after"] == stored
    assert stored / fp32_bytes <= limit
    whole_before = sum(p.type.nbytes() for p in lowered.params.values())
    whole_after = sum(t.numel() * t.element_size() for t in graph.weights.values())
    assert record.bytes_saved == whole_before - whole_after > 0
    # the float embedding and lm_head are most of tiny-llama: the whole model shrinks far less
    assert 0.5 < whole_after / whole_before < 0.75


def test_a_group_size_that_does_not_divide_k_keeps_that_linear_and_says_so(graph):
    record, messages = run(graph, "quantize_int4", group_size=128, shrink_groups=False)
    graph.verify()
    assert graph.op_counts()["qlinear"] == 2          # only down_proj has K = 128
    kept = record.details["skipped"]["in_features 64 is not a multiple of group_size 128"]
    assert len(kept) == 12 and all("down_proj" not in k for k in kept)
    assert record.details["quant"]["int4"]["kept_linears"] == 13
    assert any("12 linear(s) kept in float" in m and "shrink_groups" in m for m in messages)


def test_shrink_groups_takes_the_largest_group_that_divides_k(graph):
    record, _ = run(graph, "quantize_int4", group_size=128)  # shrink_groups is on by default
    assert graph.op_counts()["qlinear"] == 14
    assert record.details["quant"]["int4"]["linears_by_group_size"] == {"64": 12, "128": 2}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert graph.params[f"{name}.qweight"].quant.group_size == 64
    assert graph.params[f"{name}.scales"].type.shape == (64, 1)


def test_lm_head_and_skip_patterns(graph):
    record, _ = run(graph, "quantize_int8", include_lm_head=True, skip="*.mlp.down_proj.weight")
    assert graph.op_counts()["qlinear"] == 13
    assert "lm_head.weight.qweight" in graph.params
    assert record.details["skipped"] == {"matches a skip pattern": [
        "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]}


@pytest.mark.parametrize("options, message", [({"group_size": 48}, "group_size=48"),
                                              ({"method": "hqq"}, "method='hqq'")])
def test_bad_int4_options_are_pass_errors(graph, options, message):
    with pytest.raises(PassError, match=message):
        run(graph, "quantize_int4", **options)


def test_quantised_logits_stay_close_to_fp32(lowered, graph):
    int4 = lowered.copy()
    run(graph, "quantize_int8")
    run(int4, "quantize_int4", group_size=32)
    inputs = prompt_inputs(1)
    assert logits_cosine(lowered, graph, inputs) > 0.999
    assert logits_cosine(lowered, int4, inputs) > 0.97


def test_quantize_linear_weights_stores_what_a_method_function_computed(graph):
    node = next(n for n in graph.nodes if n.op == "linear")
    weight = node.inputs[1]
    n, k = graph.params[weight].type.shape
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    scales, zeros = torch.full((n, k // 32), 0.01), torch.full((n, k // 32), 8.0)
    seen = []

    def method(w, ctx, nd):
        seen.append((w.dtype, tuple(w.shape), nd.name))
        return codes, scales, zeros
    before, after = quantize_linear_weights(graph, node, method, PassContext(),
                                            WeightFormat("int4", "gptq", 4, 32, symmetric=False))
    graph.prune_params()
    graph.verify()
    assert seen == [(torch.float32, (n, k), node.name)]
    assert (before, after) == (n * k * 4, n * k // 2 + 2 * n * (k // 32) * 4)
    assert node.op == "qlinear" and graph.params[f"{weight}.qweight"].quant.method == "gptq"
    assert torch.equal(dequantize_int4(graph.weights[f"{weight}.qweight"], scales, zeros),
                       (codes.float() - 8) * 0.01)


def calibration(count=16, tokens=64, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (tokens,), generator=gen) for _ in range(count)]


def held_out_kl(reference, graph):
    total = 0.0
    for seq in calibration(count=3, tokens=24, seed=9):
        inputs = {"input_ids": seq, "positions": torch.arange(24), "logits_indices": torch.arange(24)}
        p = interpret(reference, inputs)["logits"].log_softmax(-1)
        q = interpret(graph, inputs)["logits"].log_softmax(-1)
        total += F.kl_div(q, p, log_target=True, reduction="batchmean").item()
    return total


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_beat_rtn_on_held_out_text(lowered, method):
    rtn, calibrated = lowered.copy(), lowered.copy()
    run(rtn, "quantize_int4", group_size=32)
    record, _ = run(calibrated, "quantize_int4", calibration(), group_size=32, method=method)
    calibrated.verify()
    assert record.matches == 14 and record.details["quant"]["int4"]["method"] == method
    assert held_out_kl(lowered, calibrated) < held_out_kl(lowered, rtn)


def test_calibrated_methods_need_calibration(graph):
    with pytest.raises(PassError, match="needs calibration"):
        run(graph, "quantize_int4", group_size=32, method="gptq")


def test_awq_scale_folding_leaves_the_float_model_unchanged(lowered, graph):
    """rms_norm (q/k/v), up_proj rows (down_proj) or an inserted mul (o_proj) absorb 1/s."""
    gen = torch.Generator().manual_seed(4)
    how = []
    for x in sorted({n.inputs[0] for n in graph.nodes if n.op == "linear" and n.inputs[1] != "lm_head.weight"}):
        group = [n for n in graph.nodes if n.op == "linear" and n.inputs[0] == x]
        s = 0.5 + torch.rand(graph.type_of(x).shape[-1], generator=gen)
        for n in group:
            graph.weights[n.inputs[1]] = graph.weights[n.inputs[1]] * s      # W·s ...
        how.append(fold_input_scale(graph, x, group, s))                      # ... reading x / s
    graph.verify()
    assert sorted(set(how)) == ["linear", "mul", "rms_norm"] and how.count("mul") == 2
    inputs = prompt_inputs(5)
    torch.testing.assert_close(interpret(graph, inputs)["logits"], interpret(lowered, inputs)["logits"],
                               rtol=1e-4, atol=1e-4)
