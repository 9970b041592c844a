"""GPTQ against an unbatched float64 OBS reference and against round-to-nearest, on weights
and activations shaped like a transformer's (N(0, 0.02) weights, correlated inputs with a few
outlier channels 10-50x larger)."""

import pytest
import torch

from llmc.compiler.quant import dequantize_int4_codes, int4_grid, quantize_int4
from llmc.errors import PassError
from llmc.passes.gptq import HessianAccumulator, clipped_grid, gptq_quantize_weight


def make_layer(seed, n=128, k=256, outliers=4, dtype=torch.float64):
    """(weight [n, k], sample(tokens) -> activations [tokens, k]) of one synthetic linear."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.eye(k, dtype=dtype) + torch.randn(k, k, generator=gen, dtype=dtype) / k ** 0.5
    low_rank = torch.randn(16, k, generator=gen, dtype=dtype)
    channel = torch.ones(k, dtype=dtype)
    channel[torch.randperm(k, generator=gen)[:outliers]] = \
        10 + 40 * torch.rand(outliers, generator=gen, dtype=dtype)
    weight = 0.02 * torch.randn(n, k, generator=gen, dtype=dtype)

    def sample(tokens):
        x = torch.randn(tokens, k, generator=gen, dtype=dtype) @ mix
        x = x + torch.randn(tokens, 16, generator=gen, dtype=dtype) @ low_rank
        return x * channel
    return weight, sample


def hessian_of(x):
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.hessian()


def output_error(x, weight, q_weight):
    x = x.double()
    return torch.linalg.norm(x @ weight.double().T - x @ q_weight.double().T).item()


def obs_reference(weight, hessian, bits, g, act_order, damp, grid=None):
    """GPTQ without Cholesky or lazy batches, in float64: after fixing column c, update every
    remaining column by the OBS formula and eliminate c from the explicit inverse Hessian."""
    w, h = weight.double().clone(), hessian.double().clone()
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(h.diagonal(), descending=True, stable=True).tolist() if act_order \
        else list(range(w.shape[1]))
    energy = h.diagonal().clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    hinv = torch.linalg.inv(h)
    n, k = w.shape
    q, scales, zeros = torch.zeros(n, k), torch.zeros(n, k // g), torch.zeros(n, k // g)
    started = set()
    for c in order:
        grp = c // g
        if grp not in started:
            started.add(grp)
            cols = slice(grp * g, (grp + 1) * g)
            scales[:, grp], zeros[:, grp] = (grid or (lambda x, _: int4_grid(x, bits)))(w[:, cols], energy[cols])
        s, z = scales[:, grp].double(), zeros[:, grp].double()
        q[:, c] = torch.clamp(torch.round(w[:, c] / s) + z, 0, 2 ** bits - 1).float()
        e = (w[:, c] - (q[:, c].double() - z) * s) / hinv[c, c]
        w -= torch.outer(e, hinv[c])
        hinv -= torch.outer(hinv[:, c], hinv[c]) / hinv[c, c]
    return q.to(torch.uint8), scales, zeros


def test_hessian_accumulator_streams_batches_into_xtx_over_n():
    _, sample = make_layer(0, k=64)
    x = sample(300).float()
    acc = HessianAccumulator(64)
    acc.add(x[:100].reshape(4, 25, 64))
    acc.add(x[100:])
    expected = x.double().T @ x.double() / 300
    assert acc.tokens == 300
    torch.testing.assert_close(acc.hessian(), expected, rtol=1e-12, atol=1e-12)


def test_hessian_accumulator_rejects_wrong_width_and_no_tokens():
    acc = HessianAccumulator(64)
    with pytest.raises(PassError, match="in_features=64"):
        acc.add(torch.randn(5, 32))
    with pytest.raises(PassError, match="no calibration tokens"):
        acc.hessian()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block_size", [16, 48, 128])
def test_gptq_matches_unbatched_obs_reference(act_order, block_size):
    weight, sample = make_layer(1, n=24, k=96)
    hessian = hessian_of(sample(512))
    q, scales, zeros = gptq_quantize_weight(weight, hessian, group_size=32, act_order=act_order,
                                            block_size=block_size)
    ref_q, ref_scales, ref_zeros = obs_reference(weight, hessian, 4, 32, act_order, 0.01)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    assert torch.equal(zeros, ref_zeros)
    assert torch.equal(q, ref_q)


def shrink_error(row, importance, factor):
    """(weighted squared error, scale, zero) of `row` on its min/max grid shrunk by `factor`,
    in float64 (the scale rounded through float32, as stored)."""
    lo, hi = min((row * factor).min().item(), 0.0), max((row * factor).max().item(), 0.0)
    s = torch.tensor((hi - lo) / 15).float().double()
    z = torch.clamp(torch.round(-lo / s), 0, 15)
    x_hat = (torch.clamp(torch.round(row / s) + z, 0, 15) - z) * s
    return ((row - x_hat) ** 2 * importance.double()).sum().item(), s, z


def brute_force_clip(x, importance, steps=100, max_shrink=0.8, coarse=1):
    """Per row, each shrink factor 1 - step/steps tried on its own in float64, the first of the
    least weighted squared errors winning: every step (coarse=1), or every coarse-th step and
    then the steps within coarse - 1 of the best of those."""
    last = int(max_shrink * steps) - 1
    scales, zeros = torch.zeros(x.shape[0]), torch.zeros(x.shape[0])
    for r in range(x.shape[0]):
        row = x[r].double()
        error = {step: shrink_error(row, importance, 1 - step / steps) for step in range(last + 1)}
        best = min(range(0, last + 1, coarse), key=lambda step: (error[step][0], step))
        near = range(max(best - coarse + 1, 0), min(best + coarse, last + 1))
        best = min(near, key=lambda step: (error[step][0], step))
        scales[r], zeros[r] = error[best][1], error[best][2]
    return scales, zeros


def clip_error(x, importance, scales, zeros):
    s, z = scales.double()[:, None], zeros.double()[:, None]
    x_hat = (torch.clamp(torch.round(x / s) + z, 0, 15) - z) * s
    return ((x - x_hat) ** 2 * importance).sum(1)


def outlier_groups(seed, rows=12):
    gen = torch.Generator().manual_seed(seed)
    x = 0.02 * torch.randn(rows, 32, generator=gen, dtype=torch.float64)
    x[:4, 5] = 0.2                                   # an outlier worth clipping in some rows
    return x, torch.rand(32, generator=gen, dtype=torch.float64) + 0.1


def test_clipped_grid_is_the_coarse_to_fine_least_weighted_error_shrink_of_each_row():
    x, importance = outlier_groups(3)
    scales, zeros = clipped_grid(x, importance)
    ref_scales, ref_zeros = brute_force_clip(x, importance, coarse=4)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    assert torch.equal(zeros, ref_zeros)
    assert bool((scales[:4] < int4_grid(x[:4])[0]).all())   # the outlier rows were clipped


def test_clipped_grid_with_coarse_1_is_the_exhaustive_search():
    x, importance = outlier_groups(4)
    scales, zeros = clipped_grid(x, importance, coarse=1)
    ref_scales, ref_zeros = brute_force_clip(x, importance)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    assert torch.equal(zeros, ref_zeros)


def test_coarse_to_fine_clip_is_nearly_as_good_as_the_exhaustive_search():
    weight, sample = make_layer(5, n=256, k=128)
    groups = weight.reshape(-1, 32)
    importance = hessian_of(sample(512)).diagonal()[:32]
    exhaustive = clip_error(groups, importance, *brute_force_clip(groups, importance))
    fast = clip_error(groups, importance, *clipped_grid(groups, importance))
    rtn = clip_error(groups, importance, *int4_grid(groups))
    assert bool((fast >= exhaustive * (1 - 1e-9)).all())
    assert fast.sum() / exhaustive.sum() < 1.01, f"{fast.sum() / exhaustive.sum():.4f}"
    assert fast.sum() / rtn.sum() < 0.9


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_clip_matches_obs_reference_with_brute_force_clip(act_order):
    weight, sample = make_layer(2, n=16, k=64)
    hessian = hessian_of(sample(512))
    q, scales, zeros = gptq_quantize_weight(weight, hessian, group_size=32, act_order=act_order, clip=True)
    ref_q, ref_scales, ref_zeros = obs_reference(weight, hessian, 4, 32, act_order, 0.01,
                                                 grid=lambda x, h: brute_force_clip(x, h, coarse=4))
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    assert torch.equal(zeros, ref_zeros) and torch.equal(q, ref_q)


def held_out_error_ratios(seeds, option: str, **fixed) -> list[float]:
    """Per seed, GPTQ's held-out output error with `option` on over the error with it off."""
    ratios = []
    for seed in seeds:
        weight, sample = make_layer(seed)
        hessian, held_out = hessian_of(sample(2048)), sample(512)
        errors = [output_error(held_out, weight, dequantize_int4_codes(*gptq_quantize_weight(
            weight.float(), hessian, group_size=64, **fixed, **{option: on}))) for on in (False, True)]
        ratios.append(errors[1] / errors[0])
    return ratios


def test_clip_lowers_gptq_held_out_error_on_average():
    ratios = held_out_error_ratios(range(50, 54), "clip", act_order=True)
    assert sum(ratios) / len(ratios) < 0.8, f"clip/min-max error ratios {ratios}"


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_gptq_output_error_is_well_below_rtn(seed):
    weight, sample = make_layer(seed)
    hessian = hessian_of(sample(2048))
    held_out = sample(512)
    rtn = output_error(held_out, weight, dequantize_int4_codes(*quantize_int4(weight, 64)))
    gptq, gptq_act_order = (output_error(held_out, weight, dequantize_int4_codes(
        *gptq_quantize_weight(weight.float(), hessian, group_size=64, act_order=a)))
        for a in (False, True))
    assert gptq / rtn < 0.85, f"GPTQ/RTN output error {gptq / rtn:.3f}"
    assert gptq_act_order / rtn < 0.6, f"GPTQ (act_order)/RTN output error {gptq_act_order / rtn:.3f}"


def test_act_order_is_not_worse_on_average():
    ratios = held_out_error_ratios(range(20, 24), "act_order")
    assert sum(ratios) / len(ratios) <= 1.0, f"act_order/plain error ratios {ratios}"


def test_gptq_output_respects_int4_storage_format():
    weight, sample = make_layer(30, n=32, k=128)
    q, scales, zeros = gptq_quantize_weight(weight.float(), hessian_of(sample(512)), group_size=32)
    assert q.dtype == torch.uint8 and q.shape == (32, 128) and int(q.max()) <= 15
    assert scales.dtype == zeros.dtype == torch.float32
    assert scales.shape == zeros.shape == (32, 4)
    assert bool((scales > 0).all())
    assert torch.equal(zeros, zeros.round()) and 0 <= zeros.min() and zeros.max() <= 15
    # Nothing has been updated when the first group starts: its grid and first column are RTN's.
    rtn_q, rtn_scales, rtn_zeros = quantize_int4(weight.float(), 32)
    assert torch.equal(scales[:, 0], rtn_scales[:, 0]) and torch.equal(zeros[:, 0], rtn_zeros[:, 0])
    assert torch.equal(q[:, 0], rtn_q[:, 0])
    expected = (q[:, 40].float() - zeros[:, 1]) * scales[:, 1]
    assert torch.equal(dequantize_int4_codes(q, scales, zeros)[:, 40], expected)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_damping_on_rank_deficient_hessian_stays_finite(act_order):
    weight, sample = make_layer(40, n=32, k=128)
    x = sample(48)                  # fewer tokens than inputs: rank <= 48
    x[:, [3, 70, 100]] = 0.0        # dead input channels
    q, scales, zeros = gptq_quantize_weight(weight.float(), hessian_of(x), group_size=32,
                                            act_order=act_order)
    dequant = dequantize_int4_codes(q, scales, zeros)
    assert bool(torch.isfinite(scales).all() and torch.isfinite(zeros).all())
    assert bool((dequant[:, [3, 70, 100]] == 0).all())
    rtn = output_error(x, weight, dequantize_int4_codes(*quantize_int4(weight, 32)))
    assert output_error(x, weight, dequant) < rtn


def test_gptq_without_damping_on_singular_hessian_raises_pass_error():
    hessian = torch.full((64, 64), 4.0, dtype=torch.float64)     # every input the same
    weight = 0.02 * torch.randn(16, 64)
    with pytest.raises(PassError, match="damp"):
        gptq_quantize_weight(weight, hessian, group_size=32, damp=0.0)
    q, scales, zeros = gptq_quantize_weight(weight, hessian, group_size=32, damp=0.01)
    assert bool(torch.isfinite(dequantize_int4_codes(q, scales, zeros)).all())


def test_gptq_rejects_group_size_that_does_not_divide_k():
    with pytest.raises(PassError, match="group_size=48"):
        gptq_quantize_weight(torch.randn(8, 64), torch.eye(64, dtype=torch.float64),
                             group_size=48)


@pytest.mark.parametrize("seed", [40, 41])
def test_few_calibration_tokens_dampen_gptq_so_shifted_inputs_do_not_undo_it(seed):
    """Inputs unlike the calibration's (another layer's correlations and outlier channels, as
    held-out text differs from self-generated calibration text): GPTQ fitted on n tokens of a
    K x K Hessian loses badly to RTN there; dampening by K / n keeps it near RTN."""
    weight, calibration = make_layer(seed, k=512)
    _, shifted = make_layer(seed + 100, k=512)
    hessian, held_out = hessian_of(calibration(512)), shifted(1024)
    rtn = output_error(held_out, weight, dequantize_int4_codes(*quantize_int4(weight, 64)))
    plain, dampened = (output_error(held_out, weight, dequantize_int4_codes(*gptq_quantize_weight(
        weight.float(), hessian, group_size=64, act_order=True, tokens=tokens))) for tokens in (None, 512))
    assert plain / rtn > 1.4 and dampened / rtn < 1.15, (plain / rtn, dampened / rtn)


# -- the pass: layer by layer on a tiny model -------------------------------------------------
def tiny_llama_graph():
    from llmc.compiler.frontends import load_model
    from llmc.compiler.pipeline import trace_and_lower
    return trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)


def token_sequences(count, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (tokens,), generator=gen) for _ in range(count)]


def run_int4(graph, calibration, method):
    from llmc.passes.base import PassContext, PassManager
    from llmc.passes.registry import get_pass
    PassManager([get_pass("quantize_int4", group_size=32, method=method)],
                PassContext(calibration=calibration, echo=lambda *a: None)).run(graph)
    return graph


def stored_weight(graph, weight):
    from llmc.compiler.quant import dequantize_int4
    return dequantize_int4(*(graph.weights[f"{weight}.{k}"] for k in ("qweight", "scales", "zeros")))


def test_gptq_pass_takes_each_hessian_from_the_already_quantised_layers_before_it():
    """The down projection of the last layer, re-quantised by hand from inputs of the float
    graph with every earlier linear's stored weight put in (and only those), gives the very
    codes the pass stored: the Hessians are sequential, not the float model's."""
    from llmc.compiler.interpreter import interpret
    from llmc.passes.calibration_stats import prefill_inputs
    float_graph = tiny_llama_graph()
    calibration = token_sequences(4, 24, seed=5)
    quantised = run_int4(float_graph.copy(), calibration, "gptq")
    linears = [n for n in float_graph.nodes if n.op == "linear" and n.inputs[1] != "lm_head.weight"]
    target = linears[-1]
    earlier = {n.inputs[1]: stored_weight(quantised, n.inputs[1]) for n in linears[:-1]}
    k = float_graph.type_of(target.inputs[0]).shape[-1]
    sequential, floating = HessianAccumulator(k), HessianAccumulator(k)
    for ids in calibration:
        inputs = prefill_inputs(float_graph, ids, "test")
        for acc, weights in ((sequential, {**float_graph.weights, **earlier}), (floating, None)):
            x = interpret(float_graph, inputs, want=[target.inputs[0]], weights=weights)[target.inputs[0]]
            acc.add(x)
    weight = float_graph.weights[target.inputs[1]].float()
    codes = {name: dequantize_int4_codes(*gptq_quantize_weight(weight, acc.hessian(), group_size=32, clip=True,
                                                               act_order=True, tokens=acc.tokens))
             for name, acc in (("sequential", sequential), ("float", floating))}
    assert torch.equal(stored_weight(quantised, target.inputs[1]), codes["sequential"])
    assert not torch.equal(codes["sequential"], codes["float"])
