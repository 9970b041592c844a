"""`--kernels auto` and MatMulNBits on int8 activations (accuracy_level 4): the fastest int4 path on
the CPU, but it rounds each row's activations to int8 per block, which random inputs cannot price
(their error grows with the activations' outliers). So where it measured fastest for some segments
(ort_timing.py), by enough to pay for the check (MIN_GAIN of a request's time), the
whole lowered model runs the compile's calibration sequences twice,
with those segments on int8 activations and with the kernels auto would run otherwise, and both
are scored against the source model's logits (the reference the lossy passes were measured by,
passes/accuracy.py). Int8 activations are kept only where the model's KL to its source and its
top-1 agreement stay within the noise of that measurement (KL_SLACK, TOP1_SLACK); failing that
everywhere, with the segment that computes the logits left exact; failing that, nowhere.

On SmolLM2-135M (samples/eval.txt against the fp32 artifact) this keeps int4-awq at KL 0.2067 ->
0.2072 and equal top-1, and refuses int8 weights (KL 0.0049 -> 0.0060 with the LM head exact) and
the GGUF's own Q4_1 (0.0002 -> 0.0118), whose weights alone are close to the source."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.codegen.ort.onnx_ops import INT8_COMPUTE
from llmc.codegen.ort.ort_lowering import SegmentModels
from llmc.compiler.driver.tuning.ort_timing import INT8_ACTIVATIONS, INT8_EXCLUDED, request_cost
from llmc.compiler.ir import Graph
from llmc.passes.accuracy import mean_kl, significant, top1_agreement
from llmc.runtime.executor import PlanExecutor

KL_SLACK = 0.02      # relative: KL(source || model) may rise by 2% of itself, the noise of ~1,000 tokens
TOP1_SLACK = 0.005   # top-1 agreement may fall by half a point (5 tokens in 1,000)
# the share of a request's measured time int8 activations must save to be worth the check (which runs the
# whole model twice over the calibration text: ~8 s of SmolLM2's int4-gptq compile, to save 0.3%)
MIN_GAIN = 0.03
NO_CALIBRATION = ("no calibration logits to check it on (a compile with a lossy --quant measures them; "
                  "the stored quantisation of a GGUF file is kept without)")


@dataclass
class CalibrationReference:
    """The compile's calibration sequences and the source model's next-token logits on them (each
    [len - 1, vocab]: the last row predicts past the sequence)."""
    seqs: list[torch.Tensor]
    logits: list[torch.Tensor]


def gate_int8_activations(graph: Graph, plan, segments: list, built, kinds: list[dict],
                          reference: CalibrationReference | None, lower) -> tuple[set[int], dict | None]:
    """The segments (indices) to run on int8 activations, and the record of the check (None when no
    segment is a candidate). `lower(built, chosen)` gives (plan, ONNX files) for segment models
    `built` (an ort_lowering.SegmentModels) where `chosen`. `kinds` are updated (an accepted kind is
    chosen as INT8_ACTIVATIONS, a refused one says why in its `excluded`), and so is `built` (the
    accepted segments' models)."""
    candidates = [i for i, kind in enumerate(kinds) if kind.get("int8_candidate")]
    if not candidates:
        return set(), None
    if reference is None:
        _refuse(kinds, candidates, NO_CALIBRATION)
        return set(), {"accepted": 0, "why": NO_CALIBRATION}
    gain = int8_gain(kinds, candidates)
    if gain < MIN_GAIN:
        why = (f"would save {gain:.1%} of a request's measured time, under the {MIN_GAIN:.0%} that pays for "
               f"checking it on the calibration text")
        _refuse(kinds, candidates, why)
        return set(), {"accepted": 0, "why": why}

    int8_built = SegmentModels(graph, segments, INT8_COMPUTE)
    exact_chosen = [kind["chosen"] == "ort" for kind in kinds]
    exact = score(*lower(built, exact_chosen), graph, reference)
    record = {"tokens": sum(len(s) - 1 for s in reference.seqs), "exact": exact, "tried": []}
    for subset in _subsets(candidates, segments, plan):
        trial = built.overlay({i: int8_built[i] for i in subset})
        chosen = [c or i in subset for i, c in enumerate(exact_chosen)]
        figures = score(*lower(trial, chosen), graph, reference)
        kept = figures["kl"] <= exact["kl"] * (1 + KL_SLACK) and figures["top1"] >= exact["top1"] - TOP1_SLACK
        record["tried"].append({"segments": len(subset), **figures, "kept": kept})
        if kept:
            for i in subset:
                kinds[i]["chosen"] = INT8_ACTIVATIONS
                kinds[i].pop("excluded", None)
            _refuse(kinds, [i for i in candidates if i not in subset],
                    "computes the logits: " + _why(exact, record["tried"][0]))
            for i in subset:
                built[i] = int8_built[i]
            return set(subset), {**record, "accepted": len(subset)}
    _refuse(kinds, candidates, _why(exact, record["tried"][0]))
    return set(), {**record, "accepted": 0}


def int8_gain(kinds: list[dict], candidates: list[int]) -> float:
    """The share of a request's time (over the measured kinds, each as often as it runs) that the
    candidates would save on int8 activations."""
    cost = lambda kind, name: request_cost(kind["us"][name]) * kind["segments"]
    measured = {id(k): k for k in kinds if k.get("chosen") in k.get("us", {})}
    total = sum(cost(k, k["chosen"]) for k in measured.values())
    picked = {id(kinds[i]): kinds[i] for i in candidates if id(kinds[i]) in measured}
    saved = sum(max(0.0, cost(k, k["chosen"]) - cost(k, INT8_ACTIVATIONS)) for k in picked.values())
    return saved / total if total else 1.0


def _subsets(candidates: list[int], segments: list, plan) -> list[list[int]]:
    """Every candidate; then all but those computing a plan output (the LM head's rounding reaches
    the logits unsoftened)."""
    inner = [i for i in candidates if not set(segments[i].outputs) & set(plan.outputs)]
    return [candidates] + ([inner] if inner and inner != candidates else [])


@torch.inference_mode()
def score(plan, files: dict[str, bytes], graph: Graph, reference: CalibrationReference) -> dict:
    """KL(source || plan) and top-1 agreement of `plan`'s next-token logits on the calibration
    sequences (each run as one prefill)."""
    executor = PlanExecutor(plan, graph.weights, data=files)
    logits = []
    for seq in reference.seqs:
        positions = torch.arange(len(seq))
        inputs = {"input_ids": seq.long(), "positions": positions, "logits_indices": positions}
        values = executor.run_values({k: v for k, v in inputs.items() if k in plan.inputs})
        logits.append(values[plan.outputs[0]].float()[:-1])
    return {"kl": significant(mean_kl(reference.logits, logits)),
            "top1": significant(top1_agreement(reference.logits, logits))}


def _why(exact: dict, trial: dict) -> str:
    return (f"{INT8_EXCLUDED.split(';')[0]}, and on the calibration text it took the model's KL to its source "
            f"from {exact['kl']:.4g} to {trial['kl']:.4g} and top-1 agreement from {exact['top1']:.3f} to "
            f"{trial['top1']:.3f}")


def _refuse(kinds: list[dict], indices: list[int], why: str) -> None:
    for i in indices:
        kinds[i].setdefault("excluded", {})[INT8_ACTIVATIONS] = why


__all__ = ["CalibrationReference", "gate_int8_activations", "int8_gain", "score", "KL_SLACK", "TOP1_SLACK", "MIN_GAIN"]
