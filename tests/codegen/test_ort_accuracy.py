"""auto's check of MatMulNBits on int8 activations (compiler/driver/tuning/ort_accuracy.py) on tiny-llama int4, with
the timings faked so that int8 activations are the fastest and fp32 MatMulNBits the next: the check
runs the lowered model on the compile's calibration sequences; its figure for the exact kernels
equals the quantisation pass's own (measured by the reference interpreter); accepted, the segments
and the decode graph run on int8 activations and the artifact's logits equal `--kernels ort`'s (the
same MatMulNBits level throughout); refused, nothing does, and each kind says why with the figures;
without calibration logits nothing is tried. inspect shows the check."""

import json

import onnx
import pytest
import torch
from llmc_cli import llmc_in_process
from timing_fakes import lowered_wins

import llmc
from llmc.codegen.plan import Plan
from llmc.compiler.artifact import read_artifact
from llmc.compiler.driver.tuning import ort_accuracy, ort_timing
from llmc.runtime.executor import PlanExecutor

INT4 = {"quant": "int4-rtn", "group_size": 32}
SPEED = {"ort-int8": 1.0, "ort": 1.5, "cpu": 2.0}   # us per call, decode and prefill alike


def _measure(runners, graph, seg, outputs=None):
    return {name: {"decode": SPEED[name], "prefill": SPEED[name]} for name in runners}


def _compile(root, name: str, kl_slack: float | None = None, **options):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMC_CACHE", str(root / "cache"))
        patch.setattr(ort_timing, "measure", _measure)
        lowered_wins(patch)
        if kl_slack is not None:
            patch.setattr(ort_accuracy, "KL_SLACK", kl_slack)
            patch.setattr(ort_accuracy, "TOP1_SLACK", 1.0 if kl_slack > 0 else -1.0)
        # batch invariance off: on, auto keeps fp32-activation MatMulNBits on torch and offers no decode graph
        return llmc.compile("tiny-llama", output=root / f"{name}.llmc", quiet=True, batch_invariant="off", **options)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("ort_accuracy")
    return {"kept": _compile(root, "kept", 1e9, **INT4), "refused": _compile(root, "refused", -1.0, **INT4),
            "ort": _compile(root, "ort", kernels="ort", **INT4)}


def _choice(path) -> dict:
    return json.loads((path / "plan.json").read_text())["meta"]


def _levels(path) -> dict[str, set[int]]:
    """accuracy_level of the MatMulNBits nodes in each of the artifact's ONNX files."""
    a = read_artifact(path)
    return {name: {onnx.helper.get_attribute_value(x) for n in onnx.load_from_string(data).graph.node
                   if n.op_type == "MatMulNBits" for x in n.attribute if x.name == "accuracy_level"}
            for name, data in a.data.items()}


def _logits(path, inputs) -> torch.Tensor:
    a = read_artifact(path)
    return PlanExecutor(Plan.from_json(a.plan_json), a.weights, data=a.data).run_values(inputs)["logits"]


def test_the_exact_figure_is_the_quantisation_pass_s_own(compiled):
    meta = _choice(compiled["kept"])
    gate = meta["kernel_choice"]["int8_activations"]
    manifest = json.loads((compiled["kept"] / "manifest.json").read_text())
    measured = next(p["accuracy"] for p in manifest["pipeline"] if p["name"].startswith("quantize"))
    assert gate["tokens"] == measured["tokens"]
    # the exact kernels (fp32 MatMulNBits) compute what the interpreter does, to float rounding
    assert gate["exact"]["kl"] == pytest.approx(measured["kl"], rel=1e-3, abs=1e-6)
    assert gate["exact"]["top1"] == pytest.approx(measured["top1_agreement"], abs=2 / gate["tokens"])


def test_kept_int8_activations_run_in_segments_and_decode_graph_as_kernels_ort_does(compiled):
    meta = _choice(compiled["kept"])
    gate, kinds = meta["kernel_choice"]["int8_activations"], meta["kernel_choice"]["measured"]["kinds"]
    assert gate["tried"][0]["kept"] and gate["accepted"] == sum(k["segments"] for k in kinds if "qlinear" in k["ops"])
    for kind in kinds:
        if "qlinear" in kind["ops"]:
            assert kind["chosen"] == "ort-int8" and "ort-int8" not in kind.get("excluded", {})
    levels = _levels(compiled["kept"])
    assert levels["ort/decode.onnx"] == {4} and set().union(*levels.values()) == {4}
    t = int(torch.randint(2, 40, ()))
    inputs = {"input_ids": torch.randint(0, 512, (t,)), "positions": torch.arange(t), "logits_indices": torch.arange(t)}
    want = _logits(compiled["ort"], inputs)
    torch.testing.assert_close(_logits(compiled["kept"], inputs), want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_refused_int8_activations_run_nowhere_and_each_kind_says_why(capsys, compiled):
    meta = _choice(compiled["refused"])
    gate, kinds = meta["kernel_choice"]["int8_activations"], meta["kernel_choice"]["measured"]["kinds"]
    assert gate["accepted"] == 0 and not any(t["kept"] for t in gate["tried"])
    # every candidate first, then all but the segment computing the logits
    assert [t["segments"] for t in gate["tried"]] == [3, 2]
    assert set().union(*_levels(compiled["refused"]).values()) == {1}
    for kind in kinds:
        assert kind["chosen"] == "ort" and f"from {gate['exact']['kl']:.4g} to" in kind["excluded"]["ort-int8"]
    code, out, _ = llmc_in_process(capsys, "inspect", compiled["refused"])
    assert code == 0 and "int8 activations, checked over" in out and "(refused)" in out


def test_without_calibration_logits_nothing_is_tried():
    kinds = [{"chosen": "ort", "int8_candidate": True, "excluded": {"ort-int8": "x"}}, {"chosen": "cpu"}]
    int8, record = ort_accuracy.gate_int8_activations(None, None, [None, None], [None, None], kinds, None, None)
    assert int8 == set() and record["accepted"] == 0 and "no calibration logits" in kinds[0]["excluded"]["ort-int8"]
    assert ort_accuracy.gate_int8_activations(None, None, [], [], [{"chosen": "cpu"}], None, None) == (set(), None)


def test_a_candidate_saving_too_little_is_not_checked():
    """The check runs the model twice over the calibration text: a saving under MIN_GAIN of the measured
    request is refused before it (and never scored: graph, plan and reference are not touched)."""
    us = lambda *t: {name: {"decode": v, "prefill": 10 * v} for name, v in zip(("cpu", "ort", "ort-int8"), t)}
    head = {"chosen": "ort", "int8_candidate": True, "us": us(200, 100, 99), "segments": 1}
    layer = {"chosen": "cpu", "us": us(300, 400, 500), "segments": 30}
    kinds = [head] + [layer] * 30
    gain = ort_accuracy.int8_gain(kinds, [0])
    assert gain == pytest.approx((100 - 99) / (100 + 30 * 300)) and gain < ort_accuracy.MIN_GAIN
    reference = object()   # would fail if scored
    int8, record = ort_accuracy.gate_int8_activations(None, None, [None] * 31, [None] * 31, kinds, reference, None)
    assert int8 == set() and record["accepted"] == 0 and "would save 0.0%" in head["excluded"]["ort-int8"]
    # the same candidate saving a third of the request is checked (here: scoring is reached)
    head["us"]["ort-int8"] = {"decode": 1, "prefill": 10}
    layer["us"] = us(1, 2, 3)
    assert ort_accuracy.int8_gain(kinds, [0]) > ort_accuracy.MIN_GAIN


def test_no_check_runs_where_the_unlowered_plan_beats_even_int8_activations(tmp_path):
    """The check is skipped (never scored) where a whole decode step of the unlowered plan beats the lowered
    plan with every candidate on int8 activations, its fastest form: no subset the check could accept would
    change the choice. One whole-step timing; each candidate says why it was not checked."""
    from llmc.compiler.driver.tuning import kernel_choice, ort_decode_timing

    timed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
        patch.setattr(ort_timing, "measure", _measure)
        patch.setattr(ort_decode_timing, "measure_plans", lambda graph, candidates: timed.append(sorted(candidates))
                      or {n: {"cpu": 1.0, "graph": 2.0, "walk": 3.0, "launches": 4.0}[n] for n in candidates})
        patch.setattr(ort_accuracy, "score", lambda *a: pytest.fail("the calibration check ran"))
        path = llmc.compile("tiny-llama", output=tmp_path / "a.llmc", quiet=True, batch_invariant="off", **INT4)
    meta = _choice(path)
    choice = meta["kernel_choice"]
    assert timed == [["cpu", "graph", "launches", "walk"]] and choice["whole_plan"]["chosen"] == "cpu"
    assert "int8_activations" not in choice and not read_artifact(path).data
    assert not any(s["kernel"] == "ort.segment" for s in json.loads((path / "plan.json").read_text())["steps"])
    for kind in choice["measured"]["kinds"]:
        if "qlinear" in kind["ops"]:
            assert kind["excluded"]["ort-int8"] == kernel_choice.NOT_CHECKED
