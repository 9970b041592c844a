"""AWQ against round-to-nearest and a float64 brute-force search, on N(0, 0.02) weights whose
inputs are correlated and carry a few outlier channels 10-50x larger than the rest."""

import pytest
import torch

from llmc.compiler.ops import rms_norm_ref
from llmc.compiler.quant import dequantize_int4_codes, quantize_int4
from llmc.errors import PassError
from llmc.passes.awq import (
    awq_clip_ratios,
    awq_quantize_weight,
    awq_quantize_with_scales,
    awq_scales,
    awq_search_shared,
)


def make_inputs(seed, k=256, outliers=6):
    """(generator, sample(tokens) -> activations [tokens, k] float32) of one linear input."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + torch.randn(k, k, generator=gen) / k ** 0.5
    low_rank = torch.randn(16, k, generator=gen)
    channel = torch.ones(k)
    channel[torch.randperm(k, generator=gen)[:outliers]] = 10 + 40 * torch.rand(outliers, generator=gen)

    def sample(tokens):
        x = torch.randn(tokens, k, generator=gen) @ mix
        return (x + torch.randn(tokens, 16, generator=gen) @ low_rank) * channel
    return gen, sample


def weight_of(gen, n, k=256):
    return 0.02 * torch.randn(n, k, generator=gen)


def awq_error(x, weight, q, scales, zeros, s):
    """||x Wᵀ - (x/s) dequant(q)ᵀ||, in float64."""
    x, s = x.double(), s.double()
    approx = (x / s) @ dequantize_int4_codes(q, scales, zeros, torch.float64).T
    return torch.linalg.norm(x @ weight.double().T - approx).item()


def rtn_error(x, weight, group_size):
    return awq_error(x, weight, *quantize_int4(weight, group_size), torch.ones(weight.shape[1]))


def test_alpha_zero_scales_are_ones_and_reproduce_rtn_exactly():
    gen, sample = make_inputs(0)
    weight, x = weight_of(gen, 64), sample(256)
    s = awq_scales(x.abs().mean(0), 0.0)
    assert torch.equal(s, torch.ones(256))
    q, scales, zeros = awq_quantize_with_scales(weight, s, x, group_size=64, clip=False)
    rtn_q, rtn_scales, rtn_zeros = quantize_int4(weight, 64)
    assert torch.equal(q, rtn_q) and torch.equal(scales, rtn_scales) and torch.equal(zeros, rtn_zeros)


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_awq_output_error_is_well_below_rtn_on_outlier_channels(seed, clip):
    gen, sample = make_inputs(seed)
    weight, calib, held_out = weight_of(gen, 128), sample(1024), sample(512)
    q, scales, zeros, s = awq_quantize_weight(weight, calib.abs().mean(0), calib[:512],
                                              group_size=64, clip=clip)
    ratio = awq_error(held_out, weight, q, scales, zeros, s) / rtn_error(held_out, weight, 64)
    assert ratio < 0.8, f"AWQ/RTN output error {ratio:.3f} (clip={clip})"


def test_shared_search_for_qkv_minimises_summed_error_over_the_grid():
    gen, sample = make_inputs(3)
    qkv = [weight_of(gen, 128), weight_of(gen, 64), weight_of(gen, 64)]
    x = sample(512)
    x_mean_abs = x.abs().mean(0)
    s = awq_search_shared(qkv, x_mean_abs, x, group_size=64, grid=10)
    assert s.shape == (256,) and not torch.equal(s, torch.ones(256))

    def summed_error(scales):     # float64, through the storage format
        return sum(awq_error(x, w, *quantize_int4(w * scales, 64), scales) ** 2 for w in qkv)
    grid_errors = [summed_error(awq_scales(x_mean_abs, a / 10)) for a in range(10)]
    assert summed_error(s) <= min(grid_errors) * 1.001
    assert summed_error(s) < 0.6 * grid_errors[0]        # grid_errors[0] is RTN


def test_each_linear_of_a_shared_group_beats_rtn_with_the_shared_scales():
    gen, sample = make_inputs(4)
    gate_up = [weight_of(gen, 192), weight_of(gen, 192)]
    calib, held_out = sample(512), sample(512)
    s = awq_search_shared(gate_up, calib.abs().mean(0), calib, group_size=64)
    for w in gate_up:
        stored = awq_quantize_with_scales(w, s, calib, group_size=64)
        assert awq_error(held_out, w, *stored, s) < 0.8 * rtn_error(held_out, w, 64)


def test_auto_clip_ratios_lie_on_the_shrink_grid():
    gen, sample = make_inputs(5, k=128)
    ratios = awq_clip_ratios(weight_of(gen, 16, k=128), sample(256), group_size=32)
    assert ratios.shape == (16, 4) and bool(((ratios >= 0.55) & (ratios <= 1.0)).all())
    assert torch.allclose(ratios * 20, (ratios * 20).round())
    assert bool((ratios < 1).any())       # N(0, σ) groups of 32 gain from a tighter range


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_auto_clip_never_raises_any_groups_output_error(alpha):
    gen, sample = make_inputs(5, k=128)
    weight, x = weight_of(gen, 16, k=128).double(), sample(256).double()
    s = awq_scales(x.abs().mean(0), alpha)
    errors = {}
    for clip in (True, False):     # ||X_g (W_g - dequant_g / s_g)ᵀ||² per (row, group)
        q, scales, zeros = awq_quantize_with_scales(weight, s, x, group_size=32, clip=clip)
        diff = weight - dequantize_int4_codes(q, scales, zeros, torch.float64) / s
        partial = torch.einsum("tgi,ngi->tng", x.reshape(-1, 4, 32), diff.reshape(16, 4, 32))
        errors[clip] = partial.pow(2).sum(0)
    assert bool((errors[True] <= errors[False] * (1 + 1e-9)).all())
    assert errors[True].sum() < errors[False].sum()


def test_clip_lowers_held_out_error_on_average():
    ratios = []
    for seed in (6, 7, 8):
        gen, sample = make_inputs(seed)
        weight, calib, held_out = weight_of(gen, 64), sample(512), sample(512)
        s = awq_scales(calib.abs().mean(0), 0.5)
        with_clip, without = (awq_error(held_out, weight, *awq_quantize_with_scales(
            weight, s, calib, group_size=64, clip=c), s) for c in (True, False))
        ratios.append(with_clip / without)
    assert sum(ratios) / len(ratios) < 0.98, f"clip/no-clip error ratios {ratios}"


def test_scales_fold_into_the_preceding_rms_norm():
    gen, sample = make_inputs(9)
    hidden, gamma = sample(512) / 10, 1 + 0.1 * torch.randn(256, generator=gen)
    weight = weight_of(gen, 96)
    x = rms_norm_ref(hidden, gamma, eps=1e-6)[0]
    q, scales, zeros, s = awq_quantize_weight(weight, x.abs().mean(0), x, group_size=64)
    folded = rms_norm_ref(hidden, gamma / s, eps=1e-6)[0]
    torch.testing.assert_close(folded, x / s, rtol=1e-5, atol=1e-6)
    y = folded.double() @ dequantize_int4_codes(q, scales, zeros, torch.float64).T
    error = torch.linalg.norm(x.double() @ weight.double().T - y).item()
    assert error < 0.8 * rtn_error(x, weight, 64)


def test_awq_output_respects_int4_storage_format():
    gen, sample = make_inputs(10, k=128)
    weight, x = weight_of(gen, 32, k=128), sample(256)
    q, scales, zeros, s = awq_quantize_weight(weight, x.abs().mean(0), x, group_size=32, grid=5)
    assert q.dtype == torch.uint8 and q.shape == (32, 128) and int(q.max()) <= 15
    assert scales.dtype == zeros.dtype == s.dtype == torch.float32
    assert scales.shape == zeros.shape == (32, 4) and s.shape == (128,)
    assert bool((scales > 0).all() and (s > 0).all())
    assert torch.equal(zeros, zeros.round()) and 0 <= zeros.min() and zeros.max() <= 15


def test_awq_rejects_inputs_of_the_wrong_width():
    with pytest.raises(PassError, match=r"\[N, 64\]"):
        awq_search_shared([torch.randn(8, 32)], torch.rand(64), torch.randn(16, 64))
    with pytest.raises(PassError, match="x_mean_abs"):
        awq_quantize_weight(torch.randn(8, 64), torch.rand(64), torch.randn(16, 48))
    with pytest.raises(PassError, match="group_size=48"):
        awq_quantize_weight(torch.randn(8, 64), torch.rand(64), torch.randn(16, 64), group_size=48)
