"""The CPU qlinear's dense path (codegen/torch_cpu/cpu_qlinear_dense.py: dequantise into a reused scratch,
one fp32 GEMM) equals compiler.ops.qlinear_ref bit for bit in every scheme; the kernel takes it
from the row count chosen at load (forced here through LLMC_QLINEAR_DENSE_FROM, or measured) and
keeps the packed low-bit kernel below it."""

import pytest
import torch

from llmc.codegen.native import cpu_native
from llmc.codegen.torch_cpu import cpu_qlinear_dense as dense
from llmc.codegen.torch_cpu.cpu_kernels import prepare_qlinear, qlinear
from llmc.codegen.torch_cpu.cpu_qlinear_dense import (
    DispatchedWeights,
    dense_source,
    measure_shape,
    q4_source,
    run_dense,
)
from llmc.compiler.ops import qlinear_ref
from llmc.compiler.quant import pack_int4, quantize_fp8, quantize_int4, quantize_int8
from llmc.errors import RuntimeLlmcError


def stored(scheme, n, k, seed):
    """(qweight, scales, zeros, act_scale) as each scheme's pass stores them, and the attrs."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    attrs = {"scheme": scheme, "in_features": k, "out_features": n, "group_size": -1, "has_zeros": False,
             "has_act_scale": False, "has_bias": False}
    if scheme in ("int8", "w8a8"):
        return (*quantize_int8(w), None, None), attrs
    if scheme == "fp8":
        q, s = quantize_fp8(w)
        return (q, s, None, torch.tensor([0.05])), {**attrs, "has_act_scale": True}
    if scheme == "int4":
        codes, s, z = quantize_int4(w, 32)
        return (pack_int4(codes), s, z, None), {**attrs, "group_size": 32, "has_zeros": True}
    codes = torch.randint(0, 16, (n, k), generator=gen)
    s = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    spread = 1 + 0.2 * torch.rand(s.shape, generator=gen)
    mins = None if scheme == "affine4-q4_0" else (-8 * s.float() * spread).half()
    return (pack_int4(codes), s, mins, None), {**attrs, "scheme": "affine4", "group_size": 32,
                                               "has_zeros": mins is not None}


SCHEMES = ["int8", "w8a8", "fp8", "int4", "affine4", "affine4-q4_0"]


def inputs_of(params, attrs, x):
    qweight, scales, zeros, act = params
    return [x, qweight, scales] + ([zeros] if attrs["has_zeros"] else []) + ([act] if attrs["has_act_scale"] else [])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dense_path_is_the_reference_bit_for_bit(scheme):
    params, attrs = stored(scheme, 48, 128, seed=len(scheme))
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(1))
    want = qlinear_ref(*inputs_of(params, attrs, x), **attrs)[0]
    got = run_dense(x, dense_source(attrs["scheme"], *params))
    assert got.shape == (2, 9, 48) and torch.equal(got, want)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_weight_over_the_block_budget_is_multiplied_a_block_of_rows_at_a_time(scheme, monkeypatch):
    """Blocks of 20 output rows (the last short): each row's dot products as the whole weight's."""
    from llmc.codegen.torch_cpu import cpu_qlinear_dense

    params, attrs = stored(scheme, 48, 128, seed=len(scheme) + 3)
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(4))
    want = qlinear_ref(*inputs_of(params, attrs, x), **attrs)[0]
    monkeypatch.setattr(cpu_qlinear_dense, "DENSE_BLOCK_BYTES", 20 * 4 * 128)
    got = run_dense(x, dense_source(attrs["scheme"], *params))
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme", ["int4", "affine4", "affine4-q4_0"])
def test_dense_path_from_the_native_form_is_the_reference_bit_for_bit(scheme):
    """A 4-bit weight held only in the native GEMV's form (a shared zero point as one row) dequantises to
    the reference's weight."""
    params, attrs = stored(scheme, 48, 128, seed=len(scheme) + 7)
    qweight, scales, zeros, _ = params
    second, zero_point = (zeros, True) if scheme == "int4" else (8, True) if zeros is None else (zeros, False)
    native = cpu_native.q4_weights(qweight, scales, second, zero_point)
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(2))
    want = qlinear_ref(*inputs_of(params, attrs, x), **attrs)[0]
    assert torch.equal(run_dense(x, q4_source(attrs["scheme"], native)), want)


@pytest.mark.parametrize("scheme", ["int8", "int4", "affine4", "w8a8"])
def test_kernel_switches_to_dense_from_the_chosen_row_count(scheme, monkeypatch):
    monkeypatch.setenv(dense.DENSE_FROM_ENV, "8")
    params, attrs = stored(scheme, 32, 64, seed=3)
    extra = prepare_qlinear([None, *inputs_of(params, attrs, None)[1:]], attrs)
    weights = extra["cpu_weights"]
    assert isinstance(weights, DispatchedWeights) and weights.dense_from == 8
    for rows in (1, 7, 8, 20):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        ins = inputs_of(params, attrs, x)
        got = qlinear(*ins, **attrs, **extra)[0]
        packed = qlinear(*ins, **attrs, cpu_weights=weights.packed)[0]
        reference = qlinear_ref(*ins, **attrs)[0]
        # few rows take the native GEMV where it is built: fp32 arithmetic near the reference, or int16
        # activation codes (K = 64 here) within their rounding, 2^-16 of a block's largest
        native = extra.get("native_gemv") and cpu_native.gemv(x, extra["native_gemv"])
        below = packed if native is None else native
        assert torch.equal(got, reference if rows >= 8 else below)
        if native is not None and rows < 8:
            tolerance = 1e-4 if cpu_native.int16_activations() else 1e-5
            assert (native - reference).abs().max() / reference.abs().max() < tolerance


def test_a_bad_forced_row_count_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(dense.DENSE_FROM_ENV, "many")
    params, attrs = stored("int8", 16, 64, seed=4)
    with pytest.raises(RuntimeLlmcError, match="LLMC_QLINEAR_DENSE_FROM='many'"):
        prepare_qlinear([None, *inputs_of(params, attrs, None)[1:]], attrs)


def test_measurement_times_both_paths_and_picks_a_probed_row_count():
    params, attrs = stored("affine4", 64, 128, seed=5)
    src = dense_source("affine4", *params)
    record = measure_shape(lambda x: x @ torch.zeros(128, 64), src, repeats=1)
    timed = list(record["us"]["packed"])
    assert timed == list(record["us"]["dense"]) and timed[0] == "1"
    assert record["dense_from"] in dense.PROBE_ROWS + (dense.NEVER_DENSE,)

