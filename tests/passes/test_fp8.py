"""quantize_fp8 on tiny-llama and the CPU fp8 kernel: e4m3 weights within e4m3's precision of the
float64 weights, static activation scales equal to max |x| / 448 over the calibration inputs,
the kernel computing the qlinear reference, and a compiled artifact that generates and stays
close to fp32 with its accuracy recorded in the manifest."""

import json

import pytest
import torch
import torch.nn.functional as F

import llmc
from llmc.codegen.torch_cpu.cpu_kernels import prepare_qlinear, qlinear
from llmc.codegen.torch_cpu.cpu_qlinear_a8 import Fp8Weights
from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret
from llmc.compiler.ops import qlinear_ref
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.quant import dequantize_fp8, quantize_fp8
from llmc.errors import PassError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass
from llmc.runtime.sampling_params import SamplingParams
from llmc.tools.evaluate import ArtifactScorer

E4M3_EPS = 2.0 ** -3        # spacing of e4m3 codes in [1, 2): 3 mantissa bits
E4M3_MIN_NORMAL = 2.0 ** -6


@pytest.fixture(scope="module")
def lowered():
    return trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)


@pytest.fixture(scope="module")
def calibration():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 512, (24,), generator=gen) for _ in range(3)]


def run_fp8(graph, calibration, **options):
    ctx = PassContext(calibration=calibration, quiet=True)
    return PassManager([get_pass("quantize_fp8", **options)], ctx).run(graph)[0]


def linear_inputs_abs_max(graph, calibration):
    """{weight: max |x| over its linear's inputs}, observed with the interpreter's hook."""
    seen = {}

    def hook(node, args, outs):
        if node.op == "linear":
            seen[node.inputs[1]] = max(seen.get(node.inputs[1], 0.0), args[0].abs().max().item())
    for ids in calibration:
        n = len(ids)
        interpret(graph, {"input_ids": ids, "positions": torch.arange(n),
                          "logits_indices": torch.tensor([n - 1])}, hook=hook)
    return seen


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_weights_round_trip_within_e4m3_precision_of_float64(lowered, calibration, per_channel):
    graph = lowered.copy()
    record = run_fp8(graph, calibration, per_channel=per_channel)
    graph.verify()
    assert graph.op_counts()["qlinear"] == 14 and record.matches == 14
    for name, w in lowered.weights.items():
        if f"{name}.qweight" not in graph.params:
            continue
        q, s = graph.weights[f"{name}.qweight"], graph.weights[f"{name}.scales"]
        assert q.dtype == torch.float8_e4m3fn and s.shape == ((w.shape[0],) if per_channel else (1,))
        assert graph.params[f"{name}.qweight"].quant.method == "fp8"
        w64 = w.double()
        err = (dequantize_fp8(q, s, torch.float64) - w64).abs()
        step = s.double().reshape(-1, 1)
        # half a code spacing: relative for normal codes, absolute in e4m3's subnormal range
        bound = torch.maximum(w64.abs() * E4M3_EPS / 2, step * E4M3_MIN_NORMAL * E4M3_EPS / 2)
        assert bool((err <= bound * (1 + 1e-6)).all()), name
        assert dequantize_fp8(q, s).abs().amax().item() == pytest.approx(w.abs().amax().item(), rel=1e-6)


def test_activation_scales_are_calibration_max_over_448(lowered, calibration):
    graph = lowered.copy()
    run_fp8(graph, calibration)
    want = linear_inputs_abs_max(lowered, calibration)
    checked = 0
    for name, amax in want.items():
        if name == "lm_head.weight":
            assert "lm_head.weight.act_scale" not in graph.params
            continue
        act = graph.weights[f"{name}.act_scale"]
        assert act.dtype == torch.float32 and act.shape == (1,)
        assert act.item() == pytest.approx(amax / 448, rel=1e-6)
        checked += 1
    assert checked == 14
    node = next(n for n in graph.nodes if n.op == "qlinear")
    assert node.attrs["has_act_scale"] and node.inputs[3].endswith(".act_scale")


def test_lm_head_is_kept_by_default_and_quantised_on_request(lowered, calibration):
    graph = lowered.copy()
    run_fp8(graph, calibration, include_lm_head=True)
    assert "lm_head.weight.qweight" in graph.params and graph.op_counts().get("linear", 0) == 0


def test_fp8_without_calibration_asks_for_it(lowered):
    with pytest.raises(PassError, match="quantize_fp8.*compile with calibration"):
        run_fp8(lowered.copy(), None)


def fp8_case(seed, m, n, k, per_channel=True):
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=gen) / k ** 0.5, torch.randn(m, k, generator=gen)
    q, s = quantize_fp8(w, per_channel)
    act = torch.tensor([0.8 * x.abs().max().item() / 448])     # the largest inputs saturate
    attrs = {"scheme": "fp8", "group_size": -1, "in_features": k, "out_features": n,
             "has_zeros": False, "has_act_scale": True, "has_bias": False}
    return [x, q, s, act], attrs


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_kernel_matches_the_qlinear_reference(m, per_channel):
    inputs, attrs = fp8_case(m, m, 48, 96, per_channel)
    prepared = prepare_qlinear([None] + inputs[1:], attrs)
    packed = prepared["cpu_weights"].packed   # the low-bit kernel; from dense_from rows a dense GEMM runs
    assert isinstance(packed, Fp8Weights)
    got = qlinear(*inputs, **attrs, cpu_weights=packed)[0]
    want = qlinear_ref(*inputs, **attrs)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    # codes are exact in bf16; only the bf16 GEMM's output rounding differs
    assert (got - want).abs().max().item() <= 2 ** -8 * want.abs().max().item()
    unprepared = qlinear(*inputs, **attrs)[0]
    assert torch.equal(unprepared, got)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "fp8.llmc"
    return llmc.compile("tiny-llama", output=out, quant="fp8", calib_samples=2, calib_seq_len=24,
                        max_num_batched_tokens=64)


def test_compiled_fp8_generates_and_stays_close_to_fp32(lowered, artifact):
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(5))
    rows = torch.arange(20)
    want = interpret(lowered, {"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"]
    got = ArtifactScorer(artifact).logits(ids, rows)
    assert F.cosine_similarity(got, want, dim=-1).min().item() > 0.98
    out = llmc.load(artifact).generate({"prompt_token_ids": ids.tolist()}, SamplingParams(max_tokens=6, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 6


def test_fp8_manifest_records_the_pass_and_its_accuracy(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    entry = next(p for p in manifest["pipeline"] if p["name"] == "quantize_fp8")
    assert entry["options"]["per_channel"] is True and entry["details"]["quant"]["fp8"]["linears"] == 14
    acc = entry["accuracy"]
    assert {"ppl_before", "ppl_after", "kl", "top1_agreement", "tokens"} <= set(acc)
    assert acc["calibration"] == {"source": "self-generated:0", "samples": 2, "seq_len": 24}
    assert manifest["report"]["weight_bytes"]["float8_e4m3fn"] > 0


def test_fp8_kernel_without_act_scale_matches_the_weight_only_reference():
    (x, q, s, _), attrs = fp8_case(3, 5, 32, 64)
    attrs = {**attrs, "has_act_scale": False}
    got = qlinear(x, q, s, **attrs)[0]
    want = qlinear_ref(x, q, s, **attrs)[0]
    # x is rounded to bf16 for the GEMM (8 significant bits)
    assert (got - want).abs().max().item() <= 2 ** -6 * want.abs().max().item()
