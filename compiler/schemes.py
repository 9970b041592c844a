"""The quantisation schemes llmc stores, one row each: how a scheme's codes are stored, how its
scales group, what zero point it carries, what happens to the activations, its dequantisation
reference (compiler/quant.py) and which kernel families run it. Passes, codegen, runtime, export and
`llmc inspect` read these rows instead of keeping their own lists (docs/quantization.md has the layouts).
It imports only torch and compiler/quant.py, so every layer may read it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from llmc.compiler.quant import (
    KV_QMAX,
    dequantize_affine,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    kv_int4_group,
    kv_int4_row_bytes,
)

# zero points
NO_ZERO = "none"             # w = q * s, symmetric
INT_ZERO = "integer"         # w = (q - z) * s, z an integer code per group (required)
FLOAT_OFFSET = "float"       # w = q * s + m, m a float minimum per group (optional: a GGUF block may have none)
# what the activations go through on the way into the GEMM
FLOAT_ACTS = "float"
INT8_PER_TOKEN = "int8 per token"      # quantised per row on the fly (SmoothQuant's w8a8)
FP8_STATIC = "fp8 static"              # through fp8 at a static per-tensor scale, where the node has act_scale
# kernel families (codegen): torch operators on CPU, native C GEMVs, ONNX Runtime segments, Triton on GPUs
TORCH = "torch"
NATIVE = "native"
ORT = "ort"
TRITON = "triton"
FAMILIES = (TORCH, NATIVE, ORT, TRITON)


@dataclass(frozen=True)
class Scheme:
    """One weight quantisation scheme of qlinear (and of qembedding, qmoe where they take it)."""
    name: str
    bits: int                    # the bits a code is stored in (affine8 also holds GGUF's 5- and 6-bit codes)
    code_dtype: str              # the IR dtype qweight is stored in
    packed: bool                 # two codes a byte (uint8 [N, K/2], low nibble first)
    grouped: bool                # scales (and zero points) per group of group_size along K, else per output channel
    per_tensor: bool             # may instead hold one scale [1] for the whole weight (fp8's per-tensor recipe)
    zero_point: str              # NO_ZERO, INT_ZERO or FLOAT_OFFSET
    activations: str             # FLOAT_ACTS, INT8_PER_TOKEN or FP8_STATIC
    reference: Callable          # compiler/quant.py's dequantisation of the stored codes
    gguf: bool                   # a GGUF file's blocks kept as stored (fp16 scales and minimums allowed)
    qembedding: bool             # an embedding table may be stored so
    qmoe: bool                   # MoE experts may be stored so
    families: frozenset[str]     # the kernel families with a kernel for it
    exports: bool                # `llmc export` translates it to ONNX

    @property
    def codes_per_element(self) -> int:
        """How many K columns one stored element of qweight holds."""
        return 2 if self.packed else 1

    @property
    def zeros_required(self) -> bool:
        return self.zero_point == INT_ZERO

    @property
    def scale_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes its scales (and zeros, act_scale) may be stored in: a GGUF's own fp16 stay fp16."""
        return (torch.float32, torch.float16) if self.gguf else (torch.float32,)

    def dequantize(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight the stored params stand for, by the reference."""
        if self.zero_point == NO_ZERO:
            return self.reference(qweight, scales, dtype)
        return self.reference(qweight, scales, zeros, dtype)


def _row(name, bits, code_dtype, reference, *, packed=False, grouped=False, per_tensor=False, zero_point=NO_ZERO,
         activations=FLOAT_ACTS, gguf=False, qembedding=False, qmoe=False, families=(), exports=False) -> Scheme:
    return Scheme(name, bits, code_dtype, packed, grouped, per_tensor, zero_point, activations, reference, gguf,
                  qembedding, qmoe, frozenset(families), exports)


_ALL = (TORCH, NATIVE, ORT, TRITON)
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    _row("int8", 8, "int8", dequantize_int8, qembedding=True, qmoe=True, families=_ALL, exports=True),
    _row("int4", 4, "uint8", dequantize_int4, packed=True, grouped=True, zero_point=INT_ZERO, qembedding=True,
         qmoe=True, families=_ALL, exports=True),
    _row("fp8", 8, "float8_e4m3fn", dequantize_fp8, per_tensor=True, activations=FP8_STATIC,
         families=(TORCH, TRITON)),
    _row("w8a8", 8, "int8", dequantize_int8, activations=INT8_PER_TOKEN, families=(TORCH, ORT, TRITON)),
    # GGUF's block formats: affine4 codes 0..15 (centred at 8 without minimums, Q4_0), affine8 -128..127
    _row("affine4", 4, "uint8", functools.partial(dequantize_affine, "affine4"), packed=True, grouped=True,
         zero_point=FLOAT_OFFSET, gguf=True, qembedding=True, families=_ALL, exports=True),
    _row("affine8", 8, "int8", functools.partial(dequantize_affine, "affine8"), grouped=True,
         zero_point=FLOAT_OFFSET, gguf=True, qembedding=True, families=_ALL, exports=True),
)}


def schemes_where(**want) -> tuple[str, ...]:
    """The names of the schemes whose fields equal `want` (family=X: those family X serves), in table order."""
    family = want.pop("family", None)
    return tuple(s.name for s in SCHEMES.values()
                 if (family is None or family in s.families) and all(getattr(s, k) == v for k, v in want.items()))


def scheme(name: str) -> Scheme:
    """The row of `name`; an unknown name is a bug of the caller (the IR verifier refuses it first)."""
    if name not in SCHEMES:
        raise ValueError(f"unknown quantisation scheme {name!r}; known: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def dequantize_weight(name: str, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight a qlinear's stored params stand for."""
    return scheme(name).dequantize(qweight, scales, zeros, dtype)


# -- KV-cache formats -------------------------------------------------------------------------------
# int8/fp8: a head's static scale (calibrated) maps its absmax to the storage's largest code; int8 rounds
# to nearest, fp8 casts; both saturate (compiler/quant.py's fake_quant_kv, runtime/kv_quant.py).
# int4: 4 bits leave too few levels for one static scale over every token and channel of a head (a
# token's keys far below the head's calibrated absmax would round to a handful of codes), so each token,
# KV head and group of kv_int4_group(head_dim) channels (32, as llama.cpp's q4_0 KV blocks along head_dim)
# gets a dynamic fp16 scale, computed on write: no calibration, and an outlier channel costs only its
# group (fake_quant_kv_int4). Per-channel key scales (KIVI) need statistics across tokens that a
# streaming paged cache does not have at write time.
@dataclass(frozen=True)
class KvFormat:
    name: str                    # what --kv-cache names
    storage: str                 # the attention nodes' `kv_cache` attr: the codes' dtype name
    # False: one static scale per layer and KV head; True: a dynamic fp16 scale per token, KV head and
    # kv_int4_group(head_dim) channels, packed after the head's codes (two 4-bit codes per byte)
    grouped: bool = False
    # the kernel families whose attention reads this cache (the CPU's native decode attention reads only
    # unquantised caches: with any of these the torch kernels run its decodes)
    families: tuple[str, ...] = (TORCH, TRITON)

    @property
    def qmax(self) -> float:
        """The largest magnitude the storage holds."""
        return KV_QMAX[self.storage]

    @property
    def static(self) -> bool:
        """Whether the attention op takes calibrated scales (param kv_scales.<layer>) as its last input."""
        return not self.grouped

    @property
    def torch_dtype(self) -> torch.dtype:
        """The cache tensor's dtype: a grouped format's rows are bytes (codes, then fp16 scales)."""
        return torch.uint8 if self.grouped else getattr(torch, self.storage)

    def group_size(self, head_dim: int) -> int | None:
        return kv_int4_group(head_dim) if self.grouped else None

    def head_bytes(self, head_dim: int) -> int:
        """Bytes one token's keys (or values) of one KV head take: codes, and a grouped format's scales."""
        if not self.grouped:
            return head_dim * self.torch_dtype.itemsize
        return kv_int4_row_bytes(head_dim, kv_int4_group(head_dim))


KV_CACHE_FORMATS: dict[str, KvFormat] = {f.name: f for f in (KvFormat("int8", "int8"),
                                                             KvFormat("fp8", "float8_e4m3fn"),
                                                             KvFormat("int4", "int4", grouped=True,
                                                                      families=(TORCH,)))}


def kv_format(storage: str) -> KvFormat:
    """The format whose attention nodes say kv_cache=`storage`."""
    return next(f for f in KV_CACHE_FORMATS.values() if f.storage == storage)


def kv_head_bytes(dtype: str, head_dim: int) -> int:
    """Bytes one token's keys (or values) of one KV head take in a cache of `dtype`: a KV format's
    storage name (an attention node's `kv_cache` attr) or an activation dtype name."""
    if any(f.storage == dtype for f in KV_CACHE_FORMATS.values()):
        return kv_format(dtype).head_bytes(head_dim)
    return head_dim * getattr(torch, dtype).itemsize


def kv_cache_head_bytes(kv_cache: dict, head_dim: int) -> int:
    """kv_head_bytes for a manifest's model.kv_cache record (a grouped format names itself in `format`)."""
    fmt = kv_cache.get("format")
    return KV_CACHE_FORMATS[fmt].head_bytes(head_dim) if fmt else kv_head_bytes(kv_cache["dtype"], head_dim)

__all__ = ["Scheme", "SCHEMES", "schemes_where", "scheme", "dequantize_weight", "KvFormat", "KV_CACHE_FORMATS",
           "kv_format", "kv_head_bytes", "kv_cache_head_bytes",
           "NO_ZERO", "INT_ZERO", "FLOAT_OFFSET", "FLOAT_ACTS", "INT8_PER_TOKEN", "FP8_STATIC", "TORCH", "NATIVE",
           "ORT", "TRITON", "FAMILIES"]
