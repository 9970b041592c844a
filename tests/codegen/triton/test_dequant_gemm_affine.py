"""The dequantising Triton GEMM over GGUF's kept block formats (affine4 / affine8: w = q·s + m,
affine4 without minimums (q - 8)·s; fp16 scales as GGUF stores them, fp32 for K-quants), run in
Triton's interpreter against float64 matmuls of compiler/quant.py's dequantised weights."""

import os

import pytest
import torch

from llmc.codegen.triton.triton_configs import TILE_CONFIGS, TileConfig
from llmc.codegen.triton.triton_gemm import dequant_gemm, render_dequant_gemm
from llmc.compiler import quant, schemes

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/codegen/triton/conftest.py sets the interpreter"
pytestmark = pytest.mark.triton

SMALL = TileConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)
NARROW_K = TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)


def affine_params(scheme, n, k, group_size, mins: bool, dtype):
    """Random codes in the scheme's range with scales (and minimums) of `dtype`, [N, K/g]."""
    low, high = (0, 16) if scheme == "affine4" else (-32, 32)
    codes = torch.randint(low, high, (n, k))
    scales = (torch.rand(n, k // group_size) * 0.1 + 0.01).to(dtype)
    minimums = (torch.randn(n, k // group_size) * 0.5).to(dtype) if mins else None
    return (quant.pack_int4(codes) if scheme == "affine4" else codes.to(torch.int8)), scales, minimums


@pytest.mark.parametrize("scheme,mins,dtype", [("affine4", True, torch.float16), ("affine4", False, torch.float16),
                                               ("affine8", False, torch.float16), ("affine8", True, torch.float32)])
@pytest.mark.parametrize("m,n,k,group_size,config", [
    (5, 48, 128, 32, SMALL),                  # one group per K tile; ragged M and N
    (3, 16, 64, 16, SMALL),                   # Q6_K's groups of 16: a tile spans two
    (1, 32, 64, 32, NARROW_K),                # a tile is part of a group
    (1, 48, 128, 32, TILE_CONFIGS["h100"]),   # a 64-wide K tile spans two groups
])
def test_affine_matches_float64_dequant_matmul(scheme, mins, dtype, m, n, k, group_size, config):
    qweight, scales, minimums = affine_params(scheme, n, k, group_size, mins, dtype)
    x, bias = torch.randn(m, k), torch.randn(n)
    y = dequant_gemm(x, qweight, scales, minimums, scheme=scheme, group_size=group_size, bias=bias, config=config)
    w = schemes.dequantize_weight(scheme, qweight, scales, minimums, dtype=torch.float64)
    ref = x.double() @ w.T + bias.double()
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * k ** 0.5 * float(ref.abs().max()))


def test_int4_sources_do_not_change_with_the_affine_variants():
    """HAS_ZEROS is an affine constant only, so int4 kernels render (and hash) as before."""
    kernel = render_dequant_gemm("int4", SMALL, group_size=32)
    assert "HAS_ZEROS" not in kernel.source and "affine" not in kernel.source
    assert dict(render_dequant_gemm("affine4", SMALL, group_size=32, has_zeros=True).constants)["HAS_ZEROS"]


def test_missing_group_scales_are_refused():
    qweight, scales, _ = affine_params("affine4", 16, 64, 32, False, torch.float16)
    with pytest.raises(ValueError, match="affine4 scales and zeros must have shape"):
        dequant_gemm(torch.randn(2, 64), qweight, scales[:, :1], scheme="affine4", group_size=32)
