"""Kernel choices re-checked where an artifact runs. `--kernels auto` chose between the torch kernels
and ONNX Runtime segments (walked, or through ORT's decode graph) and set each quantised linear's switch
to a dense GEMM from timings taken on the compile machine. Served on another CPU, at another thread
count, or on the same machine after a compile that ran beside other work, those timings are a default,
not a verdict: at load, the candidates are timed here the way the compile timed them, and the cheapest
runs.

- The whole plan: the plan as compiled (walked, and through its decode graph where the compile chose
  one), the same plan on the torch kernels (each ort.segment step keeps the torch steps it replaced:
  codegen/ort/ort_lowering.torch_plan), and that plan with every segment ONNX Runtime can run lowered there
  (built now from the artifact's graph and weights: a segment the compile kept on torch stored no ONNX
  model; in batch-invariant runs without MatMulNBits on fp32 activations, which round by row count),
  one decode step each (ort_decode_timing.py); the prefill term of the cost is the compile's (the
  kinds' recorded prefill timings).
- The quantised linears' dense switch, per weight shape (qlinear_dispatch.py).

Everything measured is kept in the machine's timing cache (ort_timing_cache.py): the next load on this
machine times nothing. A busy machine, or ways too close to call, keep what the compile chose. Not
re-checked: the whole plan of a model over WHOLE_STEP_LIMIT (each candidate would hold its weights
again; its segments' own compile timings stand), and GPU or tensor-parallel artifacts."""

from __future__ import annotations

import os

from llmc.cache import pick
from llmc.codegen.family import ORT
from llmc.codegen.ort.onnx_ops import FP32_COMPUTE
from llmc.codegen.ort.ort_decode import DECODE_FILE
from llmc.codegen.ort.ort_lowering import (
    SegmentModels,
    lowered_steps,
    restep,
    segment_ops,
    torch_plan,
)
from llmc.codegen.plan import ORT_SEGMENT, Plan
from llmc.codegen.torch_cpu.cpu_qlinear_dense import DISPATCH_META
from llmc.compiler.driver.tuning import ort_decode_timing
from llmc.compiler.driver.tuning.ort_plan_choice import WHOLE_STEP_LIMIT, prefill_extra_us, request_ranges
from llmc.compiler.driver.tuning.qlinear_dispatch import dispatch_record
from llmc.compiler.ir import Graph
from llmc.errors import RuntimeLlmcError
from llmc.runtime.batch_invariance import fp32_nbits
from llmc.runtime.ort_segment import cpu_kernel_ops
from llmc.runtime.roofline import cpu_model

RECHECK_ENV = "LLMC_RECHECK_KERNELS"   # 1: always, 0: never, unset: where this is not the compile machine
RUN_SITE = "run_site"                  # plan.meta["kernel_choice"][RUN_SITE]: what the load re-checked


def machine_record(threads: int) -> dict:
    """What a kernel choice depends on about the machine that made it (plan.meta["kernel_choice"]["machine"])."""
    return {"cpu": cpu_model(), "threads": threads}


def recheck(art, plan: Plan, threads: int, asked: bool | None = None, invariant: bool = False,
            echo=None) -> tuple[Plan, dict[str, bytes]]:
    """(plan, data files) to run on this machine: the artifact's, its torch form, or its segments all in
    ONNX Runtime, whichever measured fastest here; the plan's kernel_choice records what was re-checked
    and why (RUN_SITE). `asked`: True always re-checks, False never, None where needed (why_recheck).
    `invariant`: the run is batch-invariant (no segment whose MatMulNBits rounds by the row count is
    offered, and the quantised linears never switch to dense GEMMs: nothing to measure)."""
    choice = plan.meta.get("kernel_choice")
    if not isinstance(choice, dict) or choice.get("mode") not in ("auto", "cpu") or "parallel" in art.manifest:
        return plan, art.data
    why = why_recheck(choice, machine_record(threads), _asked(asked))
    if why is None:
        return plan, art.data
    if echo:
        echo(f"llmc: re-checking the kernel choices on this machine ({why})")
    graph = _graph(art)
    record: dict = {"why": why, "machine": machine_record(threads)}
    chosen, data = plan, art.data
    if choice.get("mode") == "auto":
        chosen, data = _whole_plan(graph, plan, art.data, choice, record, invariant)
    if invariant:
        record["dense_from"] = "not used: batch-invariant runs keep the low-bit kernels at every row count"
    else:
        _dense_switch(chosen, graph, threads, record)
    chosen.meta = {**chosen.meta, "kernel_choice": {**chosen.meta["kernel_choice"], RUN_SITE: record}}
    return chosen, data


def why_recheck(choice: dict, here: dict, asked: bool | None) -> str | None:
    """Why the choices must be re-checked on machine `here`, or None."""
    if asked is not None:
        return "asked" if asked else None
    compiled_on = choice.get("machine")
    if not isinstance(compiled_on, dict):
        return "the artifact does not record the machine its kernels were chosen on"
    if compiled_on.get("cpu") != here["cpu"]:
        return f"chosen on {compiled_on.get('cpu')!r}, running on {here['cpu']!r}"
    if compiled_on.get("threads") != here["threads"]:
        return f"chosen at {compiled_on.get('threads')} threads, running at {here['threads']}"
    busy = (choice.get("timings") or {}).get("busy")
    if busy:
        return f"{busy} of the compile's timings were taken on a busy machine"
    return None


def _asked(asked: bool | None) -> bool | None:
    if asked is not None:
        return asked
    value = os.environ.get(RECHECK_ENV, "").strip()
    if value in ("", "auto"):
        return None
    if value not in ("0", "1"):
        raise RuntimeLlmcError(f"{RECHECK_ENV}={value!r}: set 1 (always re-check the kernel choices at load), "
                               f"0 (never) or leave it unset (where the machine differs from the compile's)")
    return value == "1"


def _graph(art):
    graph = Graph.from_json(art.graph_json)
    graph.weights = art.weights
    return graph


def _whole_plan(graph, plan: Plan, data: dict, choice: dict, record: dict, invariant: bool):
    """(plan, data): `plan`, `plan` walked without its decode graph, its torch form, or its torch form
    with every segment ONNX Runtime can run lowered there: the cheapest request here."""
    decode = plan.meta.get("decode_graph") or {}
    size = sum(t.numel() * t.element_size() for t in graph.weights.values())
    if size > WHOLE_STEP_LIMIT:
        record["whole_plan"] = (f"not timed: {size / 2**30:.2f} GiB of weights, over the {WHOLE_STEP_LIMIT >> 20} "
                                f"MiB whole decode steps are timed on; the compile's choice stands")
        return plan, data
    base = torch_plan(plan)
    candidates = {"cpu": (base, {}, None), "walk": (plan, dict(data), None)}
    if decode.get("chosen") and DECODE_FILE in data:
        candidates["graph"] = (plan, dict(data), (data[DECODE_FILE], decode))
    lowered = _all_lowered(graph, base, invariant)
    if lowered is not None:
        candidates["ort"] = (*lowered, None)
    if list(candidates) == ["cpu", "walk"] and not any(s.kernel == ORT_SEGMENT for s in plan.steps):
        record["whole_plan"] = "nothing to choose: every step runs on the torch kernels, and ONNX Runtime runs none"
        return plan, data
    timings = ort_decode_timing.measure_plans(graph, candidates)   # through the module: tests fake it
    prefill = prefill_extra_us(choice)   # the compile's measure of the segments' prefill
    ranges = request_ranges(timings, list(candidates), prefill)
    compiled = "graph" if "graph" in candidates else "walk"
    chosen, why = pick(ranges, (compiled, *[n for n in ("walk", "cpu", "ort") if n in candidates and n != compiled]))
    busy = getattr(timings, "measured", {}).get("busy")
    if busy:
        chosen, why = compiled, f"measured on a busy machine ({busy}): the compile's choice stands"
    record["whole_plan"] = {"chosen": chosen, "step_us": dict(timings), "prefill_extra_us": round(prefill, 1),
                            **({"why": why} if why else {})}
    if chosen in ("cpu", "ort"):
        return candidates[chosen][0], candidates[chosen][1]
    if chosen == "walk" and decode.get("chosen"):
        walked = Plan.from_json(plan.to_json())
        walked.meta = {**walked.meta, "decode_graph": {**decode, "chosen": False,
                                                       "why": "re-checked at load: walking the plan measured faster"}}
        return walked, data
    return plan, data


def _all_lowered(graph, base: Plan, invariant: bool) -> tuple[Plan, dict[str, bytes]] | None:
    """`base` (a plan on the torch kernels, a step per graph node) with every segment ONNX Runtime can run
    lowered there, and the segments' ONNX files; in batch-invariant runs without the segments whose
    MatMulNBits multiply fp32 activations (they round by the row count). None where no segment is left
    or the plan's steps are not the graph's nodes."""
    if [s.node for s in base.steps] != [n.name for n in graph.nodes]:
        return None
    segments = ORT.candidates(graph, base, base.target)   # the runs of steps the ORT family offers
    built = SegmentModels(graph, segments, FP32_COMPUTE)
    chosen = [not (segment_ops(built[i][0]) - cpu_kernel_ops()) and not (invariant and fp32_nbits(built[i][0]))
              for i in range(len(segments))]
    if not any(chosen):
        return None
    steps, files = lowered_steps(base, segments, built, chosen)
    lowered = restep(base, steps)
    lowered.meta = {k: v for k, v in base.meta.items() if k != "decode_graph"}
    return lowered, files


def _dense_switch(plan: Plan, graph, threads: int, record: dict) -> None:
    """The quantised linears' dense switch measured (or recalled) on this machine, into plan.meta."""
    steps = [(s.kernel, s.inputs, s.attrs) for top in plan.steps for s in (top.inner_steps() or [top])]
    if not any(kernel == "cpu.qlinear" for kernel, _, _ in steps):
        return
    before = (plan.meta["kernel_choice"].get(DISPATCH_META) or {}).get("shapes", {})
    dispatch = dispatch_record(steps, graph.weights, threads, meta=plan.meta)
    plan.meta = {**plan.meta, "kernel_choice": {**plan.meta["kernel_choice"], DISPATCH_META: dispatch}}
    record["dense_from"] = {key: {"compiled": (before.get(key) or {}).get("dense_from"), "here": entry["dense_from"]}
                            for key, entry in dispatch["shapes"].items()}


__all__ = ["recheck", "why_recheck", "machine_record", "RECHECK_ENV", "RUN_SITE"]
