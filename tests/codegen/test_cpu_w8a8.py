"""The CPU w8a8 qlinear (codegen/torch_cpu/cpu_qlinear_a8.py): per-token int8 codes that are the reference's
fake quantisation, and an int8 x int8 GEMM whose fp32 result is the exact integer product widened
and scaled, for K where the int32 sums pass 2^24 (no longer exact in fp32) too."""

import pytest
import torch

from llmc.codegen.torch_cpu.cpu_qlinear_a8 import INT_MM, pack_w8a8, quantize_per_token, run_a8_qlinear
from llmc.compiler.quant import fake_quant_int8_per_token


def random_w8a8(gen, n, k):
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return qweight, torch.rand(n, generator=gen) / 50 + 1e-3


@pytest.mark.parametrize("m", [1, 5, 64])
def test_codes_times_scales_are_the_reference_fake_quantisation(m):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=gen) * torch.rand(m, 1, generator=gen) * 10
    x[0] = 0.0   # an all-zero row keeps scale 1 and codes 0
    codes, scales = quantize_per_token(x)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert torch.equal(codes.float() * scales, fake_quant_int8_per_token(x))


@pytest.mark.skipif(INT_MM is None, reason="this torch has no torch._int_mm")
@pytest.mark.parametrize("m,n,k", [(1, 48, 576), (7, 40, 96), (64, 32, 1536)])
def test_gemm_is_the_integer_product_widened_to_fp32_then_scaled(m, n, k):
    gen = torch.Generator().manual_seed(k)
    qweight, w_scales = random_w8a8(gen, n, k)
    qweight[0] = 127
    x = torch.rand(m, k, generator=gen) + 1.0   # codes 64..127: output column 0 sums up to K·127²
    codes, x_scales = quantize_per_token(x)
    exact = codes.long() @ qweight.long().T     # int64: no rounding anywhere
    if k == 1536:
        assert exact.abs().max() > 2 ** 24      # past fp32's exact integers
    want = exact.float() * x_scales * w_scales
    got = run_a8_qlinear(x.reshape(1, m, k), pack_w8a8(qweight, w_scales))
    assert got.shape == (1, m, n)
    assert torch.equal(got[0], want)
