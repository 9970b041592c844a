"""`--kernels auto`'s (and `--kernels cpu`'s) quantised-linear dispatch: from which row count each qlinear
weight shape runs as a dense fp32 GEMM rather than its low-bit kernel (codegen/torch_cpu/cpu_qlinear_dense.py),
measured at compile once per shape, thread count and machine (ort_timing_cache.py) and recorded in
plan.meta["kernel_choice"]["qlinear_dispatch"] for the runtime and `llmc inspect`."""

from __future__ import annotations

import torch

from llmc.codegen.native.cpu_native import timing_key as native_key
from llmc.codegen.torch_cpu import cpu_qlinear_dense
from llmc.codegen.torch_cpu.cpu_kernels import Q4_ACTIVATIONS, packed_run, prepare_qlinear, q4_activations
from llmc.codegen.torch_cpu.cpu_qlinear_dense import (
    DISPATCH_META,
    PROBE_ROWS,
    DenseSource,
    DispatchedWeights,
    shape_key,
)
from llmc.compiler.driver.tuning.ort_timing_cache import recall
from llmc.compiler.weight_store import WeightStore


def dispatch_record(steps, weights: dict, threads: int, rows: tuple[int, ...] = PROBE_ROWS,
                    meta: dict | None = None) -> dict:
    """Measure each qlinear weight shape among `steps` ((kernel, inputs, attrs) of torch steps) once,
    with its first step's real weights, at `threads` threads and the row counts `rows` (or take what
    this machine measured before): the record choose_dense_from reads back from the plan. `meta`, the
    plan's: how its 4-bit GEMVs round activations (int8 ones take the AMX GEMM on many rows)."""
    q4 = q4_activations(meta)
    shapes: dict[str, dict] = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        entry = weights.entry if isinstance(weights, WeightStore) else weights.__getitem__
        for kernel, inputs, attrs in steps:
            params = [entry(i) if i in weights else None for i in inputs]
            if kernel != "cpu.qlinear" or None in params[1:]:
                continue
            key = shape_key(attrs["scheme"], params[1], params[2])
            if key not in shapes:   # the first step of a shape is measured on its weights' values
                params = [weights.get(i) for i in inputs]
                made = prepare_qlinear(params, attrs, {Q4_ACTIVATIONS: q4, "kernel_choice": {DISPATCH_META: {
                    "shapes": {key: {"dense_from": 1}}}}})
                prepared = made.get("cpu_weights")
                if not isinstance(prepared, DispatchedWeights):
                    continue
                run = packed_run(prepared.packed, made.get("native_gemv"))
                kind = type(prepared.packed).__name__
                shapes[key] = {**_recalled_measure(key, f"{kind} {q4}", threads, run, prepared.dense, rows),
                               "steps": 0}
            shapes[key]["steps"] += 1
    finally:
        torch.set_num_threads(previous)
    return {"threads": threads, "rows": list(rows), "shapes": shapes}


def _recalled_measure(key: str, kind: str, threads: int, run_packed, src: DenseSource, rows: tuple[int, ...]) -> dict:
    """measure_shape's record for this shape and packed form (`kind`), from the machine's timing cache
    when measured before."""
    def run() -> dict:
        with torch.inference_mode():   # through the module: tests replace measure_shape there
            return cpu_qlinear_dense.measure_shape(run_packed, src, rows=rows)

    return recall({"what": "qlinear dense switch", "shape": key, "packed": kind, "threads": threads,
                   "rows": list(rows), "native": native_key()}, run)


__all__ = ["dispatch_record"]
