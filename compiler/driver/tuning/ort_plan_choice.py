"""`--kernels auto`, last: the lowered plan (ORT segments where their kinds measured faster, walked or
through the decode graph) against the unlowered cpu plan, whose decode steps the native decode program
runs as one call (runtime/native_decode.py): a saving the per-segment timings cannot see, since they
time each segment's torch kernels launch by launch. It matters where ORT segments sit among the layers
the program would run; elsewhere (an embedding or LM head segment) the kinds' timings stand. Priced as
the kinds were chosen, a request of one prefill and PREFILL_TOKENS decode steps: the prefill difference
from the kinds' timings, the decode steps timed whole (ort_decode_timing.py), all ways at once.
Where those timings were taken on a busy machine, or the cheapest way's range overlaps a way before it
in DEFAULTS (the unlowered plan first), the earlier way stays and the record says why."""

from __future__ import annotations

from llmc.cache import pick
from llmc.codegen.native import cpu_native
from llmc.codegen.ort.ort_decode import DECODE_FILE
from llmc.codegen.plan import ORT_SEGMENT
from llmc.compiler.driver.tuning import ort_decode_timing  # through the module: tests fake measure_plans
from llmc.compiler.driver.tuning.ort_decode_timing import DEFAULTS, step_ranges
from llmc.compiler.driver.tuning.ort_timing import PREFILL_TOKENS
from llmc.compiler.ir import Graph
from llmc.runtime.native_decode import COVERED

# auto times whole decode steps (every candidate plan loaded on all the weights) only for models up
# to this many bytes of weights; above it each candidate would hold the model again, and the per-launch
# overhead a whole step shows beyond the segments' own timings is small against streaming the weights
WHOLE_STEP_LIMIT = 512 * 2**20
BUSY = "measured on a busy machine"   # how a choice made on busy timings begins its why


def whole_step_refusal(graph: Graph) -> str | None:
    """Why auto may not time whole decode steps of `graph` (None when it may)."""
    size = sum(p.type.nbytes() for name, p in graph.params.items() if name in graph.weights)
    if size <= WHOLE_STEP_LIMIT:
        return None
    return (f"not timed: the model's {size / 2**30:.2f} GiB of weights are over the {WHOLE_STEP_LIMIT >> 20} MiB "
            f"auto times whole decode steps on; the segments' own timings stand")


def whole_plan_question(cpu_plan, lowered) -> str | None:
    """Why the lowered plan stands without a whole-step timing, or None: it must be timed."""
    if not cpu_native.available():
        return f"the native kernels are not built: {cpu_native.status()}"
    if not any(s.kernel in COVERED and s.kernel != "cpu.flash_attention" for s in cpu_plan.steps):
        return "the native decode program covers none of the plan's GEMMs"
    attention = [i for i, s in enumerate(lowered.steps) if s.kernel == "cpu.flash_attention"]
    if not any(attention and attention[0] < i < attention[-1]
               for i, s in enumerate(lowered.steps) if s.kernel == ORT_SEGMENT):
        return "no ORT segment lies among the layers the native decode program runs"
    return None


def choose_whole_plan(graph: Graph, cpu_plan, lowered, files: dict[str, bytes], choice: dict) -> dict:
    """{"chosen": "cpu", "walk" or "graph", what was measured}: the cpu plan, the lowered one walked, or
    the lowered one through its decode graph (where plan.meta["decode_graph"] offers one; then the walk
    launch by launch is timed too, for the graph's native_first: kernel_choice.py). `cpu_plan`
    carries the qlinear dispatch its torch kernels load with; `files` are the lowered plan's ONNX files."""
    prefill_us = prefill_extra_us(choice)
    candidates = {"cpu": (cpu_plan, {}, None), "walk": (lowered, files, None)}
    record = lowered.meta.get("decode_graph") or {}
    if record.get("chosen"):   # and the walk launch by launch, which steps the program does not take run
        candidates.update(graph=(lowered, files, (files[DECODE_FILE], record)), launches=(lowered, files, None, False))
    timings = ort_decode_timing.measure_plans(graph, candidates)
    ranges = request_ranges(timings, [n for n in timings if n != "launches"], prefill_us)
    chosen, why = pick(ranges, DEFAULTS)
    busy = getattr(timings, "measured", {}).get("busy")
    if busy:
        chosen, why = "cpu", f"{BUSY} ({busy}): the unlowered plan, the default, stays"
    return {"chosen": chosen, "step_us": dict(timings), "prefill_extra_us": round(prefill_us, 1),
            "cost": f"prefill + {PREFILL_TOKENS} x decode", **({"why": why} if why else {})}


def prefill_extra_us(choice: dict) -> float:
    """What a prefill costs more on the torch kernels than in the ORT segments the kinds chose, as
    measured (choice: plan.meta's kernel_choice)."""
    kinds = [k for k in (choice.get("measured") or {}).get("kinds", []) if k.get("chosen") not in (None, "cpu")]
    return sum(k["segments"] * (k["us"]["cpu"]["prefill"] - k["us"][k["chosen"]]["prefill"])
               for k in kinds if "cpu" in k.get("us", {}) and k["chosen"] in k.get("us", {}))


def request_ranges(timings, names, prefill_us: float) -> dict[str, tuple[float, float]]:
    """Each way's request cost range: PREFILL_TOKENS decode steps (best, median), plus the prefill
    difference for the unlowered plan ("cpu")."""
    extra = lambda name: prefill_us if name == "cpu" else 0.0
    return {name: (PREFILL_TOKENS * low + extra(name), PREFILL_TOKENS * high + extra(name))
            for name, (low, high) in step_ranges(timings, names).items()}


__all__ = ["BUSY", "prefill_extra_us", "request_ranges", "choose_whole_plan", "whole_plan_question",
           "whole_step_refusal", "WHOLE_STEP_LIMIT"]
