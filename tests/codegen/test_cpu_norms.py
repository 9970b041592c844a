"""The CPU rms_norm kernels spell out F.rms_norm's steps in place: bitwise its result in fp32 (which
the HF-exact fp32 target relies on), and the reference's within rounding of float64 in bf16."""

import pytest
import torch
import torch.nn.functional as F

from llmc.codegen.torch_cpu.cpu_kernels import resolve_kernel


@pytest.mark.parametrize("rows", [1, 7, 512])
def test_fp32_rms_norm_and_add_rms_norm_are_bitwise_f_rms_norm(rows):
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 96, generator=gen) * 3 for _ in range(2))
    weight = 1 + 0.1 * torch.randn(96, generator=gen)
    assert torch.equal(resolve_kernel("cpu.rms_norm")(x, weight, eps=1e-5)[0], F.rms_norm(x, (96,), weight, eps=1e-5))
    normed, summed = resolve_kernel("cpu.add_rms_norm")(x, residual, weight, eps=1e-5)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, F.rms_norm(x + residual, (96,), weight, eps=1e-5))


def test_bf16_rms_norm_matches_float64():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 64, generator=gen) * 3).bfloat16()
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).bfloat16()
    xd = x.double()
    want = weight.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().double()
    got = resolve_kernel("cpu.rms_norm")(x, weight, eps=1e-6)[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0, rtol=2 ** -7)
