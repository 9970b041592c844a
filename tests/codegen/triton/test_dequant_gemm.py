"""The dequantising Triton GEMM, run in Triton's interpreter, against float64 matmuls of the
weights compiler/quant.py dequantises, for every scheme, ragged shapes and several tile configs."""

import os

import pytest
import torch

from llmc.codegen.triton.triton_configs import TILE_CONFIGS, TileConfig, tile_config
from llmc.codegen.triton.triton_gemm import dequant_gemm, render_dequant_gemm
from llmc.codegen.triton.triton_render import kernel_cache_dir, load_kernel
from llmc.compiler import quant, schemes
from llmc.errors import LlmcError, TargetError

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/codegen/triton/conftest.py sets the interpreter"
pytestmark = pytest.mark.triton

SMALL = TileConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)  # many programs, ragged tiles


def reference(x, scheme, qweight, scales, zeros=None, act_scale=None, bias=None):
    if act_scale is not None:
        x = quant.fake_quant_fp8(x.float(), act_scale)
    w = schemes.dequantize_weight(scheme, qweight, scales, zeros, dtype=torch.float64)
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


def quantized(scheme, n, k, group_size=None, per_channel=True):
    w = torch.randn(n, k, dtype=torch.float64)
    if scheme == "int8":
        return quant.quantize_int8(w) + (None,)
    if scheme == "fp8":
        return quant.quantize_fp8(w, per_channel) + (None,)
    codes, scales, zeros = quant.quantize_int4(w, group_size)
    return quant.pack_int4(codes), scales, zeros


def assert_close(y, ref, x):
    # fp32 accumulation over K: error grows with sqrt(K) * |x| * |w|
    tol = 1e-5 * x.shape[-1] ** 0.5 * float(ref.abs().max())
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("m,n,k,group_size,config", [
    (5, 48, 128, 32, SMALL),              # tiles span one group each; ragged M and N
    (16, 16, 64, 64, SMALL),              # tiles span part of a group
    (1, 48, 128, 32, TILE_CONFIGS["h100"]),  # a 64-wide K tile spans two groups
    (5, 16, 128, 64, TILE_CONFIGS["rtx4090"]),
])
def test_int4_matches_float64_dequant_matmul(m, n, k, group_size, config):
    qweight, scales, zeros = quantized("int4", n, k, group_size)
    x = torch.randn(m, k)
    y = dequant_gemm(x, qweight, scales, zeros, scheme="int4", group_size=group_size, config=config)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_close(y, reference(x, "int4", qweight, scales, zeros), x)


@pytest.mark.parametrize("m,n,k,config", [(5, 48, 128, SMALL), (16, 16, 64, TILE_CONFIGS["a100"]),
                                          (1, 48, 64, TILE_CONFIGS["orin"])])
def test_int8_matches_float64_dequant_matmul(m, n, k, config):
    qweight, scales, _ = quantized("int8", n, k)
    x, bias = torch.randn(m, k), torch.randn(n)
    y = dequant_gemm(x, qweight, scales, scheme="int8", bias=bias, config=config)
    assert_close(y, reference(x, "int8", qweight, scales, bias=bias), x)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("m,n,k", [(5, 48, 128), (16, 16, 64)])
def test_fp8_weights_match_float64_dequant_matmul(m, n, k, per_channel):
    qweight, scales, _ = quantized("fp8", n, k, per_channel=per_channel)
    x = torch.randn(m, k)
    y = dequant_gemm(x, qweight, scales, scheme="fp8", config=SMALL)
    assert_close(y, reference(x, "fp8", qweight, scales), x)


def test_fp8_activation_scale_rounds_activations_as_torch_fp8():
    qweight, scales, _ = quantized("fp8", 48, 128)
    # |x| / a reaches past 448 (saturation), through the normal range, and into subnormals.
    x = torch.randn(5, 128) * torch.logspace(-4, 1.5, 128)
    act_scale = torch.tensor([0.05])
    y = dequant_gemm(x, qweight, scales, scheme="fp8", act_scale=act_scale, config=SMALL)
    ref = reference(x, "fp8", qweight, scales, act_scale=act_scale)
    assert_close(y, ref, x)
    unquantized = reference(x, "fp8", qweight, scales)
    assert (ref - unquantized).abs().max() > 10 * (y.double() - ref).abs().max()  # the rounding is visible


def test_fp8_activation_rounding_is_bitwise_torchs_including_ties_and_subnormals():
    # An identity weight makes the GEMM return the fake-quantised activations themselves.
    a = torch.tensor([0.03])
    ties = torch.tensor([1 + 1 / 16, 1 + 3 / 16, -(1 + 5 / 16), 2 ** -9 * 2.5, 2 ** -9 * 1.5, 460.0]) * a
    x = torch.cat([ties, torch.randn(16 * 64 - len(ties)) * torch.logspace(-5, 1.3, 16 * 64 - len(ties))])
    x = x.reshape(16, 64)
    y = dequant_gemm(x, torch.eye(64).to(torch.float8_e4m3fn), torch.ones(1), scheme="fp8", act_scale=a,
                     config=SMALL)
    torch.testing.assert_close(y, quant.fake_quant_fp8(x, a), rtol=0, atol=0)


def test_bf16_activations_give_bf16_output_within_bf16_rounding():
    qweight, scales, zeros = quantized("int4", 48, 128, 32)
    x = torch.randn(5, 128).to(torch.bfloat16)
    y = dequant_gemm(x, qweight, scales, zeros, scheme="int4", group_size=32, config=SMALL)
    assert y.dtype == torch.bfloat16
    ref = reference(x, "int4", qweight, scales, zeros)
    # One bf16 ulp (2^-7 relative): the interpreter truncates fp32 -> bf16 where GPUs round to nearest.
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-5 * float(ref.abs().max()))


def test_leading_dims_are_kept():
    qweight, scales, _ = quantized("int8", 16, 64)
    x = torch.randn(2, 3, 64)
    y = dequant_gemm(x, qweight, scales, scheme="int8", config=SMALL)
    assert y.shape == (2, 3, 16)
    assert_close(y.reshape(6, 16), reference(x.reshape(6, 64), "int8", qweight, scales), x)


def test_no_tokens_give_an_empty_result():
    qweight, scales, zeros = quantized("int4", 16, 64, 32)
    assert dequant_gemm(torch.randn(0, 64), qweight, scales, zeros, scheme="int4", group_size=32).shape == (0, 16)


def test_rendering_is_deterministic_and_constants_change_the_source():
    a = render_dequant_gemm("int4", SMALL, group_size=32)
    assert a.source == render_dequant_gemm("int4", SMALL, group_size=32).source
    assert a.sha256 == render_dequant_gemm("int4", SMALL, group_size=32).sha256
    others = [render_dequant_gemm("int4", SMALL, group_size=64), render_dequant_gemm("int4", tile_config("h100"),
              group_size=32), render_dequant_gemm("int4", SMALL, group_size=32, x_dtype="bfloat16"),
              render_dequant_gemm("int8", SMALL), render_dequant_gemm("fp8", SMALL, has_act_scale=True)]
    assert len({a.sha256} | {o.sha256 for o in others}) == 1 + len(others)
    assert "{{" not in a.source and "{%" not in a.source
    compile(a.source, "dequant_gemm", "exec")  # valid Python


def test_loaded_kernel_comes_from_a_cache_file_named_by_its_hash():
    kernel = render_dequant_gemm("int8", SMALL, has_bias=True)
    path = kernel_cache_dir() / f"{kernel.sha256}.py"
    load_kernel(kernel)
    assert path.read_text(encoding="utf-8") == kernel.source


def test_tampered_cache_file_is_rewritten(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))
    kernel = render_dequant_gemm("fp8", TileConfig(16, 32, 32, 2, 1), per_channel_scale=False)
    path = kernel_cache_dir() / f"{kernel.sha256}.py"
    path.write_text("raise SystemExit('tampered')\n")
    load_kernel(kernel)
    assert path.read_text(encoding="utf-8") == kernel.source


def test_a_kernel_cache_others_can_write_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))
    kernel = render_dequant_gemm("fp8", TileConfig(16, 16, 32, 2, 1), per_channel_scale=False)   # not loaded yet
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton").chmod(0o777)
    with pytest.raises(LlmcError, match="writable by others"):
        load_kernel(kernel)
    assert list((tmp_path / "triton").iterdir()) == []


def test_target_names_map_to_gpu_families():
    assert tile_config("h100-fp8") == tile_config("h100") == TILE_CONFIGS["h100"]
    assert tile_config("orin-int4") == TILE_CONFIGS["orin"]
    with pytest.raises(TargetError, match="mi300"):
        tile_config("mi300")


def test_mismatched_operands_are_refused():
    qweight, scales, zeros = quantized("int4", 16, 64, 32)
    with pytest.raises(ValueError, match="group_size 48"):
        dequant_gemm(torch.randn(2, 64), qweight, scales, zeros, scheme="int4", group_size=48)
    with pytest.raises(ValueError, match="stands for 64"):
        dequant_gemm(torch.randn(2, 32), qweight, scales, zeros, scheme="int4", group_size=32)
    with pytest.raises(ValueError, match="w8a8"):
        dequant_gemm(torch.randn(2, 64), qweight, scales, scheme="w8a8")
    with pytest.raises(ValueError, match="scales must be float32"):
        dequant_gemm(torch.randn(2, 64), qweight, scales.half(), zeros, scheme="int4", group_size=32)
