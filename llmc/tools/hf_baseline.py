"""Float weights for the HF baseline of a quantised artifact: each qlinear/qembedding weight
dequantised to fp32 once (a tied table shares one), and AWQ's inserted input scales folded into
the columns of the weights that read them, so HF runs in fp32 the function the artifact stores."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmc.compiler.schemes import INT8_PER_TOKEN, SCHEMES, dequantize_weight

AWQ_SCALE = ".awq_inv_scale"   # passes/quantize_calibrated.py insert_scale_mul names its param so
ACT_QUANT = "activations run in fp32, not quantised as the artifact's are"


def _quant_weight(step, params) -> str | None:
    """The float name (`X` for `X.qweight`) of the quantised weight a step reads, if any."""
    q = next((i for i in step.inputs[1:] if i.endswith(".qweight") and i in params), None)
    return q.removesuffix(".qweight") if q and "scheme" in step.attrs else None


def kernel_steps(plan) -> list:
    """The plan's steps with each ONNX Runtime segment replaced by the cpu steps it stands for, so
    quantised linears are found whichever family runs them."""
    return [inner for step in plan.steps for inner in (step.inner_steps() or [step])]


def dequantised_weights(plan, weight: Callable[[str], torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(fp32 weight per quantised name, the params they replace) for the plan's quantised steps."""
    scaled_by: dict[str, str] = {}    # value -> the AWQ inverse scale it was multiplied by
    out: dict[str, torch.Tensor] = {}
    replaced: set[str] = set()
    for step in kernel_steps(plan):
        if len(step.inputs) == 2 and step.inputs[1].endswith(AWQ_SCALE) and step.inputs[1] in plan.params:
            scaled_by[step.outputs[0]] = step.inputs[1]
            continue
        base = _quant_weight(step, plan.params)
        if base is None or base in out:
            continue
        parts = {p: f"{base}.{p}" for p in ("qweight", "scales", "zeros", "act_scale") if f"{base}.{p}" in plan.params}
        replaced.update(parts.values())
        zeros = weight(parts["zeros"]) if "zeros" in parts else None
        w = dequantize_weight(step.attrs["scheme"], weight(parts["qweight"]), weight(parts["scales"]), zeros)
        if (inv := scaled_by.get(step.inputs[0])) is not None:
            # W·(x/s) == (W/s)·x: HF's linear reads x itself
            w = w * weight(inv).float().to(w.device)[None, :]
            replaced.add(inv)
        out[base] = w.float()
    return out, replaced


def baseline_name(plan) -> str:
    """How `llmc bench --baseline hf` describes what HF runs for this plan."""
    schemes = {s.attrs["scheme"] for s in kernel_steps(plan) if _quant_weight(s, plan.params)}
    if not schemes:
        return "hf"
    act = any(SCHEMES[s.attrs["scheme"]].activations == INT8_PER_TOKEN or s.attrs.get("has_act_scale")
              for s in kernel_steps(plan) if _quant_weight(s, plan.params))
    return f"hf (fp32, dequantised {'/'.join(sorted(schemes))} weights{'; ' + ACT_QUANT if act else ''})"
