"""Whether a lowered cpu plan gets the decode graph (codegen/ort/ort_decode.py: the whole forward of a
decode-only step as one ONNX Runtime session): under `--kernels ort` wherever it can be built and this
onnxruntime runs its ops, under `--kernels auto` where its segments' timings (ort_timing.py) or, on a
close call, whole decode steps timed both ways (ort_decode_timing.py) show it faster than the plan walk."""

from __future__ import annotations

import hashlib

from llmc.codegen.native import cpu_native
from llmc.codegen.ort.ort_decode import DECODE_FILE, build_decode_graph, decode_refusal
from llmc.codegen.ort.ort_lowering import segment_ops
from llmc.compiler.driver.tuning.ort_decode_timing import doubt, measure_decode_step
from llmc.compiler.driver.tuning.ort_timing import INT8_ACTIVATIONS
from llmc.compiler.ir import Graph
from llmc.runtime import ort_segment  # through the module: tests fake cpu_kernel_ops
from llmc.runtime.ort_segment import require_ops

CLOSE_CALL = 2.0   # segments costing up to this many times the plan walk's in ORT: time a whole decode step


def plan_decode_graph(graph: Graph, plan, files: dict[str, bytes], mode: str, nbits_level: int,
                      levels: dict[str, int] | None = None, measure_step: bool = True,
                      refusal: str | None = None) -> dict:
    """The plan.meta record of the decode graph `mode` gives the lowered `plan` (its ONNX bytes
    added to `files`), or a record saying why there is none ({"chosen": False, "why": ...}).
    MatMulNBits runs at `nbits_level`, or `levels[node]` (the nodes auto put on int8 activations).
    Without `measure_step` auto offers a graph its kinds' timings keep or call close, the caller timing
    whole steps (ort_plan_choice.py); with a `refusal` of whole-step timing (a large model)
    auto keeps none where a whole step would have decided."""
    why = decode_refusal(graph)
    if why:
        return {"chosen": False, "why": why}
    if mode == "auto" and refusal is not None:   # decided before building it: a large model's graph is large
        verdict = choose_decode_graph(plan.meta["kernel_choice"])
        if verdict.get("close_call") or (verdict["chosen"] and cpu_native.available()):
            return {"chosen": False, "decode_us": verdict["decode_us"], "why": refusal}
    model, record = build_decode_graph(graph, nbits_level, levels)
    record["sha256"] = hashlib.sha256(model).hexdigest()
    missing = _missing_ops(model, mode)
    if missing:
        return {"chosen": False, "why": f"onnxruntime lacks {missing}"}
    verdict = {"chosen": True}
    if mode == "auto":
        verdict = choose_decode_graph(plan.meta["kernel_choice"])
        # where the walk runs the native decode program, the kinds' torch timings (launch by launch)
        # overprice it: a whole step decides. Where the program wins, the graph stays for the steps it
        # does not take (over MAX_ROWS sequences) if it beat the walk launch by launch (native_first).
        if verdict.get("close_call") or (verdict["chosen"] and cpu_native.available()):
            if measure_step:
                us = measure_decode_step(graph, plan, files, model, record)
                verdict = _step_verdict(verdict["decode_us"], us)
            else:   # offered: the caller's whole-step timing decides (ort_plan_choice.py)
                verdict = {"decode_us": verdict["decode_us"], "chosen": True}
    if not verdict["chosen"]:
        return {"chosen": False, **{k: v for k, v in verdict.items() if k != "chosen"}}
    files[DECODE_FILE] = model
    return {**record, **verdict}


def _missing_ops(model: bytes, mode: str) -> str | None:
    """The first op of the decode graph this onnxruntime cannot run on the CPU (--kernels ort, which
    asked for ORT throughout, raises instead)."""
    ops = segment_ops(model)
    if mode == "ort":
        require_ops(ops, "--kernels ort (the decode graph)")
    missing = sorted(ops - ort_segment.cpu_kernel_ops())
    return ".".join(missing[0]).lstrip(".") if missing else None


def choose_decode_graph(choice: dict) -> dict:
    """auto's verdict from what it measured of the segment kinds (ort_timing.py). The decode
    graph runs every kind in ORT, so ORT must have been eligible for every kind (no further from the
    reference than torch; a kind auto put on int8 activations runs on them in the graph too). It is
    kept where those kinds' decode steps cost no more in ORT than in the families the plan walk runs
    them in (it saves a Python launch per segment and attention, and the
    torch attentions, on every decode step besides); refused where they cost over CLOSE_CALL times
    as much; in between, a close call, a whole decode step is timed both ways (as it is for a kept
    one where the native kernels are built: plan_decode_graph)."""
    kinds = choice["measured"]["kinds"]
    int8 = lambda kind: kind["chosen"] == INT8_ACTIVATIONS   # the decode graph runs such kinds on int8 too
    for kind in kinds:
        if "us" not in kind or ("ORT's outputs" in kind.get("why", "") and not int8(kind)):
            return {"chosen": False, "why": f"segments like {kind['first']} do not run in ORT: {kind.get('why')}"}
    in_graph = lambda kind: kind["us"][INT8_ACTIVATIONS if int8(kind) else "ort"]["decode"]
    cost = {"ort": sum(k["segments"] * in_graph(k) for k in kinds),
            "plan": sum(k["segments"] * k["us"][k["chosen"]]["decode"] for k in kinds)}
    record = {"decode_us": {"graph_segments": round(cost["ort"], 1), "plan_segments": round(cost["plan"], 1)}}
    if cost["ort"] <= cost["plan"]:
        return {**record, "chosen": True}
    if cost["ort"] <= CLOSE_CALL * cost["plan"]:
        return {**record, "chosen": False, "close_call": True}
    return {**record, "chosen": False, "why": f"its segments' decode steps measured {cost['ort']:.0f} us in ORT "
                                              f"against {cost['plan']:.0f} us as the plan walk runs them"}


def _step_verdict(decode_us: dict, step_us: dict) -> dict:

    record = {"decode_us": {**decode_us, "graph_step": step_us["graph"], "plan_step": step_us["plan"],
                            "launches_step": step_us["launches"]}}
    why = doubt(step_us, "plan", "graph")   # busy, or too close to call: no graph, the default
    if why:
        return {**record, "chosen": False, "why": why}
    return {**record, **graph_step_verdict(step_us["graph"], step_us["plan"], step_us["launches"])}


def graph_step_verdict(graph_us: float, walk_us: float, launches_us: float) -> dict:
    """The decode graph against whole decode steps walked (with the native decode program where it runs)
    and walked launch by launch: every decode step where it beats the walk; else the steps the program
    does not take (over MAX_ROWS sequences, which run launch by launch) where it beats those (native_first);
    else none."""
    if graph_us < walk_us:
        return {"chosen": True}
    why = f"a decode step through it measured {graph_us:.0f} us against the plan walk's {walk_us:.0f} us"
    return {"chosen": True, "native_first": True, "why": why} if graph_us < launches_us else \
        {"chosen": False, "why": why}


__all__ = ["plan_decode_graph", "choose_decode_graph", "graph_step_verdict", "CLOSE_CALL"]
