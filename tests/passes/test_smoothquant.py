"""SmoothQuant and w8a8 on tiny-llama and the CPU w8a8 kernel: the smoothing factors follow the
paper's formula, folding them leaves the fp32 model's logits unchanged and balances activation
and weight ranges, smoothing cuts w8a8 error on outlier channels, quantize_w8a8 rewrites the
smoothed linears, the kernel computes the qlinear reference, and a compiled artifact generates
close to fp32 with its accuracy recorded in the manifest."""

import json

import pytest
import torch
import torch.nn.functional as F

import llmc
from llmc.codegen.torch_cpu import cpu_qlinear_a8
from llmc.codegen.torch_cpu.cpu_kernels import prepare_qlinear, qlinear
from llmc.codegen.torch_cpu.cpu_qlinear_a8 import W8A8Weights
from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret
from llmc.compiler.ops import qlinear_ref
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.quant import dequantize_int8, fake_quant_int8_per_token, quantize_int8
from llmc.errors import PassError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass
from llmc.passes.smoothquant import smoothing_factors
from llmc.runtime.sampling_params import SamplingParams
from llmc.tools.evaluate import ArtifactScorer

SMOOTHED = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]


@pytest.fixture(scope="module")
def lowered():
    return trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)


@pytest.fixture(scope="module")
def calibration():
    gen = torch.Generator().manual_seed(23)
    return [torch.randint(0, 512, (24,), generator=gen) for _ in range(3)]


def run(graph, calibration, *specs):
    passes = [get_pass(name, **options) for name, options in specs]
    return PassManager(passes, PassContext(calibration=calibration, quiet=True)).run(graph)


def all_rows(ids):
    n = len(ids)
    return {"input_ids": ids, "positions": torch.arange(n), "logits_indices": torch.arange(n)}


def linear_inputs(graph, calibration):
    """{weight: every calibration input row of its linear [tokens, K]}."""
    seen = {}

    def hook(node, args, outs):
        if node.op == "linear":
            seen.setdefault(node.inputs[1], []).append(args[0].reshape(-1, args[0].shape[-1]))
    for ids in calibration:
        interpret(graph, all_rows(ids), hook=hook)
    return {w: torch.cat(xs) for w, xs in seen.items()}


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_smoothing_factors_follow_the_paper_formula(alpha):
    gen = torch.Generator().manual_seed(int(alpha * 10))
    x_max = torch.rand(32, generator=gen) * 20 + 0.1
    ws = [torch.randn(16, 32, generator=gen), torch.randn(8, 32, generator=gen)]
    w_max = torch.cat(ws).double().abs().amax(0)
    want = x_max.double() ** alpha / w_max ** (1 - alpha)
    torch.testing.assert_close(smoothing_factors(x_max, ws, alpha).double(), want, rtol=1e-6, atol=0)


def test_channels_never_active_keep_a_factor_of_one():
    x_max = torch.tensor([0.0, 2.0, 3.0])
    w = torch.tensor([[1.0, 0.0, 0.5]])
    assert smoothing_factors(x_max, [w], 0.5).tolist() == [1.0, 1.0, pytest.approx((3.0 / 0.5) ** 0.5)]


def test_smoothing_leaves_the_fp32_function_unchanged(lowered, calibration):
    graph = lowered.copy()
    record = run(graph, calibration, ("smoothquant", {}))[0]
    assert record.matches == 4 and record.details["linears"] == 10      # 2 layers x (qkv, gate/up)
    changed = [n for n, w in lowered.weights.items() if not torch.equal(graph.weights[n], w)]
    assert sorted(changed) == sorted([f"model.layers.{i}.{part}" for i in range(2) for part in
                                      ["input_layernorm.weight", "post_attention_layernorm.weight",
                                       "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                       "self_attn.v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"]])
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(3))
    want, got = interpret(lowered, all_rows(ids))["logits"], interpret(graph, all_rows(ids))["logits"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_q_k_v_share_one_factor_and_norm_weight_carries_its_inverse(lowered, calibration):
    graph = lowered.copy()
    run(graph, calibration, ("smoothquant", {}))
    name = "model.layers.0.self_attn.{}_proj.weight"
    factors = [graph.weights[name.format(p)][0] / lowered.weights[name.format(p)][0] for p in "qkv"]
    torch.testing.assert_close(factors[1], factors[0]) and torch.testing.assert_close(factors[2], factors[0])
    norm = "model.layers.0.input_layernorm.weight"
    torch.testing.assert_close(graph.weights[norm] * factors[0], lowered.weights[norm], rtol=1e-5, atol=1e-6)


def test_alpha_half_balances_activation_and_weight_ranges(lowered, calibration):
    """With alpha = 0.5, max|X_j / s_j| == max|W_j s_j|: the paper's migration of difficulty."""
    graph = lowered.copy()
    run(graph, calibration, ("smoothquant", {"alpha": 0.5}))
    inputs = linear_inputs(graph, calibration)
    for layer in range(2):
        names = [f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qkv"]
        x_max = inputs[names[0]].abs().amax(0)
        w_max = torch.cat([graph.weights[n] for n in names]).abs().amax(0)
        torch.testing.assert_close(x_max, w_max, rtol=1e-4, atol=1e-7)


def test_smoothing_cuts_w8a8_error_on_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    k, n = 256, 64
    x = torch.randn(128, k, generator=gen)
    x[:, :4] *= 60                                    # a few outlier channels, as in LLM activations
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    want = x.double() @ w.double().T

    def w8a8_error(s):
        q, scales = quantize_int8(w * s)
        got = fake_quant_int8_per_token(x / s) @ dequantize_int8(q, scales).T
        return (got.double() - want).norm() / want.norm()
    plain = w8a8_error(torch.ones(k))
    smoothed = w8a8_error(smoothing_factors(x.abs().amax(0), [w], 0.5))
    assert smoothed < 0.5 * plain


def test_w8a8_quantises_the_smoothed_linears(lowered, calibration):
    graph = lowered.copy()
    records = run(graph, calibration, ("smoothquant", {}), ("quantize_w8a8", {}))
    graph.verify()
    quantised = {n.inputs[1].removesuffix(".qweight") for n in graph.nodes if n.op == "qlinear"}
    assert len(quantised) == 10 and all(any(p in w for p in SMOOTHED) for w in quantised)
    for w in quantised:
        q = graph.params[f"{w}.qweight"]
        assert (q.type.dtype, q.quant.method, q.quant.bits) == ("int8", "smoothquant", 8)
        assert graph.params[f"{w}.scales"].type.shape == q.type.shape[:1]
    node = next(n for n in graph.nodes if n.op == "qlinear")
    assert node.attrs["scheme"] == "w8a8" and not node.attrs["has_act_scale"]
    assert records[1].details["quant"]["w8a8"]["linears"] == 10


def test_w8a8_all_linears_and_its_refusal_without_smoothing(lowered, calibration):
    graph = lowered.copy()
    run(graph, calibration, ("quantize_w8a8", {"all_linears": True}))
    assert graph.op_counts()["qlinear"] == 14
    with pytest.raises(PassError, match="no linear smoothed by smoothquant.*all_linears=true"):
        run(lowered.copy(), calibration, ("quantize_w8a8", {}))


def test_smoothquant_option_and_calibration_errors(lowered, calibration):
    with pytest.raises(PassError, match="alpha=1.5 is outside"):
        run(lowered.copy(), calibration, ("smoothquant", {"alpha": 1.5}))
    with pytest.raises(PassError, match="smoothquant.*compile with calibration"):
        run(lowered.copy(), None, ("smoothquant", {}))


def w8a8_case(seed, m, n, k):
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=gen) / k ** 0.5, torch.randn(m, k, generator=gen)
    x[:, 0] *= 30
    bias = torch.randn(n, generator=gen)
    q, s = quantize_int8(w)
    attrs = {"scheme": "w8a8", "group_size": -1, "in_features": k, "out_features": n,
             "has_zeros": False, "has_act_scale": False, "has_bias": True}
    return [x, q, s, bias], attrs


@pytest.mark.parametrize("m, n, k", [(1, 48, 96), (7, 40, 72), (64, 64, 100)])
def test_w8a8_kernel_matches_the_qlinear_reference(m, n, k):
    inputs, attrs = w8a8_case(m + n + k, m, n, k)
    prepared = prepare_qlinear([None] + inputs[1:], attrs)
    packed = prepared["cpu_weights"].packed   # the low-bit kernel; from dense_from rows a dense GEMM runs
    assert isinstance(packed, W8A8Weights)
    got = qlinear(*inputs, **attrs, cpu_weights=packed)[0]
    want = qlinear_ref(*inputs, **attrs)[0]
    # int32 accumulation is exact; only fp32 rounding of the scales differs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_w8a8_kernel_without_int_mm_takes_the_bf16_gemm(monkeypatch):
    inputs, attrs = w8a8_case(9, 5, 32, 64)
    want = qlinear_ref(*inputs, **attrs)[0]
    monkeypatch.setattr(cpu_qlinear_a8, "INT_MM", None)
    got = qlinear(*inputs, **attrs)[0]
    assert (got - want).abs().max().item() <= 2 ** -8 * want.abs().max().item()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("w8a8") / "w8a8.llmc"
    return llmc.compile("tiny-llama", output=out, quant="w8a8", calib_samples=2, calib_seq_len=24,
                        max_num_batched_tokens=64)


def test_compiled_w8a8_generates_and_stays_close_to_fp32(lowered, artifact):
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(6))
    rows = torch.arange(20)
    want = interpret(lowered, all_rows(ids))["logits"]
    got = ArtifactScorer(artifact).logits(ids, rows)
    assert F.cosine_similarity(got, want, dim=-1).min().item() > 0.98
    out = llmc.load(artifact).generate({"prompt_token_ids": ids.tolist()}, SamplingParams(max_tokens=6, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 6


def test_w8a8_manifest_records_both_passes_and_their_accuracy(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    entries = {p["name"]: p for p in manifest["pipeline"]}
    assert entries["smoothquant"]["options"]["alpha"] == 0.5
    # --quant w8a8 quantises every linear; smoothquant smoothed the 10 its rms_norms feed
    assert entries["smoothquant"]["details"]["linears"] == 10
    assert entries["quantize_w8a8"]["details"]["quant"]["w8a8"]["linears"] == 14
    for name in ("smoothquant", "quantize_w8a8"):
        acc = entries[name]["accuracy"]
        assert {"ppl_before", "ppl_after", "kl", "top1_agreement", "tokens"} <= set(acc)
        assert acc["calibration"]["source"] == "self-generated:0"
    # smoothing alone is exact in fp32
    assert entries["smoothquant"]["accuracy"]["kl"] < 1e-6
