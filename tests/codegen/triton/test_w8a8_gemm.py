"""The w8a8 Triton GEMM and its per-token int8 activation quantiser, run in Triton's interpreter:
bit for bit the CPU kernel (codegen/torch_cpu/cpu_qlinear_a8.py), close to qlinear_ref on weights the
smoothquant + quantize_w8a8 passes produce for tiny-llama, and to float64 math from the codes."""

import os

import pytest
import torch

from llmc.codegen.torch_cpu import cpu_qlinear_a8
from llmc.codegen.triton.triton_configs import TILE_CONFIGS, TileConfig
from llmc.codegen.triton.triton_gemm import (
    ACTIVATION_DTYPES,
    _check_act_scale,
    _quantize_rows,
    render_int8_gemm,
    render_quantize_int8,
    render_w8a8_gemm,
    w8a8_gemm,
)
from llmc.codegen.triton.triton_render import kernel_cache_dir
from llmc.compiler.frontends import load_model
from llmc.compiler.ops import qlinear_ref
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.quant import quantize_int8
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/codegen/triton/conftest.py sets the interpreter"
pytestmark = pytest.mark.triton

SMALL = TileConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)  # many programs, ragged tiles
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def quantize_int8_rows(x: torch.Tensor, act_scale: torch.Tensor | None = None, *,
                       target: str = "h100") -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantiser kernel w8a8_gemm launches, on its own: x [..., K] -> (int8 codes
    [M, K], fp32 scales [M]), per token (max|row| / 127) or with the fp32 [1] `act_scale`."""
    _check_act_scale(act_scale)
    kernel = render_quantize_int8(target, ACTIVATION_DTYPES[x.dtype], x.shape[-1], act_scale is not None)
    return _quantize_rows(kernel, x, act_scale)


def activations(m, k, dtype=torch.float32, seed=0):
    """Random rows with an outlier channel, as activations into a linear have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, k // 3] *= 30
    return x.to(dtype)


def weights(n, k, seed=1):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    return quantize_int8(w)


def float64_w8a8(codes, x_scales, qweight, w_scales, bias=None):
    """The GEMM in float64 from the activation codes and scales it was given."""
    y = (codes.double() * x_scales.double()[:, None]) @ (qweight.double() * w_scales.double()[:, None]).T
    return y if bias is None else y + bias.double()


# -- the activation quantiser --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(7, 100), (1, 576), (4, 64)])
def test_quantiser_is_bitwise_the_cpu_per_token_quantiser(m, k, dtype):
    x = activations(m, k, dtype, seed=k)
    x[-1] = 0                                              # an all-zero row keeps scale 1
    codes, scales = quantize_int8_rows(x)
    want_codes, want_scales = cpu_qlinear_a8.quantize_per_token(x.float())
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales.reshape(-1))
    assert scales[-1] == 1 and not codes[-1].any()


def test_quantiser_rounds_ties_to_even():
    # max |row| = 127 makes the scale exactly 1, so each x / scale is the value itself
    x = torch.tensor([[0.5, 1.5, 2.5, -2.5, -3.5, 126.5, 3.49, -127.0]])
    codes, scales = quantize_int8_rows(x)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [[0, 2, 2, -2, -4, 126, 3, -127]]


def test_static_act_scale_quantises_every_row_with_it_and_saturates():
    x, a = activations(5, 96, seed=3), torch.tensor([0.05])
    codes, scales = quantize_int8_rows(x, a)
    assert torch.equal(scales, torch.full((5,), 0.05))
    assert torch.equal(codes, torch.round(x / a).clamp(-127, 127).to(torch.int8))
    assert (codes.abs() == 127).any()                      # x / a reaches past 127 on the outlier channel
    qweight, w_scales = weights(40, 96)
    y = w8a8_gemm(x, qweight, w_scales, act_scale=a, config=SMALL)
    ref = float64_w8a8(codes, scales, qweight, w_scales)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


# -- the GEMM ------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,config", [
    (7, 48, 100, SMALL),                       # ragged M, N and K tiles
    (1, 40, 72, TILE_CONFIGS["orin"]),         # decode: one token
    (20, 64, 576, TILE_CONFIGS["h100"]),       # K spans several 64-wide tiles
    (16, 16, 64, TILE_CONFIGS["a100"]),
])
def test_gemm_is_bitwise_the_cpu_int_mm_kernel(m, n, k, config):
    x, (qweight, w_scales) = activations(m, k, seed=m + k), weights(n, k, seed=n)
    y = w8a8_gemm(x, qweight, w_scales, config=config)
    want = cpu_qlinear_a8.run_a8_qlinear(x, cpu_qlinear_a8.pack_w8a8(qweight, w_scales))
    assert y.dtype == torch.float32 and torch.equal(y, want)   # exact int32 sums, the same two fp32 products


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_with_bias_matches_float64_from_the_codes(dtype):
    x, (qweight, w_scales) = activations(9, 160, dtype, seed=5), weights(56, 160, seed=6)
    bias = torch.randn(56, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = w8a8_gemm(x, qweight, w_scales, bias, config=SMALL)
    assert y.dtype == dtype and y.shape == (9, 56)
    ref = float64_w8a8(*quantize_int8_rows(x), qweight, w_scales, bias)
    # fp32 epilogue, then one rounding to the output dtype (the interpreter truncates to bf16)
    rtol = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=1e-6 * float(ref.abs().max()))


@pytest.fixture(scope="module")
def smoothquant_linears():
    """{weight: (qweight, scales)} of the linears smoothquant + quantize_w8a8 quantise in tiny-llama."""
    graph = trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)
    gen = torch.Generator().manual_seed(23)
    calibration = [torch.randint(0, 512, (24,), generator=gen) for _ in range(3)]
    PassManager([get_pass("smoothquant"), get_pass("quantize_w8a8")],
                PassContext(calibration=calibration, quiet=True)).run(graph)
    nodes = [n for n in graph.nodes if n.op == "qlinear" and n.attrs["scheme"] == "w8a8"]
    assert nodes, "quantize_w8a8 rewrote no linear"
    return {n.inputs[1]: (graph.weights[n.inputs[1]], graph.weights[n.inputs[2]], n.attrs) for n in nodes}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("proj", ["layers.0.self_attn.q_proj", "layers.1.mlp.gate_proj"])
def test_gemm_matches_qlinear_ref_on_smoothquant_weights(smoothquant_linears, proj, dtype):
    (qweight, w_scales, attrs), = [v for name, v in smoothquant_linears.items() if proj in name]
    x = activations(6, attrs["in_features"], dtype, seed=len(proj))
    y = w8a8_gemm(x, qweight, w_scales, target="h100-bf16")
    ref = qlinear_ref(x, qweight, w_scales, **attrs)[0]
    assert y.dtype == ref.dtype == dtype
    # The reference sums dequantised fp32 products (rounding grows with K); the kernel sums exact ints.
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(y.double(), ref.double(), rtol=rtol, atol=1e-5 * float(ref.abs().max()))


def test_leading_dims_are_kept_and_no_tokens_give_an_empty_result():
    qweight, w_scales = weights(16, 64)
    x = activations(6, 64, seed=8).reshape(2, 3, 64)
    y = w8a8_gemm(x, qweight, w_scales, config=SMALL)
    assert y.shape == (2, 3, 16)
    assert torch.equal(y.reshape(6, 16), w8a8_gemm(x.reshape(6, 64), qweight, w_scales, config=SMALL))
    assert w8a8_gemm(torch.empty(0, 64), qweight, w_scales).shape == (0, 16)


# -- rendering and errors ------------------------------------------------------------------------
def test_a_launch_runs_the_two_sources_render_w8a8_gemm_names():
    qweight, w_scales = weights(16, 64)
    x, a = activations(3, 64, torch.float16, seed=9), torch.tensor([0.1])
    w8a8_gemm(x, qweight, w_scales, torch.zeros(16, dtype=torch.float16), act_scale=a, target="rtx4090")
    quantizer, gemm = render_w8a8_gemm("rtx4090", "float16", 64, has_bias=True, has_act_scale=True)
    assert (quantizer.name, gemm.name) == ("quantize_int8_static", "int8_gemm")
    for kernel in (quantizer, gemm):
        assert (kernel_cache_dir() / f"{kernel.sha256}.py").read_text(encoding="utf-8") == kernel.source
    dynamic, h100, bf16 = (render_w8a8_gemm("rtx4090", "float16", 64), render_w8a8_gemm("h100", "float16", 64),
                           render_w8a8_gemm("rtx4090", "bfloat16", 128, has_bias=True))
    assert dynamic[0].name == "quantize_int8_per_token"
    assert h100[0] == dynamic[0]            # the same row-kernel constants for 64 features
    assert len({k.sha256 for k in (quantizer, gemm, *dynamic, h100[1], *bf16)}) == 7
    for kernel in (quantizer, gemm):
        assert "{{" not in kernel.source and "{%" not in kernel.source
        compile(kernel.source, kernel.name, "exec")


def test_mismatched_operands_are_refused():
    qweight, w_scales = weights(16, 64)
    x = activations(2, 64)
    with pytest.raises(ValueError, match="stands for 64"):
        w8a8_gemm(activations(2, 32), qweight, w_scales)
    with pytest.raises(ValueError, match="qweight must be 2-D torch.int8"):
        w8a8_gemm(x, qweight.to(torch.uint8), w_scales)
    with pytest.raises(ValueError, match=r"w_scales must be float32 of shape \(16,\)"):
        w8a8_gemm(x, qweight, w_scales[:1])
    with pytest.raises(ValueError, match="act_scale must be a one-element float32"):
        w8a8_gemm(x, qweight, w_scales, act_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        w8a8_gemm(x, qweight, w_scales, torch.ones(8))
    with pytest.raises(ValueError, match="activations must be one of"):
        w8a8_gemm(x.double(), qweight, w_scales)
    with pytest.raises(ValueError, match="K tiles of at least 32"):
        render_int8_gemm(TileConfig(16, 16, 16, 4, 2))
