"""gemm_amx.c built and bound with ctypes, and a numpy reference of its arithmetic in the same order."""

import ctypes
import subprocess
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parents[2] / "codegen" / "native" / "gemm_amx.c"
F32 = np.float32
I64 = ctypes.c_int64
P = ctypes.c_void_p


def build(directory: Path) -> ctypes.CDLL:
    """compile gemm_amx.c as the runtime would (cc -O3 -march=native -fopenmp) into `directory` and load it"""
    lib_path = Path(directory) / "gemm_amx.so"
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(lib_path), str(SOURCE)],
                   check=True)
    lib = ctypes.CDLL(str(lib_path))
    for name, args in (("llmc_amx_ready", []), ("llmc_q4_tiles_bytes", [I64] * 5),
                       ("llmc_q4_repack", [P, P, P] + [I64] * 6 + [P, I64]),
                       ("llmc_gemm_q4_amx", [P, I64, I64, P] + [I64] * 4 + [P, I64]),
                       ("llmc_gemm_q4_stored", [P, I64, I64, P, P, P] + [I64] * 6 + [P, I64])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, I64
    return lib


def repack(lib, packed: np.ndarray, scales: np.ndarray, other: np.ndarray, zero_point: bool, threads: int = 2):
    """the stored weights (packed uint8 [N, K/2], scales [N, G], other [N or 1, G], both fp16 or fp32) as tiles"""
    n, k, groups = packed.shape[0], 2 * packed.shape[1], scales.shape[1]
    f16, other_row = scales.dtype == np.float16, 0 if other.shape[0] == 1 else groups
    size = lib.llmc_q4_tiles_bytes(n, k, k // groups, f16, other_row)
    tiles = np.zeros(size + 64, np.uint8)   # + 64: room to align the start to a cache line
    start = (-tiles.ctypes.data) % 64
    tiles = tiles[start:start + size]
    done = lib.llmc_q4_repack(packed.ctypes.data, scales.ctypes.data, other.ctypes.data, other_row, f16, zero_point,
                              n, k, k // groups, tiles.ctypes.data, threads)
    assert done == size
    return tiles


def gemm_stored(lib, x: np.ndarray, packed: np.ndarray, scales: np.ndarray, other: np.ndarray, zero_point: bool,
                threads: int = 2, fmt: int | None = None):
    """y [m, n] fp32 from llmc_gemm_q4_stored on the weights as stored (params fp32 or fp16, or K-quant
    packed uint8 rows with `fmt` groups a super-block and `groups` the group count), or None where it declined"""
    m, k = x.shape
    n = packed.shape[0]
    fmt = (0 if scales.dtype == np.float32 else 1) if fmt is None else fmt
    groups = scales.shape[1] if fmt < 2 else scales.shape[1] * fmt // (fmt + 2)
    y = np.empty((m, n), F32)
    ok = lib.llmc_gemm_q4_stored(x.ctypes.data, x.strides[0] // 4, m, packed.ctypes.data, scales.ctypes.data,
                                 other.ctypes.data, 0 if other.shape[0] == 1 else 1, fmt, zero_point, n, k,
                                 k // groups, y.ctypes.data, threads)
    return y if ok else None


def gemm(lib, x: np.ndarray, tiles: np.ndarray, n: int, group: int, zero_point: bool, threads: int = 2):
    """y [m, n] fp32 from llmc_gemm_q4_amx, or None where it declined"""
    m, k = x.shape
    y = np.empty((m, n), F32)
    ok = lib.llmc_gemm_q4_amx(x.ctypes.data, x.strides[0] // 4, m, tiles.ctypes.data, n, k, group, zero_point,
                              y.ctypes.data, threads)
    return y if ok else None


def fma32(a, b, c):
    """float32 fma(a, b, c), correctly rounded. The product of two float32s is exact in float64, but a float64
    sum rounded again to float32 rounds twice (wrong where the first rounding lands on a float32 tie); so
    the sum is taken round-to-odd (its exact error by TwoSum; an inexact sum with an even last bit moves one
    float64 ulp towards the exact value), which with 53 >= 24 + 2 bits then rounds to float32 correctly."""
    a, b, c = (np.asarray(v, F32).astype(np.float64) for v in (a, b, c))
    p = a * b
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        fix = np.isfinite(s) & (err != 0) & ((s.view(np.int64) & 1) == 0)
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(F32)


def quantise(x: np.ndarray, group: int):
    """gemm_amx.c's (and quantise_row8's) int8 codes [m, K/32, 32], block scales [m, K/32] and group sums [m, G]"""
    m, k = x.shape
    xb = x.astype(F32).reshape(m, k // 32, 32)
    a = np.abs(xb)
    bad = ~(a <= np.finfo(F32).max).all(-1)   # an inf or nan in the block
    top = np.where(bad[..., None], F32(0), a).max(-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.where(bad, F32(np.nan), top / F32(127)).astype(F32)
        inv = np.where(bad | (top == 0), F32(0), F32(127) / top).astype(F32)
        tiny = ~bad & (top > 0) & (top < F32(1e-30))
        c = np.where(tiny[..., None], xb / scale[..., None], xb * inv[..., None])
    codes = np.where(bad[..., None], 0, np.clip(np.rint(c), -128, 127)).astype(np.int64)
    totals = codes.sum(-1).astype(F32)
    per = group // 32
    sums = np.zeros((m, k // group), F32)
    for g in range(k // group):
        for b in range(g * per, (g + 1) * per):
            sums[:, g] = fma32(scale[:, b], totals[:, b], sums[:, g])
    return codes, scale, sums


def unpack(packed: np.ndarray) -> np.ndarray:
    """4-bit codes [N, K] from bytes [N, K/2] (code 2j in byte j's low nibble)"""
    return np.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)


def reference(x, packed, scales, other, zero_point: bool) -> np.ndarray:
    """y [m, N] by gemm_amx.c's sequence: per (row, column) acc = fma(D_b, s * sx_b, acc) over blocks in order,
    then acc = fma(o_g, sums_g, acc) over groups, o = m or -(s * z)"""
    m, k = x.shape
    n, groups = scales.shape[0], scales.shape[1]
    group = k // groups
    codes, sx, sums = quantise(x, group)
    q = unpack(packed).astype(np.int64).reshape(n, k // 32, 32)
    d = np.einsum("rbi,cbi->rcb", codes, q).astype(F32)   # exact: |D| < 2^24
    s = scales.astype(F32)
    o = np.broadcast_to(other.astype(F32), s.shape)
    if zero_point:
        o = -(s * o)
    acc = np.zeros((m, n), F32)
    for b in range(k // 32):
        acc = fma32(d[:, :, b], s[None, :, b * 32 // group] * sx[:, b, None], acc)
    for g in range(groups):
        acc = fma32(o[None, :, g], sums[:, g, None], acc)
    return acc


def dequantise(packed, scales, other, zero_point: bool) -> np.ndarray:
    """W [N, K] in float64 as the 4-bit format defines it"""
    q = unpack(packed).astype(np.float64)
    n, k = q.shape
    group = k // scales.shape[1]
    s = np.repeat(scales.astype(np.float64), group, 1)
    o = np.repeat(np.broadcast_to(other.astype(np.float64), scales.shape), group, 1)
    return (q - o) * s if zero_point else q * s + o
