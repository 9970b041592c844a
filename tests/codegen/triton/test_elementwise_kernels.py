"""The row-wise Triton kernels (RMSNorm with the fused residual add, SwiGLU, rotary), run in
Triton's interpreter, against compiler/ops.py's references in the same dtype and against float64
math, for fp32/bf16/fp16, ragged and non-power-of-two shapes and several targets' constants."""

import os

import pytest
import torch
import torch.nn.functional as F

from llmc.codegen.triton.triton_elementwise import (
    render_rms_norm,
    render_rotary,
    render_swiglu,
    rms_norm,
    rotary,
    rotary_qk,
    swiglu,
)
from llmc.codegen.triton.triton_render import kernel_cache_dir
from llmc.compiler.ops import rms_norm_ref, rope_ref
from llmc.errors import TargetError

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/codegen/triton/conftest.py sets the interpreter"
pytestmark = pytest.mark.triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative spacing of each dtype's values (2^-(mantissa bits)); for fp32 a few ulps more, since
# sums run in another order and libm's exp/cos/rsqrt differ from numpy's in the last bits.
EPS = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def assert_near(got, want, ulps, dtype):
    """Within `ulps` of the dtype's spacing, relative to each value plus the same relative to the
    largest (where cancellation leaves a small result). The interpreter truncates fp32 -> bf16
    where GPUs round to nearest, so bf16 results may sit one ulp further off."""
    want = want.double()
    tol = ulps * EPS[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


# -- RMSNorm -------------------------------------------------------------------------------------
def rms_norm_float64(x, weight, eps):
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(5, 576), (1, 64), (3, 100)])
def test_rms_norm_matches_reference_and_float64(tokens, hidden, dtype):
    x, weight = randn(tokens, hidden, dtype=dtype, seed=hidden), 1 + randn(hidden, dtype=dtype, seed=1) / 4
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    assert_near(out, rms_norm_ref(x, weight, eps=1e-5)[0], 2, dtype)
    assert_near(out, rms_norm_float64(x, weight, 1e-5), 4, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(5, 576), (2, 100)])
def test_rms_norm_with_residual_returns_the_sum_and_its_norm(tokens, hidden, dtype):
    x, residual = randn(tokens, hidden, dtype=dtype, seed=2), randn(tokens, hidden, dtype=dtype, seed=3) * 3
    weight = 1 + randn(hidden, dtype=dtype, seed=4) / 4
    out, summed = rms_norm(x, weight, 1e-6, residual)
    assert summed.dtype == out.dtype == dtype
    assert_near(summed, x + residual, 1, dtype)
    assert_near(out, rms_norm_ref(x + residual, weight, eps=1e-6)[0], 2, dtype)
    assert_near(out, rms_norm_float64(x.double() + residual.double(), weight, 1e-6), 4, dtype)


def test_rms_norm_with_fp32_weight_promotes_as_the_reference():
    x, weight = randn(3, 64, dtype=torch.bfloat16, seed=5), randn(64, seed=6)
    out = rms_norm(x, weight, 1e-5)
    ref = rms_norm_ref(x, weight, eps=1e-5)[0]
    assert out.dtype == ref.dtype == torch.float32
    # h is rounded to bf16 before the fp32 weight, so the result carries bf16's rounding
    assert_near(out, ref, 1, torch.bfloat16)


def test_rms_norm_keeps_leading_dims_and_reads_strided_rows():
    x = randn(2, 3, 128, seed=7)[..., :96]               # rows 128 apart, 96 features each
    weight = randn(96, seed=8)
    out, summed = rms_norm(x, weight, 1e-5, residual=x.clone())
    assert out.shape == summed.shape == (2, 3, 96)
    assert_near(out, rms_norm_ref(2 * x, weight, eps=1e-5)[0], 2, torch.float32)


# -- SwiGLU --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter,target", [(3, 100, "h100"), (1, 1100, "h100"), (4, 700, "orin-int4")])
def test_swiglu_packed_and_separate_match_silu_times_up(tokens, inter, target, dtype):
    gate_up = randn(tokens, 2 * inter, dtype=dtype, seed=inter) * 3
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    packed = swiglu(gate_up, target=target)
    separate = swiglu(gate.contiguous(), up.contiguous(), target=target)
    assert packed.shape == (tokens, inter) and packed.dtype == dtype
    assert torch.equal(packed, separate)
    assert_near(packed, F.silu(gate) * up, 2, dtype)
    g = gate.double()
    assert_near(packed, g / (1 + torch.exp(-g)) * up.double(), 3, dtype)


# -- rotary --------------------------------------------------------------------------------------
def inv_freq(head_dim, base=10000.0):
    return 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)


def rotary_float64(x, positions, inv_freq, head_dim, scaling):
    """Rotate-half rotary in float64 from the fp32 angles (as rope_cos_sin computes them)."""
    angle = (positions.float()[:, None] * inv_freq.float()[None, :]).double()
    cos, sin = (angle.cos() * scaling)[:, None, :], (angle.sin() * scaling)[:, None, :]
    x = x.double().reshape(x.shape[0], -1, head_dim)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(x.shape[0], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim,scaling,target", [
    (4, 6, 64, 1.0, "h100"),
    (3, 9, 80, 0.5, "h100-bf16"),       # ragged head blocks; half a head (40) is not a power of two
    (2, 3, 32, 1.0, "orin"),
])
def test_rotary_matches_rope_reference_and_float64(tokens, heads, head_dim, scaling, target, dtype):
    x = randn(tokens, heads * head_dim, dtype=dtype, seed=heads)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    freqs = inv_freq(head_dim)
    out = rotary(x, positions, freqs, head_dim=head_dim, scaling=scaling, target=target)
    assert out.shape == x.shape and out.dtype == dtype
    assert_near(out, rope_ref(x, positions, freqs, head_dim=head_dim, scaling=scaling)[0], 3, dtype)
    # cos and sin are rounded to the dtype first (as the reference's tables are): a few ulps more
    assert_near(out, rotary_float64(x, positions, freqs, head_dim, scaling), 6, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_qk_rotates_gqa_q_and_k_from_a_packed_qkv_in_one_launch(dtype):
    tokens, head_dim, q_heads, kv_heads = 5, 32, 6, 2
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=9)
    q, k = qkv[:, : q_heads * head_dim], qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim]
    positions, freqs = torch.arange(7, 7 + tokens), inv_freq(head_dim, 500000.0)
    q_out, k_out = rotary_qk(q, k, positions, freqs, head_dim=head_dim)
    assert torch.equal(q_out, rotary(q, positions, freqs, head_dim=head_dim))
    assert torch.equal(k_out, rotary(k, positions, freqs, head_dim=head_dim))
    assert_near(q_out, rope_ref(q, positions, freqs, head_dim=head_dim)[0], 3, dtype)
    assert_near(k_out, rope_ref(k, positions, freqs, head_dim=head_dim)[0], 3, dtype)


def test_rotary_accepts_a_leading_unit_batch():
    x, positions = randn(1, 3, 4 * 16, seed=10), torch.tensor([[0, 5, 9]])
    out = rotary(x, positions, inv_freq(16), head_dim=16)
    assert out.shape == (1, 3, 64)
    assert_near(out, rope_ref(x, positions, inv_freq(16), head_dim=16)[0], 3, torch.float32)


# -- rendering and errors ----------------------------------------------------------------------
def test_no_tokens_give_empty_results():
    assert rms_norm(torch.empty(0, 64), torch.ones(64), 1e-5).shape == (0, 64)
    assert swiglu(torch.empty(0, 32)).shape == (0, 16)
    assert rotary(torch.empty(0, 64), torch.empty(0, dtype=torch.long), inv_freq(16), head_dim=16).shape == (0, 64)


def test_rendering_is_deterministic_and_constants_change_the_source():
    kernels = [render_rms_norm("h100", "float32", 576, False), render_rms_norm("h100", "float32", 576, True),
               render_rms_norm("h100", "bfloat16", 576, False), render_rms_norm("h100", "float32", 1024, False),
               render_rms_norm("orin", "float32", 8192, False),
               render_swiglu("h100", "float32", 1536), render_swiglu("orin", "float32", 1536),
               render_swiglu("h100", "float16", 1536), render_rotary("h100", "float32", 64),
               render_rotary("h100", "float32", 64, rotate_k=True), render_rotary("orin", "float32", 64)]
    assert len({k.sha256 for k in kernels}) == len(kernels)
    again = render_rms_norm.__wrapped__("h100", "float32", 576, False)   # rendered afresh, not cached
    assert again.source == kernels[0].source
    for kernel in kernels:
        assert "{{" not in kernel.source and "{%" not in kernel.source
        compile(kernel.source, kernel.name, "exec")   # valid Python
    assert dict(render_rms_norm("h100", "float32", 576, False).constants)["BLOCK"] == 1024


def test_targets_set_the_launch_constants():
    h100, orin = (dict(render_rms_norm(t, "float32", 8192, True).constants) for t in ("h100-fp8", "orin-int4"))
    assert (h100["NUM_WARPS"], orin["NUM_WARPS"]) == (16, 4)
    assert dict(render_swiglu("orin", "float32", 1536).constants)["BLOCK"] == 512
    with pytest.raises(TargetError, match="mi300"):
        render_swiglu("mi300", "float32", 64)


def test_launches_run_the_sources_their_render_functions_name():
    x, weight = randn(2, 576, dtype=torch.bfloat16, seed=11), randn(576, dtype=torch.bfloat16, seed=12)
    rms_norm(x, weight, 1e-5, x)
    swiglu(x)
    rotary_qk(x, x, torch.arange(2), inv_freq(64), head_dim=64, target="a100")
    for kernel in (render_rms_norm("h100", "bfloat16", 576, True), render_swiglu("h100", "bfloat16", 288),
                   render_rotary("a100", "bfloat16", 64, rotate_k=True)):
        assert (kernel_cache_dir() / f"{kernel.sha256}.py").read_text(encoding="utf-8") == kernel.source


def test_bad_operands_are_refused_with_what_was_expected():
    x = randn(2, 64)
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\)"):
        rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm(x, torch.ones(64), 1e-5, x.half())
    with pytest.raises(ValueError, match="x must be one of"):
        rms_norm(x.double(), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(randn(2, 63))
    with pytest.raises(ValueError, match="must match"):
        swiglu(x, randn(2, 32))
    with pytest.raises(ValueError, match="even head_dim"):
        rotary(x, torch.arange(2), inv_freq(16), head_dim=15)
    with pytest.raises(ValueError, match="needs 2 positions and 8 inverse frequencies"):
        rotary(x, torch.arange(3), inv_freq(16), head_dim=16)
    with pytest.raises(ValueError, match="not a multiple of head_dim 48"):
        rotary(x, torch.arange(2), inv_freq(48), head_dim=48)
    with pytest.raises(ValueError, match="must have q's dtype"):
        rotary_qk(x, x.half(), torch.arange(2), inv_freq(16), head_dim=16)
