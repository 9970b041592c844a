"""Quantisation arithmetic against float64 math written out here: int8 per-channel and int4
group-wise round trips stay within half a step, int4 nibbles pack low-first, fp8 keeps e4m3's
relative precision, and the qlinear reference is F.linear over the dequantised weight."""

import pytest
import torch
import torch.nn.functional as F

from llmc.compiler.ir import TensorType
from llmc.compiler.ops import OPS, qlinear_ref
from llmc.compiler.quant import (
    dequantize_fp8,
    dequantize_int4,
    dequantize_int4_codes,
    dequantize_int8,
    fake_quant_fp8,
    fake_quant_int8_per_token,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from llmc.errors import IRError


def weights(seed, n=24, k=128, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen, dtype=dtype) * 0.05
    w[0, 3] = 0.9                    # an outlier sets its row's (and group's) scale
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_round_trip_matches_float64_math_and_stays_within_half_a_step(seed):
    w = weights(seed)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (24,)
    expected_scales = w.abs().amax(dim=1) / 127
    torch.testing.assert_close(scales.double(), expected_scales, rtol=1e-7, atol=0)
    s = scales.double()[:, None]
    assert torch.equal(q.long(), torch.round(w / s).clamp(-127, 127).long())
    error = (w - dequantize_int8(q, scales, torch.float64)).abs()
    assert bool((error <= s / 2 + 1e-12).all())
    assert int(q.abs().max()) == 127


def int4_reference(w, g):
    """Per group, in float64 loops: scale (max(hi,0) - min(lo,0)) / 15, integer zero."""
    n, k = w.shape
    scales, zeros = torch.zeros(n, k // g, dtype=torch.float64), torch.zeros(n, k // g, dtype=torch.float64)
    codes = torch.zeros(n, k, dtype=torch.long)
    for row in range(n):
        for grp in range(k // g):
            vals = w[row, grp * g:(grp + 1) * g]
            lo, hi = min(vals.min().item(), 0.0), max(vals.max().item(), 0.0)
            s = float(torch.tensor((hi - lo) / 15, dtype=torch.float32))   # stored as fp32
            z = min(max(round(-lo / s), 0), 15)
            scales[row, grp], zeros[row, grp] = s, z
            codes[row, grp * g:(grp + 1) * g] = torch.clamp(torch.round(vals / s) + z, 0, 15).long()
    return codes, scales, zeros


@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_matches_float64_group_math_and_stays_within_half_a_step(g):
    w = weights(g, n=6)
    codes, scales, zeros = quantize_int4(w, g)
    assert codes.dtype == torch.uint8 and scales.shape == zeros.shape == (6, 128 // g)
    assert scales.dtype == zeros.dtype == torch.float32
    ref_codes, ref_scales, ref_zeros = int4_reference(w, g)
    assert torch.equal(codes.long(), ref_codes)
    assert torch.equal(scales.double(), ref_scales) and torch.equal(zeros.double(), ref_zeros)
    w_hat = dequantize_int4_codes(codes, scales, zeros, torch.float64)
    step = scales.double().repeat_interleave(g, dim=1)
    assert bool(((w - w_hat).abs() <= step / 2 + 1e-12).all())


def test_int4_keeps_zero_weights_and_all_zero_groups_exact():
    w = weights(5, n=4, k=64)
    w[1, :32] = 0.0
    w[2, 7] = 0.0
    codes, scales, zeros = quantize_int4(w, 32)
    w_hat = dequantize_int4_codes(codes, scales, zeros, torch.float64)
    assert bool((w_hat[1, :32] == 0).all()) and w_hat[2, 7] == 0
    assert bool(torch.isfinite(scales).all() and (scales > 0).all())


def test_int4_packing_puts_even_k_in_the_low_nibble_and_round_trips():
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert int(packed[2, 3]) == int(codes[2, 6]) + 16 * int(codes[2, 7])
    assert torch.equal(unpack_int4(packed), codes)


def test_packed_dequantisation_equals_unpacked():
    codes, scales, zeros = quantize_int4(weights(8, n=8, k=64).float(), 32)
    assert torch.equal(dequantize_int4(pack_int4(codes), scales, zeros),
                       dequantize_int4_codes(codes, scales, zeros))


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_round_trip_keeps_e4m3_relative_precision(per_channel):
    w = weights(9)
    q, scales = quantize_fp8(w, per_channel=per_channel)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == ((24,) if per_channel else (1,))
    w_hat = dequantize_fp8(q, scales, torch.float64)
    s = scales.double().reshape(-1, 1)
    # 3 mantissa bits: relative error <= 2^-4 for normals; subnormals are spaced 2^-9 apart
    assert bool(((w - w_hat).abs() <= w.abs() * 2 ** -4 + s * 2 ** -10).all())
    assert float((w_hat.abs().amax(dim=1) / s.reshape(-1)).max()) == pytest.approx(448.0)


def test_fake_quant_fp8_saturates_and_rounds_with_the_static_scale():
    a = torch.tensor([0.01], dtype=torch.float64)
    x = torch.tensor([[0.0123, -1.04, 10.0, -1.0]], dtype=torch.float64)   # 10.0 is over 448 * a
    out = fake_quant_fp8(x, a)
    assert out[0, 2] == pytest.approx(4.48)
    assert out[0, 1] == pytest.approx(-1.04)      # 104 is on the e4m3 grid (step 8 in 64..128)
    assert out[0, 3] == pytest.approx(-0.96)      # 100 ties between 96 and 104: to even
    assert abs(out[0, 0] - 0.0123) <= 0.0123 * 2 ** -4


def test_per_token_int8_fake_quant_uses_each_rows_own_scale():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64) * torch.arange(1, 6, dtype=torch.float64)[:, None]
    out = fake_quant_int8_per_token(x)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((x - out).abs() <= step / 2 + 1e-12).all())
    assert torch.equal(torch.round(out / step), torch.round(x / step))


def qlinear_attrs(scheme, k, n, zeros=False, act=False, bias=False, g=-1):
    return {"scheme": scheme, "group_size": g, "in_features": k, "out_features": n,
            "has_zeros": zeros, "has_act_scale": act, "has_bias": bias}


def test_qlinear_reference_is_a_linear_over_the_dequantised_weight():
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(16, 64, generator=gen) * 0.1
    x, bias = torch.randn(3, 64, generator=gen), torch.randn(16, generator=gen)
    q8, s8 = quantize_int8(w)
    got = qlinear_ref(x, q8, s8, bias, **qlinear_attrs("int8", 64, 16, bias=True))[0]
    torch.testing.assert_close(got.double(), x.double() @ (q8.double() * s8.double()[:, None]).T + bias.double(),
                               rtol=1e-5, atol=1e-6)
    codes, s4, z4 = quantize_int4(w, 32)
    got = qlinear_ref(x, pack_int4(codes), s4, z4, **qlinear_attrs("int4", 64, 16, zeros=True, g=32))[0]
    w4 = (codes.double() - z4.double().repeat_interleave(32, 1)) * s4.double().repeat_interleave(32, 1)
    torch.testing.assert_close(got.double(), x.double() @ w4.T, rtol=1e-5, atol=1e-6)


def test_qlinear_reference_fake_quantises_activations_for_fp8_and_w8a8():
    gen = torch.Generator().manual_seed(13)
    w, x = torch.randn(16, 64, generator=gen) * 0.1, torch.randn(3, 64, generator=gen)
    qf, sf = quantize_fp8(w)
    act = torch.tensor([x.abs().max().item() / 448])
    got = qlinear_ref(x, qf, sf, act, **qlinear_attrs("fp8", 64, 16, act=True))[0]
    torch.testing.assert_close(got, F.linear(fake_quant_fp8(x, act), dequantize_fp8(qf, sf)))
    q8, s8 = quantize_int8(w)
    got = qlinear_ref(x, q8, s8, **qlinear_attrs("w8a8", 64, 16))[0]
    torch.testing.assert_close(got, F.linear(fake_quant_int8_per_token(x), dequantize_int8(q8, s8)))


def test_qlinear_type_rule_checks_the_stored_layout():
    infer = OPS["qlinear"].infer
    x = TensorType(("tokens", 64), "float32")
    out = infer([x, TensorType((16, 32), "uint8"), TensorType((16, 2), "float32"),
                 TensorType((16, 2), "float32")], qlinear_attrs("int4", 64, 16, zeros=True, g=32))
    assert out == [TensorType(("tokens", 16), "float32")]
    with pytest.raises(IRError, match="expected uint8\\[16, 32\\]"):
        infer([x, TensorType((16, 64), "uint8"), TensorType((16, 2), "float32"),
               TensorType((16, 2), "float32")], qlinear_attrs("int4", 64, 16, zeros=True, g=32))
    with pytest.raises(IRError, match="call for 4"):
        infer([x, TensorType((16, 64), "int8"), TensorType((16,), "float32")],
              qlinear_attrs("int8", 64, 16, bias=True))
    with pytest.raises(IRError, match="unknown scheme"):
        infer([x, TensorType((16, 64), "int8"), TensorType((16,), "float32")],
              qlinear_attrs("int3", 64, 16))
