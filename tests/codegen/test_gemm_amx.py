"""gemm_amx.c: the AMX 4-bit GEMM is batch-invariant, follows its stated fp32 sequence bit for bit, and
computes x @ W.T within the int8 rounding of its activations."""

import ctypes
import ctypes.util
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import amx_reference as ar  # noqa: E402

ROWS = (1, 6, 7, 16, 17, 22, 23, 64)   # 1-6 rows (and a tile's last 1-6) take VNNI, more AMX


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = ar.build(tmp_path_factory.mktemp("amx"))
    if not lib.llmc_amx_ready():
        pytest.skip("AMX-INT8 not usable here")
    return lib


def weights(rng, n, k, group, kind):
    """random stored weights: 'q4_1' fp16 scales and offsets (GGUF Q4_1), 'zero_point' fp16 scales with fp16
    zero points per row, 'shared_zero' fp32 scales with one zero-point row for all"""
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    groups = k // group
    scales = (rng.random((n, groups)) * 0.02 + 0.002).astype(np.float32)
    if kind == "q4_1":
        return packed, scales.astype(np.float16), (-rng.random((n, groups)) * 0.15).astype(np.float16), False
    if kind == "zero_point":
        return packed, scales.astype(np.float16), rng.integers(1, 15, (n, groups)).astype(np.float16), True
    return packed, scales, rng.integers(1, 15, (1, groups)).astype(np.float32), True


def activations(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.random((m, 1)).astype(np.float32) * 4
    x[:, rng.integers(0, k, 3)] *= 20   # a few outlier channels, as a model's
    return x


def same_bits(a, b):
    return np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
        np.where(np.isnan(a), 0, a).view(np.int32), np.where(np.isnan(b), 0, b).view(np.int32))


CASES = [(576, 576, 32, "q4_1"), (1536, 960, 32, "q4_1"), (576, 1536, 32, "zero_point"), (1536, 40, 128, "q4_1"),
         (576, 40, 32, "shared_zero"), (1536, 576, 128, "zero_point")]


@pytest.mark.parametrize("k,n,group,kind", CASES)
def test_each_row_is_the_same_bits_at_any_batch_size_and_position(lib, k, n, group, kind):
    rng = np.random.default_rng(k + n + group)
    packed, scales, other, zp = weights(rng, n, k, group, kind)
    tiles = ar.repack(lib, packed, scales, other, zp)
    x = activations(rng, max(ROWS), k)
    alone = np.concatenate([ar.gemm(lib, x[r:r + 1], tiles, n, group, zp) for r in range(max(ROWS))])
    for m in ROWS:
        for start in (0, max(ROWS) - m):   # the rows at the front and at the back of a batch
            assert same_bits(ar.gemm(lib, x[start:start + m], tiles, n, group, zp), alone[start:start + m])
    shuffled = rng.permutation(max(ROWS))
    assert same_bits(ar.gemm(lib, x[shuffled], tiles, n, group, zp, threads=1), alone[shuffled])


@pytest.mark.parametrize("k,n,group,kind", CASES)
def test_outputs_are_the_reference_sequence_bit_for_bit(lib, k, n, group, kind):
    rng = np.random.default_rng(7 * k + n)
    packed, scales, other, zp = weights(rng, n, k, group, kind)
    x = activations(rng, 17, k)
    y = ar.gemm(lib, x, ar.repack(lib, packed, scales, other, zp), n, group, zp)
    assert same_bits(y, ar.reference(x, packed, scales, other, zp))


@pytest.mark.parametrize("k,n,group,kind", CASES)
def test_outputs_match_fp32_matmul_within_int8_activation_rounding(lib, k, n, group, kind):
    rng = np.random.default_rng(3 * k + n)
    packed, scales, other, zp = weights(rng, n, k, group, kind)
    x = activations(rng, 16, k)
    y = ar.gemm(lib, x, ar.repack(lib, packed, scales, other, zp), n, group, zp).astype(np.float64)
    exact = x.astype(np.float64) @ ar.dequantise(packed, scales, other, zp).T
    # each int8 code errs by at most half its block's scale: |y - exact| <= sum_b sx_b / 2 * sum_{i in b} |w_i|
    w = ar.dequantise(packed, scales, other, zp)
    _, sx, _ = ar.quantise(x, group)
    bound = (sx / 2) @ np.abs(w).reshape(n, k // 32, 32).sum(-1).T
    assert (np.abs(y - exact) <= 1.01 * bound + 1e-5 * np.abs(exact).max()).all()
    assert np.sqrt(((y - exact) ** 2).mean()) < 2e-2 * np.sqrt((exact ** 2).mean())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_activation_makes_only_its_row_nan(lib, bad):
    rng = np.random.default_rng(11)
    k, n, group = 576, 40, 32
    packed, scales, other, zp = weights(rng, n, k, group, "q4_1")
    tiles = ar.repack(lib, packed, scales, other, zp)
    x = activations(rng, 17, k)
    clean = ar.gemm(lib, x, tiles, n, group, zp)
    x[5, 100] = bad
    y = ar.gemm(lib, x, tiles, n, group, zp)
    assert np.isnan(y[5]).all()
    assert same_bits(np.delete(y, 5, 0), np.delete(clean, 5, 0))


def test_tiny_and_zero_blocks_round_as_the_reference(lib):
    rng = np.random.default_rng(5)
    k, n, group = 576, 40, 32
    packed, scales, other, zp = weights(rng, n, k, group, "q4_1")
    x = activations(rng, 3, k)
    x[0, :32] = 0
    x[1, 64:96] *= 1e-32   # a block below where 127 / max overflows: divided by its scale instead
    y = ar.gemm(lib, x, ar.repack(lib, packed, scales, other, zp), n, group, zp)
    assert same_bits(y, ar.reference(x, packed, scales, other, zp))


def test_repacked_fp16_weights_take_no_more_bytes_than_stored(lib):
    n, k, group = 960, 576, 32
    stored = n * k // 2 + 2 * n * (k // group) * 2
    assert lib.llmc_q4_tiles_bytes(n, k, group, 1, k // group) <= stored + 64


def test_mismatched_shapes_are_declined(lib):
    rng = np.random.default_rng(2)
    packed, scales, other, zp = weights(rng, 40, 576, 32, "q4_1")
    tiles = ar.repack(lib, packed, scales, other, zp)
    x = activations(rng, 2, 576)
    assert ar.gemm(lib, x, tiles, 48, 32, zp) is None
    assert ar.gemm(lib, x, tiles, 40, 32, True) is None


def test_fma32_rounds_once_where_a_float64_sum_would_round_twice():
    # a * b + c = 1 + 2^-24 + 2^-54: just above a float32 tie, which the float64 sum rounds onto
    a, b, c = np.float32(-2.0 ** -24 * (1 - 2.0 ** -15)), np.float32(1 + 2.0 ** -15), np.float32(1 + 2.0 ** -23)
    assert ar.fma32(a, b, c) == np.float32(1 + 2.0 ** -23)
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1)


def test_fma32_agrees_with_the_c_library():
    fmaf = ctypes.CDLL(ctypes.util.find_library("m")).fmaf
    fmaf.argtypes, fmaf.restype = [ctypes.c_float] * 3, ctypes.c_float
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(2000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, 2000)
               for _ in range(3))
    c[::2] = -(a[::2].astype(np.float64) * b[::2]).astype(np.float32)   # cancelling: the hard cases
    want = np.array([fmaf(*v) for v in zip(a.tolist(), b.tolist(), c.tolist())], np.float32)
    assert same_bits(ar.fma32(a, b, c), want)


STORED_ROWS = (1, 6, 9, 16, 23, 64)


@pytest.mark.parametrize("k,n,group,kind", CASES + [(8192, 40, 32, "q4_1")])
def test_the_stored_weights_give_the_tiles_bits_at_any_row_count(lib, k, n, group, kind):
    """llmc_gemm_q4_stored transposes the codes as stored: the reference's bits, as from tiles (a K past
    one 16 x 16 transpose's 4 blocks and not a multiple of them: 576 = 18 blocks)"""
    rng = np.random.default_rng(5 * k + n)
    packed, scales, other, zp = weights(rng, n, k, group, kind)
    tiles = ar.repack(lib, packed, scales, other, zp)
    x = activations(rng, max(STORED_ROWS), k)
    want = ar.reference(x, packed, scales, other, zp)
    for m in STORED_ROWS:
        assert same_bits(ar.gemm_stored(lib, x[:m], packed, scales, other, zp), want[:m])
        assert same_bits(ar.gemm(lib, x[:m], tiles, n, group, zp), want[:m])


def k_quant_rows(rng, n, groups, subs, offsets: bool):
    """K-quant packed params [n, 2 * groups / subs + groups] bytes (per row the super-blocks' fp16 factors,
    then one int8 per group, the group's value their product) and those values as fp32 [n, groups]"""
    factors = (rng.random((n, groups // subs)) * (0.01 if not offsets else 0.003) + 1e-3).astype(np.float16)
    ints = rng.integers(0 if not offsets else -63, 64, (n, groups), dtype=np.int8)
    values = np.repeat(factors.astype(np.float32), subs, 1) * ints.astype(np.float32)
    if offsets:
        values = -values
        factors = -factors
    return np.concatenate([factors.view(np.uint8), ints.view(np.uint8)], 1), values.astype(np.float32)


@pytest.mark.parametrize("subs", [8, 16])
def test_k_quant_packed_params_are_read_as_their_fp32_values(lib, subs):
    """Q4_K's groups of 32 (8 a super-block of 256; 16 as Q6_K's): the packed params give the bits of their
    fp32 values"""
    rng = np.random.default_rng(subs)
    n, k, group = 40, 1024, 32
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s_packed, s = k_quant_rows(rng, n, k // group, subs, False)
    o_packed, o = k_quant_rows(rng, n, k // group, subs, True)
    x = activations(rng, 20, k)
    want = ar.reference(x, packed, s, o, False)
    for m in (1, 20):
        assert same_bits(ar.gemm_stored(lib, x[:m], packed, s_packed, o_packed, False, fmt=subs), want[:m])
