"""K-quant group params kept packed (compiler/quant.py's pack_k_params: an fp16 factor per super-block of 256
weights and an int8 per group) compute exactly what the same values stored as fp32 compute, in every native
GEMV path that reads them (int8, int16 and fp32 activations, the AMX tiles), and unpack to the values
GGUF's Q4_K/Q5_K/Q6_K blocks stand for."""

from __future__ import annotations

import pytest
import torch

from llmc.codegen.native import cpu_native
from llmc.compiler.quant import group_params, pack_int4, pack_k_params, packed_groups

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native kernels here")


def _packed(g: torch.Generator, n: int, k: int, group: int, low: int, high: int, sign: float = 1.0):
    """Random packed params (factors within 25% of 0.01, integers low..high-1) and their fp32 values."""
    factors = (sign * 0.01 * (0.75 + 0.5 * torch.rand(n, k // 256, generator=g))).half()
    ints = torch.randint(low, high, (n, k // group), generator=g, dtype=torch.int8)
    packed = pack_k_params(factors, ints)
    values = group_params(packed, k)
    assert packed.dtype == torch.uint8 and packed_groups(packed.shape[1], k) == k // group
    assert torch.equal(values, (ints.float().reshape(n, -1, 256 // group) * factors.float()[..., None]).reshape(n, -1))
    return packed, values


@pytest.mark.parametrize("activations", ["int8", "int16", "fp32"])
@pytest.mark.parametrize("rows,n,k", [(1, 70, 512), (3, 33, 768), (cpu_native.MAX_ROWS, 40, 256),
                                      (2, 20, 4352)])   # 17 super-blocks: more than one register of factors
def test_gemv_q4_on_packed_params_equals_fp32_params(rows, n, k, activations):
    """A Q4_K weight (codes, packed d*sc and -dmin*m) against the same weight with fp32 params: the same bits."""
    g = torch.Generator().manual_seed(n + k)
    codes = pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g))
    scales, scale_values = _packed(g, n, k, 32, 1, 64)
    mins, min_values = _packed(g, n, k, 32, 0, 64, sign=-8.0)
    rounding = "int8" if activations == "int8" else "int16"
    packed = cpu_native.q4_weights(codes, scales, mins, False, rounding)
    plain = cpu_native.q4_weights(codes, scale_values, min_values, False, rounding)
    assert packed.scales.dtype == packed.other.dtype == torch.uint8 and plain.scales.dtype == torch.float32
    assert packed.scales.data_ptr() == scales.data_ptr()   # read in place
    x = torch.randn(rows, k + 3, generator=g)[:, 1:1 + k]
    if activations == "fp32":
        with cpu_native.fp32_activations():
            got, want = cpu_native.gemv_q4(x, packed), cpu_native.gemv_q4(x, plain)
    else:
        got, want = cpu_native.gemv_q4(x, packed), cpu_native.gemv_q4(x, plain)
    assert got is not None and torch.equal(got, want)
    ref = x.double() @ _dense(codes, scale_values, min_values).T
    assert ((got.double() - ref).abs().max() / ref.abs().max()) < 2e-2


def _dense(codes, scales, mins):
    from llmc.compiler.quant import dequantize_affine

    return dequantize_affine("affine4", codes, scales, mins).double()


@pytest.mark.parametrize("group,k", [(16, 512), (32, 768), (16, 4352)])
def test_gemv_q8_on_packed_params_equals_fp32_params(group, k):
    """Q6_K (groups of 16, signed integers) and Q5_K-like (groups of 32) int8 codes: the same bits as fp32
    params, on int16 activations where the shapes take them and on fp32 ones."""
    g = torch.Generator().manual_seed(group + k)
    n = 37
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    scales, values = _packed(g, n, k, group, -128, 128)
    packed, plain = cpu_native.q8_weights(codes, scales), cpu_native.q8_weights(codes, values)
    assert packed.group == plain.group == group and packed.scales.dtype == torch.uint8
    x = torch.randn(3, k, generator=g)
    assert torch.equal(cpu_native.gemv_q8(x, packed), cpu_native.gemv_q8(x, plain))
    with cpu_native.fp32_activations():
        assert torch.equal(cpu_native.gemv_q8(x, packed), cpu_native.gemv_q8(x, plain))


def test_amx_tiles_from_packed_params_equal_fp32_params(monkeypatch):
    """The AMX tiles are made from the unpacked values: the GEMM's bits as from fp32 params."""
    if not cpu_native.amx_ready():
        pytest.skip("no AMX here")
    monkeypatch.setenv(cpu_native.AMX_ENV, "all")
    g = torch.Generator().manual_seed(3)
    n, k = 48, 512
    codes = pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g))
    scales, scale_values = _packed(g, n, k, 32, 1, 64)
    mins, min_values = _packed(g, n, k, 32, 0, 64, sign=-8.0)
    packed = cpu_native.q4_weights(codes, scales, mins, False, "int8")
    plain = cpu_native.q4_weights(codes, scale_values, min_values, False, "int8")
    assert packed.tiles is not None and plain.tiles is not None
    x = torch.randn(20, k, generator=g)
    assert torch.equal(cpu_native.gemm(x, packed), cpu_native.gemm(x, plain))
