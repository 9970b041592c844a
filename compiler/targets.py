"""Compile targets as data: the hardware facts (memory, bandwidth, peak throughput per dtype) and the
precision, default pass names and default recipes llmc specialises an artifact for. This module sits
below the passes and imports none of them; what a target's names become (typed pass configurations,
the full pipeline, its line in `llmc targets`) is built in compiler/pipeline.py."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

import psutil

from llmc.errors import TargetError

GiB = 2**30

# Short precision names used for weights, activations and peak_tflops keys, and the IR dtype
# each is stored as (int4 codes are packed two to a uint8).
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                    "fp8": "float8_e4m3fn", "int8": "int8", "int4": "uint8"}

CLEANUP = ["remove_noops", "fold_constants", "dce"]


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    device: str                                   # "cpu" or "cuda"
    arch: str                                     # "sm_90", "x86_64", ...
    memory_bytes: int
    bandwidth_bytes_per_s: float
    # Dense (no structured sparsity) tensor-core peaks in TFLOPS (TOPS for int).
    peak_tflops: dict[str, float] = field(hash=False)
    supports_fp8: bool
    weight_dtype: str                             # a PRECISION_DTYPES key
    activation_dtype: str                         # the dtype between kernels
    compute_dtype: str                            # the dtype GEMMs run in (a peak_tflops key)
    # the passes a compile runs after lowering, by name: each is placed in its declared stage
    # (a cleanup pass named after the fusions runs in the final cleanup stage)
    default_pipeline: list[str] = field(hash=False)
    compile_ready: bool = True
    not_ready_reason: str = ""
    # the --quant recipe (compiler/recipes.py) applied when the user names none, whatever the
    # source; None keeps a quantised source's own blocks (a GGUF's), else float weights
    default_quant: str | None = None
    # the --kv-cache dtype (int8 | fp8) applied when the user names none
    default_kv_cache: str | None = None

    def __post_init__(self):
        assert self.device in ("cpu", "cuda"), self.device
        assert {self.weight_dtype, self.activation_dtype} <= set(PRECISION_DTYPES), self.name
        assert self.compute_dtype in self.peak_tflops, self.name
        assert self.compile_ready or self.not_ready_reason, self.name

    @property
    def weight_ir_dtype(self) -> str:
        return PRECISION_DTYPES[self.weight_dtype]

    @property
    def activation_ir_dtype(self) -> str:
        return PRECISION_DTYPES[self.activation_dtype]

    def check_ready(self) -> None:
        """Raise TargetError when llmc cannot compile for this target yet."""
        if not self.compile_ready:
            raise TargetError(self.not_ready_reason)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_tflops"] = dict(self.peak_tflops)
        d["default_pipeline"] = list(self.default_pipeline)
        return d

    def facts(self) -> str:
        """`h100-fp8: NVIDIA H100 ...; cuda sm_90, 80 GiB at 3350.0 GB/s, 1979 fp8 TFLOPS, weights fp8,
        activations bf16`: the first part of its line in `llmc targets` (compiler/pipeline.py's
        describe_target adds the recipe and readiness)."""
        unit = "TOPS" if self.compute_dtype.startswith("int") else "TFLOPS"
        return (f"{self.name}: {self.description}; {self.device} {self.arch}, "
                f"{self.memory_bytes / GiB:.0f} GiB at {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                f"{self.peak_tflops[self.compute_dtype]:g} {self.compute_dtype} {unit}, "
                f"weights {self.weight_dtype}, activations {self.activation_dtype}")


def host_memory_bytes() -> int:
    return int(psutil.virtual_memory().total)


def gpu_target(name: str, description: str, arch: str, memory_gib: int, bandwidth: float,
               peak_tflops: dict[str, float], weight_dtype: str, compute_dtype: str,
               default_quant: str | None = None, default_kv_cache: str | None = None) -> Target:
    """A GPU target: bf16 activations, compiled into a static plan of Triton kernels. Its
    quantisation comes from `default_quant` (inserted before the cleanup passes): "none" gives
    bf16 weights whatever the source."""
    return Target(name, description, "cuda", arch, memory_gib * GiB, bandwidth, peak_tflops,
                  supports_fp8="fp8" in peak_tflops, weight_dtype=weight_dtype,
                  activation_dtype="bf16", compute_dtype=compute_dtype,
                  default_pipeline=CLEANUP + ["cast_bf16"] + FUSIONS + ["dce"], default_quant=default_quant,
                  default_kv_cache=default_kv_cache)


# Datasheet figures: H100 SXM5 80GB, A100 SXM4 80GB, GeForce RTX 4090 (Ada whitepaper, FP32
# accumulate), Jetson AGX Orin 64GB (GPU only, without the DLAs: half its 170 sparse TOPS).
# int4 targets are weight-only (W4A16): their GEMMs run in bf16 after dequantisation.
H100 = {"fp8": 1979.0, "int8": 1979.0, "bf16": 989.0, "fp16": 989.0, "fp32": 67.0}
A100 = {"int4": 1248.0, "int8": 624.0, "bf16": 312.0, "fp16": 312.0, "fp32": 19.5}
RTX4090 = {"int4": 1321.2, "int8": 660.6, "fp8": 330.3, "bf16": 165.2, "fp16": 165.2, "fp32": 82.6}
ORIN = {"int8": 85.0, "bf16": 42.5, "fp16": 42.5, "fp32": 5.3}

# Gate/up fuse into one GEMM before swiglu, so swiglu reads the packed GEMM output.
FUSIONS = ["fuse_attention", "fuse_qkv", "fuse_gate_up", "fuse_swiglu", "fuse_rms_norm"]
# The cpu target's fusions: q/k/v and gate/up each become one GEMM, swiglu and add + rms_norm one
# kernel each (decode tokens/s before/after: bench/fusion.sh).
CPU_FUSIONS = ["fuse_qkv", "fuse_gate_up", "fuse_swiglu", "fuse_rms_norm"]

TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("cpu", "this host's CPU through torch (nominal bandwidth and peak)", "cpu",
           platform.machine(), host_memory_bytes(), 50e9, {"fp32": 1.0, "bf16": 1.0, "int8": 2.0},
           supports_fp8=False, weight_dtype="fp32", activation_dtype="fp32", compute_dtype="fp32",
           default_pipeline=CLEANUP + CPU_FUSIONS + ["fuse_attention", "dce"]),
    # bf16 GEMMs run on AVX512-BF16 / AMX through oneDNN: 3-6x fp32's GEMM rate from 64 rows up on a
    # Zen 5 host, and half the weight bytes per decoded token (README, "bf16 on the CPU")
    Target("cpu-bf16", "this host's CPU through torch, bf16 weights and activations (fast where the CPU "
           "has AVX512-BF16 or AMX)", "cpu", platform.machine(), host_memory_bytes(), 50e9,
           {"fp32": 1.0, "bf16": 1.0, "int8": 2.0}, supports_fp8=False, weight_dtype="bf16",
           activation_dtype="bf16", compute_dtype="bf16",
           default_pipeline=CLEANUP + ["cast_bf16"] + CPU_FUSIONS + ["fuse_attention", "dce"]),
    gpu_target("h100-fp8", "NVIDIA H100 SXM 80GB, fp8 e4m3 weights and activations in GEMMs",
               "sm_90", 80, 3.35e12, H100, "fp8", "fp8", default_quant="fp8",
               default_kv_cache="fp8"),
    gpu_target("h100-bf16", "NVIDIA H100 SXM 80GB, bf16 weights", "sm_90", 80, 3.35e12, H100,
               "bf16", "bf16", default_quant="none"),
    gpu_target("a100-bf16", "NVIDIA A100 SXM 80GB, bf16 weights", "sm_80", 80, 2.039e12, A100,
               "bf16", "bf16", default_quant="none"),
    gpu_target("a100-int8", "NVIDIA A100 SXM 80GB, SmoothQuant int8 weights and activations",
               "sm_80", 80, 2.039e12, A100, "int8", "int8", default_quant="w8a8"),
    gpu_target("rtx4090-int4", "NVIDIA GeForce RTX 4090 24GB, AWQ int4 weights (group 128)",
               "sm_89", 24, 1.008e12, RTX4090, "int4", "bf16", default_quant="int4-awq"),
    gpu_target("orin-int4", "NVIDIA Jetson AGX Orin 64GB, GPTQ int4 weights (group 128)",
               "sm_87", 64, 204.8e9, ORIN, "int4", "bf16", default_quant="int4-gptq"),
]}


def get_target(name: str | Target) -> Target:
    """The target called `name` (a Target passes through)."""
    if isinstance(name, Target):
        return name
    if name not in TARGETS:
        raise TargetError(f"unknown target {name!r}; valid targets: {', '.join(TARGETS)}")
    return TARGETS[name]


__all__ = ["Target", "TARGETS", "get_target", "PRECISION_DTYPES", "host_memory_bytes"]
