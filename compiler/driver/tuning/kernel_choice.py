"""The kernels of a cpu plan as `--kernels` says, the compile driver's step after planning: `cpu` keeps
the torch kernels (their quantised linears' dense switch measured now), `ort` lowers every segment
to ONNX Runtime (codegen/ort/ort_lowering.py builds them), and `auto`, the cpu target's default, keeps a
segment in ORT only where it measured faster than the torch kernels on this machine and no less
accurate (ort_timing.py; MatMulNBits on int8 activations only where the calibration text shows the
model unchanged, ort_accuracy.py), then weighs the lowered plan, walked or through its decode graph
(decode_graph_choice.py), against the unlowered one (ort_plan_choice.py), recording the choice and
the measured alternatives in plan.meta["kernel_choice"]."""

from __future__ import annotations

import functools

from llmc.codegen.family import ORT
from llmc.codegen.ort.onnx_ops import FP32_COMPUTE, INT8_COMPUTE
from llmc.codegen.ort.ort_decode import DECODE_FILE
from llmc.codegen.ort.ort_lowering import (
    DEFAULT_MODE,
    SegmentModels,
    check_kernels_option,
    kept_in_torch,
    lowered_steps,
    refuse_torch_ops,
    restep,
    segment_ops,
    trial_plan,
    unforced,
)
from llmc.codegen.plan import Plan
from llmc.codegen.torch_cpu.cpu_qlinear_dense import DISPATCH_META
from llmc.compiler.driver.tuning import ort_timing_cache
from llmc.compiler.driver.tuning.decode_graph_choice import graph_step_verdict, plan_decode_graph
from llmc.compiler.driver.tuning.ort_accuracy import MIN_GAIN, gate_int8_activations, int8_gain
from llmc.compiler.driver.tuning.ort_plan_choice import (
    BUSY,
    choose_whole_plan,
    whole_plan_question,
    whole_step_refusal,
)
from llmc.compiler.driver.tuning.ort_timing import INT8_ACTIVATIONS, choose_segments
from llmc.compiler.driver.tuning.qlinear_dispatch import dispatch_record
from llmc.compiler.driver.tuning.run_site import machine_record
from llmc.compiler.ir import Graph
from llmc.errors import TargetError
from llmc.runtime.batch_invariance import fp32_nbits
from llmc.runtime.ort_segment import require_ops
from llmc.runtime.threads import resolve_threads


def lower_plans(graphs: list[Graph], plans: list[Plan], target, mode: str | None,
                echo=None, reference=None, batch_invariant: bool = False) -> tuple[list[Plan], dict[str, bytes]]:
    """lower_kernels for the compile driver: one plan per tensor-parallel rank (the ORT family runs
    single-rank plans); returns the plans and the ONNX files to store."""
    if len(plans) > 1 and mode not in (None, "cpu"):
        raise TargetError(f"--kernels {mode} lowers single-rank plans; this compile makes {len(plans)} "
                          f"tensor-parallel ranks: drop --kernels or compile without sharding")
    if len(plans) > 1:
        return plans, {}

    since = ort_timing_cache.mark()
    plan, files = lower_kernels(plans[0], graphs[0], mode, target.device, echo, reference, batch_invariant)
    timings = ort_timing_cache.summary(since)   # when and under what load the choices were measured
    if "kernel_choice" in plan.meta:   # and on which machine: another re-checks them at load (run_site.py)
        plan.meta["kernel_choice"] = {**plan.meta["kernel_choice"], "machine": machine_record(resolve_threads()),
                                      **({"timings": timings} if timings else {})}
    return [plan], files


def lower_kernels(plan: Plan, graph: Graph, mode: str | None, device: str, echo=None,
                  reference=None, batch_invariant: bool = False) -> tuple[Plan, dict[str, bytes]]:
    """The plan with its segments lowered to ORT as `mode` says (None: the target's default), and
    the ONNX files to store ({path in the artifact: bytes}). `reference` (an ort_accuracy
    CalibrationReference, or None) is what auto checks int8 activations on. `batch_invariant`
    (runtime/batch_invariance.py): auto keeps on torch the segments whose MatMulNBits would multiply
    fp32 activations (MLAS rounds a row differently at 1 and more rows), and offers no decode graph
    (the runtime does not use it in that mode)."""
    check_kernels_option(mode, plan.target, device)
    mode = mode or DEFAULT_MODE
    if device != "cpu":
        return plan, {}
    if mode == "cpu":
        return torch_dispatch_plan(plan, graph), {}
    kept = kept_in_torch(graph)
    if mode == "ort":
        refuse_torch_ops(graph, kept)
    segments = ORT.candidates(graph, plan, plan.target)   # the runs of steps the ORT family offers
    # ort: MatMulNBits on int8 activations, the fast path asked for; auto: on fp32 activations, the
    # level it may choose on timing alone (the int8 one also needs the calibration check, ort_accuracy)
    built = SegmentModels(graph, segments, INT8_COMPUTE if mode == "ort" else FP32_COMPUTE)
    choice = {"mode": mode, "kept_in_torch": unforced(kept)}
    int8: set[int] = set()
    if mode == "ort":
        _require_segment_ops(built)
        chosen = [True] * len(segments)
    else:
        # the torch qlinears' dense switch, measured once over every step (the unlowered plan runs it, the
        # kinds' torch kernels are timed with it, and a lowered plan keeps it for the qlinears left in torch)
        dispatch = dispatch_record([(s.kernel, s.inputs, s.attrs) for s in plan.steps], graph.weights,
                                   resolve_threads(), meta=plan.meta)
        trial_meta = functools.cache(lambda: {**plan.meta, "kernel_choice": {DISPATCH_META: dispatch}})
        kinds, choice["measured"] = choose_segments(graph, segments, built, echo, dispatch)
        unlowered = _unlowered_beats_int8(graph, plan, segments, built, kinds, choice, reference, trial_meta(),
                                          batch_invariant)
        if unlowered is not None:
            return unlowered, {}
        int8, gate = gate_int8_activations(
            graph, plan, segments, built, kinds, reference,
            lambda models, keep: trial_plan(plan, trial_meta(), segments, models, keep))
        if gate is not None:
            choice["int8_activations"] = gate
        chosen = [kind["chosen"] != "cpu" for kind in kinds]
        if batch_invariant:
            chosen = _invariant_segments(built, chosen, int8, choice)
    steps, files = lowered_steps(plan, segments, built, chosen)
    lowered = restep(plan, steps)
    if mode == "auto":
        choice[DISPATCH_META] = dispatch_record([(s.kernel, s.inputs, s.attrs) for s in lowered.steps],
                                                graph.weights, choice["measured"]["threads"], meta=plan.meta)
    lowered.meta = {**plan.meta, "kernel_choice": choice}
    levels = {node.name: INT8_COMPUTE for i in int8 for node in segments[i].nodes}
    cpu_plan, question, too_large = None, "--kernels ort", None
    if mode == "auto":
        cpu_plan = restep(plan, plan.steps)
        cpu_plan.meta = trial_meta()
        question, too_large = whole_plan_question(cpu_plan, lowered), whole_step_refusal(graph)
    lowered.meta["decode_graph"] = {"chosen": False, "why": INVARIANT_NO_GRAPH} if batch_invariant and \
        mode == "auto" else plan_decode_graph(graph, lowered, files, mode,
                                              INT8_COMPUTE if mode == "ort" else FP32_COMPUTE, levels,
                                              measure_step=question is not None, refusal=too_large)
    if question is not None or too_large is not None:
        if mode == "auto":
            choice["whole_plan"] = {"chosen": "lowered", "why": question or too_large}
        return lowered, files
    return _whole_plan(graph, cpu_plan, lowered, files, choice)


INVARIANT_NO_GRAPH = ("batch-invariant (--batch-invariant on): its attention rounds otherwise than the native "
                      "kernel prefills run")


NOT_CHECKED = ("not checked on the calibration text: the unlowered plan measured faster than the lowered one even "
               "with int8 activations wherever they were a candidate")


def _unlowered_beats_int8(graph: Graph, plan: Plan, segments: list, built, kinds: list[dict], choice: dict,
                          reference, trial_meta: dict, batch_invariant: bool) -> Plan | None:
    """The unlowered plan, recorded as _whole_plan records it, where a whole decode step shows it cheaper than
    the lowered plan with every int8-activation candidate on int8 activations; else None. Those candidates
    measured faster than the kernels the lowered plan runs otherwise, so a lowered plan losing with all of
    them loses with any subset the calibration check (ort_accuracy.py, two runs of the whole model over the
    calibration text: ~8 s of SmolLM2's compile) could accept, and the check is skipped. Tried only where
    the check would run and whole decode steps decide the plan."""
    candidates = [i for i, kind in enumerate(kinds) if kind.get("int8_candidate")]
    if reference is None or not candidates or int8_gain(kinds, candidates) < MIN_GAIN:
        return None
    hopeful = {id(k): {**k, "chosen": INT8_ACTIVATIONS} if k.get("int8_candidate") else k for k in kinds}
    # the torch qlinears the lowered plan keeps load with the dispatch measured already (without it every
    # shape's dense switch was measured again as the trial plans loaded: 7 s of SmolLM2's GPTQ compile)
    trial_choice = {**choice, DISPATCH_META: trial_meta["kernel_choice"][DISPATCH_META],
                    "measured": {**choice["measured"], "kinds": list(hopeful.values())}}
    models = built.overlay({i: SegmentModels(graph, segments, INT8_COMPUTE)[i] for i in candidates})
    chosen = [hopeful[id(kind)]["chosen"] != "cpu" for kind in kinds]
    if batch_invariant:
        chosen = _invariant_segments(models, chosen, set(candidates), {})
    steps, files = lowered_steps(plan, segments, models, chosen)
    lowered, cpu_plan = restep(plan, steps), restep(plan, plan.steps)
    lowered.meta, cpu_plan.meta = {**plan.meta, "kernel_choice": trial_choice}, trial_meta
    if whole_plan_question(cpu_plan, lowered) is not None or whole_step_refusal(graph) is not None:
        return None
    levels = {node.name: INT8_COMPUTE for i in candidates for node in segments[i].nodes}
    lowered.meta["decode_graph"] = {"chosen": False, "why": INVARIANT_NO_GRAPH} if batch_invariant else \
        plan_decode_graph(graph, lowered, files, "auto", FP32_COMPUTE, levels, measure_step=False)
    verdict = choose_whole_plan(graph, cpu_plan, lowered, files, trial_choice)
    if verdict["chosen"] != "cpu" or verdict.get("why", "").startswith(BUSY):
        return None
    for i in candidates:
        kinds[i].setdefault("excluded", {})[INT8_ACTIVATIONS] = NOT_CHECKED
    choice["whole_plan"] = {**verdict, "lowered": "int8 activations wherever a candidate (unchecked)"}
    cpu_plan.meta = {**cpu_plan.meta, "kernel_choice": {**choice, **cpu_plan.meta["kernel_choice"]}}
    return cpu_plan


def _invariant_segments(built, chosen: list[bool], int8: set[int], choice: dict) -> list[bool]:
    """`chosen` less the segments whose MatMulNBits stay on fp32 activations (not among `int8`), noted
    in `choice`."""
    kept = [i for i, on in enumerate(chosen) if on and i not in int8 and fp32_nbits(built[i][0])]
    if kept:
        choice["batch_invariant"] = (f"{len(kept)} segment(s) kept on torch: their MatMulNBits on fp32 activations "
                                     f"round a row differently at 1 and more rows")
    return [on and i not in kept for i, on in enumerate(chosen)]


def torch_dispatch_plan(plan: Plan, graph: Graph) -> Plan:
    """The torch plan with its quantised linears' switch to dense GEMMs measured now (once per shape,
    per machine), as auto records it: otherwise every load would measure it (31 s for a 1B model)."""
    record = dispatch_record([(s.kernel, s.inputs, s.attrs) for s in plan.steps], graph.weights, resolve_threads(),
                             meta=plan.meta)
    plan.meta = {**plan.meta, "kernel_choice": {"mode": "cpu", DISPATCH_META: record}}
    return plan


def _whole_plan(graph: Graph, cpu_plan: Plan, lowered: Plan, files: dict[str, bytes], choice: dict):
    """(plan, files) as ort_plan_choice.py chooses: the cpu plan, or the lowered one walked or
    through its decode graph."""

    verdict = choice["whole_plan"] = choose_whole_plan(graph, cpu_plan, lowered, files, choice)
    if verdict["chosen"] == "cpu":
        choice.pop("int8_activations", None)   # nothing runs on them
        cpu_plan.meta = {**cpu_plan.meta, "kernel_choice": {**choice, **cpu_plan.meta["kernel_choice"]}}
        return cpu_plan, {}
    if verdict["chosen"] == "walk" and "graph" in verdict["step_us"]:
        us = verdict["step_us"]
        graph_verdict = graph_step_verdict(us["graph"], us["walk"], us["launches"])
        if graph_verdict["chosen"]:
            lowered.meta["decode_graph"].update(graph_verdict)
        else:
            lowered.meta["decode_graph"] = graph_verdict
            files.pop(DECODE_FILE)
    return lowered, files




def _require_segment_ops(built: list) -> None:
    require_ops(set().union(*(segment_ops(model) for model, _ in built)) if built else set(), "--kernels ort")
