"""qlinear held in the native GEMV's form alone (codegen/native/cpu_native.py) wherever that form exists and the
GEMVs run: a 4-bit weight's codes, scales and zero points or offsets are read where they lie (mapped from
the artifact, as stored), and that one form serves every row count (decode rows, then MAX_ROWS rows a call
below the dense switch, then the dense GEMM dequantising from it); GGUF's 5- to 8-bit blocks without
minimums (affine8) are read as stored. Before, a 4-bit weight was held three times (stored, the GEMV's,
torch's int4 pack) and affine8 dequantised whole to fp32 (4x its bytes); until 2026-12-07 the GEMV's copy
was a nibble reorder made at load, whose fresh pages cost most of a 3B model's load. torch's int4 pack was
no faster from 8 to 128 rows on Llama-1B's projections (2048x2048 and 16384x2048, 2 threads, AVX-512):
0.47/0.79/3.1/6.5 ms against the chunked GEMV's 0.42/0.73/3.1/6.1 at 8/16/64/128 rows."""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmc.codegen.native import cpu_native
from llmc.codegen.torch_cpu.cpu_qlinear_dense import DenseSource, dense_source, q4_source, run_dense
from llmc.compiler.quant import AFFINE4_CENTRE


class NativeGemm(NamedTuple):
    """A qlinear's one packed form: the GEMV's weights, and the dense source made from them (or the
    stored codes, for int8 ones) where the GEMVs do not run."""
    weights: cpu_native.Q4Weights | cpu_native.Q8Weights
    dense: DenseSource


def native_gemv_weights(scheme: str, qweight, scales, zeros, activations: str = "int16", cached: bool = False):
    """The native GEMV's form of a qlinear's weights for decode rows (None: it has none): int8 codes
    w = q * s (per channel, or GGUF's Q8_0 blocks), int4 w = (q - z) * s, GGUF's 4-bit blocks w = q * s + m
    (or (q - 8) * s without minimums, Q4_0), the 4-bit ones on `activations` (cpu_native.Q4_ACTIVATIONS),
    `cached` where the model's weights fit the last-level cache; none either where the native kernels are
    not built."""
    if not cpu_native.available():
        return None
    if scheme in ("int8", "affine8") and zeros is None:
        return cpu_native.q8_weights(qweight, scales)
    if scheme == "int4" and zeros is not None:
        return cpu_native.q4_weights(qweight, scales, zeros, True, activations, cached)
    if scheme == "affine4":
        if zeros is None:
            return cpu_native.q4_weights(qweight, scales, AFFINE4_CENTRE, True, activations, cached)
        return cpu_native.q4_weights(qweight, scales, zeros, False, activations, cached)
    return None


def native_gemm(scheme: str, qweight, scales, zeros, native) -> NativeGemm | None:
    """The GEMV's weights as the qlinear's only packed form, for 4-bit codes and affine8 (int8 keeps
    torch's int8 pack, a view of the stored codes); None where there are none or the GEMVs cannot run
    at this thread count (torch's packed kernels then serve)."""
    if native is None or not cpu_native.gemv_runs():
        return None
    if type(native) is cpu_native.Q4Weights:
        return NativeGemm(native, q4_source(scheme, native))
    return NativeGemm(native, dense_source(scheme, qweight, scales, zeros, None)) if scheme == "affine8" else None


def run_native_gemm(x: torch.Tensor, w: NativeGemm, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype through the GEMVs on fp32 rows (the dense GEMM where they
    do not apply). Only outside batch-invariant mode (which runs cpu_native.gemm itself): many rows may
    round differently from a few."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = cpu_native.gemm(rows, w.weights, invariant=False)
    if y is None:
        return run_dense(x, w.dense, bias)
    out = y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


__all__ = ["NativeGemm", "native_gemv_weights", "native_gemm", "run_native_gemm"]
