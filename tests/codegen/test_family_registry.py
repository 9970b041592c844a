"""The kernel-family registry (codegen/family.py): the four families are declared with what they serve,
and a family added by registering it alone (here a toy one, in this file) is what the executor
dispatches a plan's steps to."""

import functools

import pytest
import torch

from llmc.codegen import family
from llmc.codegen.family import FAMILIES, KernelFamily
from llmc.codegen.plan import Plan, PlanStep, build_plan
from llmc.codegen.torch_cpu.cpu_kernels import resolve_kernel as resolve_torch
from llmc.errors import ArtifactError
from llmc.runtime.attention import NoCacheAttention
from llmc.runtime.executor import PlanExecutor, kernel_family

from tiny_llama import random_tokens


def test_the_four_families_say_which_targets_they_serve():
    assert set(FAMILIES) >= {"cpu", "native", "ort", "triton"}
    assert {name for name, why in family.families_for("h100-bf16").items() if why is None} == {"triton"}
    cpu = family.families_for("cpu")
    assert cpu["cpu"] is None and cpu["ort"] is None
    assert "cuda" in cpu["triton"]   # a refusal says why
    assert FAMILIES["ort"].sessions and FAMILIES["ort"].attention == "cpu"
    assert not FAMILIES["native"].runs_steps   # its kernels are called by others, never named by a step


def test_a_plan_mixing_attention_backends_is_refused():
    with pytest.raises(ArtifactError, match=r"families \['cpu', 'triton'\].*recompile"):
        family.attention_backend(["cpu.rms_norm", "triton.qlinear"], "cpu")
    with pytest.raises(ArtifactError, match=r"families \['nosuch'\]"):
        family.attention_backend(["nosuch.rms_norm"], "cpu")
    assert family.attention_backend(["cpu.rms_norm", "ort.segment"], "cpu") == "cpu"


# --- a trivial family: the one file (besides this test) it touches is none; it is registered here -----

CALLS: list[str] = []


def toy_resolve(kernel: str):
    """toy.<op> runs torch's cpu.<op>, counting its launches."""
    inner = resolve_torch("cpu." + kernel.partition(".")[2])

    @functools.wraps(inner)   # keeps the kernel's `context` and `prepare`
    def launch(*args, **kwargs):
        CALLS.append(kernel)
        return inner(*args, **kwargs)
    return launch


TOY = KernelFamily("toy", "toy", lambda target: None if target == "cpu" else "toy serves the cpu target only",
                   candidates=lambda graph, plan, target: plan.steps, resolve=toy_resolve, attention="cpu")


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", TOY)
    CALLS.clear()
    return TOY


def toy_plan(graph) -> Plan:
    plan = Plan.from_json(build_plan(graph, "cpu", 16).to_json())
    plan.steps = [PlanStep("toy." + s.kernel.partition(".")[2], s.inputs, s.outputs, s.attrs, s.node)
                  for s in plan.steps]
    return plan


def test_a_registered_family_is_what_the_executor_runs(tiny_llama, toy_family):
    ids, positions = random_tokens(7)
    want = PlanExecutor(Plan.from_json(build_plan(tiny_llama, "cpu", 16).to_json()),
                        dict(tiny_llama.weights)).run(ids, positions, NoCacheAttention())
    plan = toy_plan(tiny_llama)
    assert kernel_family(plan) == "cpu" and family.family_of("toy.rms_norm") is TOY
    got = PlanExecutor(plan, dict(tiny_llama.weights)).run(ids, positions, NoCacheAttention())
    assert len(CALLS) == len(plan.steps) and set(CALLS) == {s.kernel for s in plan.steps}
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert family.families_for("h100-bf16")["toy"] == "toy serves the cpu target only"


def test_an_unregistered_family_is_refused_at_load(tiny_llama):
    with pytest.raises(ArtifactError, match=r"families \['toy'\]"):
        PlanExecutor(toy_plan(tiny_llama), dict(tiny_llama.weights))
