"""A plan compiled with autotuned launch configs runs exactly the kernels it records. No GPU here, so
the tuning is simulated: compile_model's autotune answers as a GPU would had non-default candidates
timed fastest, and the rest of the path (build_plan with those configs, plan.meta["autotune"], the
artifact) is the real one. The engine's debug check then fails any launch the plan does not record,
and the greedy tokens must equal those of the same model compiled with the target's defaults."""

import pytest
import torch

import llmc
from llmc.cli import main
from llmc.codegen import autotune as autotuning
from llmc.codegen.autotune import default_configs, record
from llmc.codegen.plan import Plan
from llmc.codegen.triton.triton_configs import (
    TileConfig,
    attention_candidates,
    attention_config,
    gemm_candidates,
    tile_config,
)
from llmc.compiler.artifact import read_artifact
from llmc.errors import ArtifactError
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.executor import PlanExecutor, plan_launch_configs
from llmc.runtime.kernel_check import verified_plan
from llmc.runtime.sampling_params import SamplingParams

# fp8 GEMMs (dequant_gemm with a static activation scale) and bf16 attention with fused rotary
TARGET = "h100-fp8"
FAST = dict(calib_samples=2, calib_seq_len=16, max_num_batched_tokens=64)
# Non-default candidates: every GEMM tile dimension changes; attention candidate 1 changes the
# prefill kernel's tiles and warps, candidate 3 the decode kernel's.
GEMM_PICK = gemm_candidates(TARGET)[2]
ATTENTION_PICKS = {"prefill": attention_candidates(TARGET)[1], "decode": attention_candidates(TARGET)[3]}
# a 21-token prompt prefilled in 16-token chunks (the second reads cached context), a short one
# and a one-token one, decoding side by side
PROMPTS = [("long", list(range(30, 51)), 4), ("short", [7, 300, 21, 99, 5], 4), ("one", [77], 3)]


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path_factory.getbasetemp() / "llmc-cache"))


def compile_tiny(path, chosen: dict | None = None):
    """tiny-llama for TARGET; with `chosen`, as if --autotune had timed those configs fastest."""
    if chosen is None:
        return llmc.compile("tiny-llama", target=TARGET, output=path, **FAST)

    def simulated_autotune(graph, target, requested, echo):
        return chosen, record({**default_configs(target), **chosen}, True, device="simulated GPU")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotuning, "autotune", simulated_autotune)
        return llmc.compile("tiny-llama", target=TARGET, output=path, autotune=True, **FAST)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("autotuned")
    paths = {"default": compile_tiny(root / "default.llmc")}
    for name, attention in ATTENTION_PICKS.items():
        paths[name] = compile_tiny(root / f"tuned-{name}.llmc", {"gemm": GEMM_PICK, "attention": attention})
    return paths


def greedy_tokens(path) -> dict[str, list[int]]:
    """PROMPTS through the engine with the debug check that each launched kernel is one its step records."""
    engine = Engine(path, EngineConfig(kv_memory="1MiB", block_size=16, max_num_batched_tokens=16, max_num_seqs=4,
                                       device="cpu", check_kernels=True))
    for rid, prompt, n in PROMPTS:
        engine.add_request(rid, prompt_token_ids=prompt,
                           params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    done = {}
    for _ in range(50):
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if not engine.has_unfinished():
            return done
    raise AssertionError(f"requests unfinished after 50 steps; finished: {sorted(done)}")


def recorded(path, template: str) -> list[dict]:
    plan = Plan.from_json((path / "plan.json").read_text())
    found = {r["sha256"]: r for s in plan.steps for r in s.attrs.get("kernels", ()) if r["template"] == template}
    return list(found.values())


def test_tuned_plans_record_kernels_other_than_the_defaults(artifacts):
    """Else the engine test below could not fail: the default kernels would be the recorded ones."""
    gemm = recorded(artifacts["prefill"], "dequant_gemm.py.j2")
    assert gemm and all(r["constants"]["BLOCK_K"] == GEMM_PICK.block_k for r in gemm)
    assert {r["sha256"] for r in gemm}.isdisjoint(r["sha256"] for r in recorded(artifacts["default"],
                                                                                 "dequant_gemm.py.j2"))
    for name, template in (("prefill", "flash_attention_prefill.py.j2"), ("decode", "paged_decode.py.j2")):
        tuned, default = recorded(artifacts[name], template), recorded(artifacts["default"], template)
        assert tuned and {r["sha256"] for r in tuned}.isdisjoint(r["sha256"] for r in default), name


@pytest.fixture(scope="module")
def default_tokens(artifacts):
    tokens = greedy_tokens(artifacts["default"])
    assert [len(tokens[rid]) for rid, _, _ in PROMPTS] == [n for _, _, n in PROMPTS]
    return tokens


@pytest.mark.parametrize("tuned", list(ATTENTION_PICKS))
def test_engine_launches_the_tuned_kernels_with_the_default_plans_tokens(artifacts, default_tokens, tuned):
    assert greedy_tokens(artifacts[tuned]) == default_tokens


def test_one_shot_forward_launches_the_tuned_kernels(artifacts):
    """executor.run with no backend: the Triton no-cache attention, with the plan's config too."""
    ids = torch.tensor(PROMPTS[0][1])
    inputs = {"input_ids": ids, "positions": torch.arange(len(ids)), "logits_indices": torch.arange(len(ids))}
    logits = {}
    for name in ("prefill", "default"):
        art = read_artifact(artifacts[name])
        executor = PlanExecutor(verified_plan(art), art.weights, "cpu", check_kernels=True)
        logits[name] = executor.run_values(inputs)["logits"].float()
    # the same math with other tiles, so at most another fp32 summation order: within a bf16 ulp
    assert (logits["prefill"] - logits["default"]).abs().max() <= 2 ** -8 * logits["default"].abs().max()


def test_inspect_kernels_shows_the_tuned_constants(artifacts, capfd):
    path = artifacts["prefill"]
    capfd.readouterr()
    try:
        main(["inspect", str(path), "--kernels"])
    except SystemExit as e:
        assert e.code in (0, None), capfd.readouterr().err
    out = capfd.readouterr().out
    assert "launch configs: autotuned on simulated GPU" in out
    lines = out.splitlines()
    for template, want in (("dequant_gemm.py.j2", dict(BLOCK_M=GEMM_PICK.block_m, BLOCK_N=GEMM_PICK.block_n,
                                                       BLOCK_K=GEMM_PICK.block_k, NUM_WARPS=GEMM_PICK.num_warps,
                                                       NUM_STAGES=GEMM_PICK.num_stages)),
                           ("flash_attention_prefill.py.j2", dict(BLOCK_M=ATTENTION_PICKS["prefill"].block_m,
                                                        NUM_WARPS=ATTENTION_PICKS["prefill"].num_warps))):
        rows = [i for i, line in enumerate(lines) if f" {template} " in line]
        assert rows, template
        for i in rows:   # each kernel's constants are on the line after it
            assert all(f"{name}={value}" in lines[i + 1] for name, value in want.items()), lines[i + 1]


def test_launch_configs_come_from_the_plans_autotune_record(artifacts):
    plan = Plan.from_json((artifacts["decode"] / "plan.json").read_text())
    assert plan_launch_configs(plan) == {"gemm": GEMM_PICK, "attention": ATTENTION_PICKS["decode"]}
    del plan.meta["autotune"]
    assert plan_launch_configs(plan) == {"gemm": tile_config(TARGET), "attention": attention_config(TARGET)}


def test_a_malformed_recorded_config_is_refused(artifacts):
    plan = Plan.from_json((artifacts["decode"] / "plan.json").read_text())
    plan.meta["autotune"]["configs"]["gemm"] = {**TileConfig(16, 16, 16, 1, 1).to_dict(), "block_k": 24}
    with pytest.raises(ArtifactError, match=r"meta.autotune.configs.gemm .*no valid TileConfig.*recompile"):
        plan_launch_configs(plan)
    plan.meta["autotune"]["configs"]["gemm"] = {"block_m": 16}
    with pytest.raises(ArtifactError, match=r"meta.autotune.configs.gemm .*no valid TileConfig"):
        plan_launch_configs(plan)
