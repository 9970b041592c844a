"""The CPU qlinear kernel (torch's packed int8/int4 GEMMs on bf16 activations) against float64
math over the dequantised weight, at decode, odd and prefill batch sizes, several K and group
sizes, N that torch's int4 packing must pad, and K that the int8 GEMM must pad; GGUF's affine4
(the native GEMV where built, else torch's int4 GEMM) and affine8 (the native GEMV on the stored
codes, or dequantised: the reference exactly); the executor packs weights once at load through the
kernel's prepare hook."""

import pytest
import torch

from llmc.codegen.native import cpu_native
from llmc.codegen.plan import build_plan
from llmc.codegen.torch_cpu.cpu_kernels import prepare_qlinear, qlinear
from llmc.codegen.torch_cpu.cpu_qlinear import DenseWeights, Int4Weights, Int8Weights, pack_qlinear
from llmc.codegen.torch_cpu.cpu_qlinear_dense import DENSE_FROM_ENV
from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret
from llmc.compiler.ops import qlinear_ref
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.quant import dequantize_affine, dequantize_int4_codes, pack_int4, quantize_int4, quantize_int8
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass
from llmc.runtime.executor import PlanExecutor


def attrs_of(scheme, k, n, g=-1, bias=False, act=False):
    return {"scheme": scheme, "group_size": g, "in_features": k, "out_features": n,
            "has_zeros": scheme == "int4", "has_act_scale": act, "has_bias": bias}


def draw(seed, m, n, k):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) / k ** 0.5, torch.randn(m, k, generator=gen)


def assert_bf16_close(got, x, w_hat, bias=None):
    """got vs float64 x_bf16 · ŵᵀ: the GEMM sees bf16 activations and bf16 scales."""
    want = x.to(torch.bfloat16).double() @ w_hat.double().T
    if bias is not None:
        want = want + bias.double()
    assert got.dtype == x.dtype and got.shape == want.shape
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 1.5e-2 * scale


def run_kernel(inputs, attrs, prepared: bool):
    extra = prepare_qlinear([None] + list(inputs[1:]), attrs) if prepared else {}
    if prepared:
        assert "cpu_weights" in extra
    return qlinear(*inputs, **attrs, **extra)[0]


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("n, k", [(64, 64), (40, 96), (48, 512)])
def test_int8_kernel_matches_float64_dequantised_matmul(m, n, k):
    w, x = draw(m * k + n, m, n, k)
    q, scales = quantize_int8(w)
    got = run_kernel([x, q, scales], attrs_of("int8", k, n), prepared=True)
    assert_bf16_close(got, x, q.double() * scales.double()[:, None])


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("n, k, g", [(64, 64, 32), (40, 128, 64), (48, 256, 128), (7, 512, 128),
                                     (32, 512, 256)])
def test_int4_kernel_matches_float64_dequantised_matmul(m, n, k, g):
    w, x = draw(m * k + n + g, m, n, k)
    codes, scales, zeros = quantize_int4(w, g)
    got = run_kernel([x, pack_int4(codes), scales, zeros], attrs_of("int4", k, n, g), prepared=True)
    assert_bf16_close(got, x, dequantize_int4_codes(codes, scales, zeros, torch.float64))


def test_int8_kernel_pads_k_that_torch_would_miscompute():
    w, x = draw(3, 5, 24, 72)              # _weight_int8pack_mm is wrong for K = 72 unpadded
    q, scales = quantize_int8(w)
    packed = pack_qlinear("int8", q, scales, None, -1)
    assert isinstance(packed, Int8Weights) and packed.k_pad == 8 and packed.qweight.shape == (24, 80)
    assert_bf16_close(run_kernel([x, q, scales], attrs_of("int8", 72, 24), True), x,
                      q.double() * scales.double()[:, None])


def test_int4_packing_pads_n_to_sixteen_and_converts_zero_points():
    w, x = draw(4, 3, 7, 64)
    codes, scales, zeros = quantize_int4(w, 32)
    packed = pack_qlinear("int4", pack_int4(codes), scales, zeros, 32)
    assert isinstance(packed, Int4Weights) and packed.out_features == 7
    assert packed.scales_and_zeros.shape == (2, 16, 2) and packed.scales_and_zeros.dtype == torch.bfloat16
    # torch computes (q - 8)·s + zero_point; ours is (q - z)·s
    expected_zero_point = ((8 - zeros) * scales).to(torch.bfloat16)
    assert torch.equal(packed.scales_and_zeros[:, :7, 1], expected_zero_point.T)


def test_kernel_without_prepare_bias_and_leading_dims_agree_with_prepared():
    w, x = draw(5, 6, 32, 128)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(6))
    codes, scales, zeros = quantize_int4(w, 64)
    inputs = [x[None], pack_int4(codes), scales, zeros, bias]
    attrs = attrs_of("int4", 128, 32, 64, bias=True)
    cold, warm = run_kernel(inputs, attrs, prepared=False), run_kernel(inputs, attrs, prepared=True)
    assert cold.shape == (1, 6, 32) and torch.equal(cold, warm)
    assert_bf16_close(warm[0], x, dequantize_int4_codes(codes, scales, zeros, torch.float64), bias)


def test_int4_group_sizes_torch_cannot_pack_run_the_reference():
    w, x = draw(7, 4, 16, 64)
    codes, scales, zeros = quantize_int4(w, 16)       # torch's CPU GEMM takes 32..256
    inputs, attrs = [x, pack_int4(codes), scales, zeros], attrs_of("int4", 64, 16, 16)
    assert prepare_qlinear([None] + inputs[1:], attrs) == {}
    assert torch.equal(run_kernel(inputs, attrs, prepared=False), qlinear_ref(*inputs, **attrs)[0])


@pytest.fixture(scope="module")
def tiny_graph():
    return trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)


@pytest.mark.parametrize("pass_name, options", [("quantize_int8", {}), ("quantize_int4", {"group_size": 32})])
def test_executor_packs_once_at_load_and_matches_the_interpreter(tiny_graph, pass_name, options):
    graph = tiny_graph.copy()
    PassManager([get_pass(pass_name, **options)], PassContext(quiet=True)).run(graph)
    executor = PlanExecutor(build_plan(graph, "cpu", 64), graph.weights)
    launches = [launch for launch in executor._program if "cpu_weights" in launch.attrs]
    assert len(launches) == graph.op_counts()["qlinear"] == 14
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(8))
    inputs = {"input_ids": ids, "positions": torch.arange(9), "logits_indices": torch.arange(9)}
    got = executor.run_values(inputs)["logits"]
    want = interpret(graph, inputs)["logits"]
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999


# -- affine4 / affine8: GGUF block formats kept (w = q·s + m; affine4 without m: (q - 8)·s) ------
def draw_affine(seed, scheme, n, k, g, mins: bool):
    """Random codes, fp16 scales and minimums as GGUF's Q4_1 / Q8_0 blocks hold them."""
    gen = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if scheme == "affine4" else (-128, 128)
    codes = torch.randint(low, high, (n, k), generator=gen)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 / (k ** 0.5 * (2 if scheme == "affine4" else 16)))
    minimums = -8 * scales * (1 + 0.2 * torch.randn(n, k // g, generator=gen)) if mins else None
    qweight = pack_int4(codes) if scheme == "affine4" else codes.to(torch.int8)
    half = (lambda t: None if t is None else t.to(torch.float16))
    return qweight, half(scales), half(minimums)


def affine_attrs(scheme, k, n, g, mins: bool):
    return {**attrs_of(scheme, k, n, g), "has_zeros": mins}


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("n, k, mins", [(64, 64, True), (40, 256, False), (7, 512, True)])
def test_affine4_kernel_matches_float64_dequantised_matmul(m, n, k, mins):
    qweight, scales, minimums = draw_affine(m * k + n, "affine4", n, k, 32, mins)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
    inputs = [x, qweight, scales] + ([minimums] if mins else [])
    assert isinstance(pack_qlinear("affine4", qweight, scales, minimums, 32), Int4Weights)
    got = run_kernel(inputs, affine_attrs("affine4", k, n, 32, mins), prepared=True)
    assert_bf16_close(got, x, dequantize_affine("affine4", qweight, scales, minimums, torch.float64))


@pytest.mark.parametrize("m", [1, 9])
@pytest.mark.parametrize("n, k, g, mins", [(48, 64, 32, False), (24, 256, 16, False), (16, 128, 32, True)])
def test_affine8_kernel_is_the_native_gemv_or_the_reference(m, n, k, g, mins, monkeypatch):
    """Q8_0-like blocks (no minimums) run the native GEMV on the stored codes below the dense switch and the
    reference (dequantise, fp32 GEMM) from it; blocks with minimums are dequantised once, the reference."""
    qweight, scales, minimums = draw_affine(m + n + k, "affine8", n, k, g, mins)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * n))
    inputs, attrs = [x, qweight, scales] + ([minimums] if mins else []), affine_attrs("affine8", k, n, g, mins)
    assert isinstance(pack_qlinear("affine8", qweight, scales, minimums, g), DenseWeights)
    want = x.double() @ dequantize_affine("affine8", qweight, scales, minimums, torch.float64).T
    reference = qlinear_ref(*inputs, **attrs)[0]
    if mins or not cpu_native.gemv_runs():
        assert torch.equal(run_kernel(inputs, attrs, prepared=True), reference)
        return
    monkeypatch.setenv(DENSE_FROM_ENV, str(m + 1))
    prepared = run_kernel(inputs, attrs, prepared=True)
    assert prepared_codes(inputs, attrs).data_ptr() == qweight.data_ptr()   # read as stored
    int16 = cpu_native.int16_activations() and k % 64 == 0 and g == 32   # activations rounded to int16 codes
    assert ((prepared.double() - want).abs().max() / want.abs().max()) < (1e-4 if int16 else 1e-6)
    assert torch.equal(run_kernel(inputs, attrs, prepared=False), prepared)
    monkeypatch.setenv(DENSE_FROM_ENV, str(m))
    assert torch.equal(run_kernel(inputs, attrs, prepared=True), reference)


def prepared_codes(inputs, attrs) -> torch.Tensor:
    return prepare_qlinear([None] + list(inputs[1:]), attrs)["cpu_weights"].packed.weights.codes
