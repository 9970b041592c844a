"""Batch invariance on the CPU target: a sequence's logits are the same bits whatever else is in the step
and however many rows it brings (decode, speculative verification, prefill chunks, a prefix-cache hit, a
recompute after preemption). Where a kernel's rounding depends on the row count it is replaced, in this
mode, by one whose per-row arithmetic is fixed, the decode program's own kernels (codegen/native):
    fp32 linear      MKL's GEMM rounds a row differently at 1, 2-15 and 16+ rows -> the native fp32 GEMV
    qlinear          the dense GEMM from `dense_from` rows on, torch's packed kernels -> the native GEMVs
                     (int16 or int8 activation codes per row and block) at every row count, MAX_ROWS rows a
                     call, or dequantise + the native fp32 GEMV where they have no form
    norms, SwiGLU    torch beyond MAX_ROWS rows, native below -> native at every row count
    attention        SDPA for prefill, native for decode, its context split by the batch's size -> native
                     for every query row, each split as a batch of one would be
ONNX Runtime segments keep their kernels: MLAS's fp32 MatMul and its int8-compute MatMulNBits gave a row
the same bits at any row count on an AVX-512 Xeon; on an AVX2 Zen 3 its MatMulNBits round a row called
alone apart from 2+ rows, so there a one-row call takes a second row (mark_launches); its fp32-compute
MatMulNBits did not on the Xeon (`describe` names them), nor does
its decode graph's attention match the native kernel's, so that graph is not used in this mode (and
`--kernels auto` compiled invariant offers neither: compiler/driver/tuning/kernel_choice.py).
What stays outside (`describe`): fp32-compute MatMulNBits in ONNX Runtime segments (artifacts compiled
--batch-invariant off), a quantised or bf16 KV cache, soft-capped or tree attention, and everything where
the native kernels are not built (LLMC_NATIVE=0, no C compiler)."""

from __future__ import annotations

import torch

from llmc.codegen.native import cpu_native
from llmc.codegen.ort import nbits_rows
from llmc.codegen.plan import ORT_SEGMENT
from llmc.codegen.torch_cpu import cpu_kernels
from llmc.runtime.ort_segment import OrtSegment

META_KEY = cpu_kernels.BATCH_INVARIANT
# the kernels whose launches take the batch-invariant variant (an attr they read)
MARKED = (cpu_kernels.linear, cpu_kernels.rms_norm, cpu_kernels.add_rms_norm, cpu_kernels.swiglu)


def compiled_mode(plan) -> bool:
    """Whether the artifact was compiled batch-invariant (plan.meta; artifacts from before the flag: on)."""
    recorded = plan.meta.get(META_KEY)
    return recorded if isinstance(recorded, bool) else True


def batch_invariant_of(plan, asked: bool | None) -> bool:
    """The mode a load runs: what it asked for, else the artifact's."""
    return compiled_mode(plan) if asked is None else asked


def mark_launches(program: list) -> list:
    """`program`'s launches, those of MARKED kernels told to run their batch-invariant variant, and ONNX
    Runtime segments whose MatMulNBits round a row called alone apart (this machine's MLAS: see
    codegen/ort/nbits_rows.py) told to give such a call a second row."""
    for launch in program:
        if isinstance(launch.fn, OrtSegment):
            launch.fn.pad_single_rows = launch.fn.rounds_alone_apart()
    return [launch._replace(attrs={**launch.attrs, META_KEY: True}) if launch.fn in MARKED else launch
            for launch in program]


def fp32_nbits(model: bytes) -> int:
    """How many MatMulNBits of an ONNX segment multiply fp32 activations (accuracy_level 1): MLAS runs one
    row as a GEMV and more as dequantise + GEMM, which round differently (measured at SmolLM2's shapes,
    1 and 2 threads, ORT 1.32: its int8-compute level 4 gave the same bits at 1 to 40 rows, fp32 MatMul
    at 1 to 600)."""
    if not model:
        return 0
    import onnx  # onnx: only plans with ORT segments; the engine imports this module

    count = 0
    for node in onnx.load_from_string(model).graph.node:
        if node.op_type == "MatMulNBits":
            level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
            count += level != 4
    return count


def describe(executor) -> str:
    """'on', or 'on, except ...' naming what in this plan still rounds by the row count."""
    plan = executor.plan
    left = []
    if not cpu_native.available():
        left.append(f"everything: native kernels {cpu_native.status()}")
    elif not cpu_native.gemv_runs():
        left.append("the GEMVs (no OpenMP at this thread count)")
    fp32_nbits_count = sum(fp32_nbits(executor._data.get(s.attrs.get("file"), b"")) for s in plan.steps
                     if s.kernel == ORT_SEGMENT)
    if fp32_nbits_count:
        left.append(f"{fp32_nbits_count} ONNX Runtime MatMulNBits on fp32 activations (accuracy_level 1)")
    varies = sorted({level for launch in executor._program if isinstance(launch.fn, OrtSegment)
                     for level in launch.fn.nbits_levels if nbits_rows.row_rounding(level) == nbits_rows.VARIES})
    if varies:
        left.append(f"ONNX Runtime MatMulNBits at accuracy_level {varies}: this CPU's round by the row count")
    kv = executor.kv_dtype()
    if kv not in (None, torch.float32):
        # an int4 cache is uint8 rows: name its format
        name = (executor.plan.meta.get("kv_cache") or {}).get("format") or str(kv).removeprefix("torch.")
        left.append(f"attention over the {name} KV cache"
                    + (" and the bf16 kernels" if kv is torch.bfloat16 else ""))
    if any(s.attrs.get("softcap") is not None for s in plan.attention_steps()):
        left.append("soft-capped attention")
    return "on" if not left else "on, except " + "; ".join(left)


__all__ = ["META_KEY", "MARKED", "fp32_nbits", "compiled_mode", "batch_invariant_of", "mark_launches", "describe"]
