"""A KV policy (runtime/kv_policy.py) through the user's doors: `llmc compile --kv-policy` records it in the plan
and the manifest and a load runs it unless told otherwise; GPU targets refuse it before compiling; `llmc eval
--kv-policy` scores through the engine (the full cache's logits where nothing is evicted) and never ignores an
artifact's own policy; `llmc bench` reports the KV bytes each sequence held; bad flags exit 2 in one line."""

import math

import pytest
from llmc_cli import error_line, llmc_in_process

import llmc
from llmc.errors import LlmcError
from llmc.runtime.engine import Engine, EngineConfig
from llmc.tools.bench import run_engine
from llmc.tools.evaluate import evaluate_text

TEXT = "The river starts as a thin stream in the hills and grows wider as it runs toward the sea. " * 8
POLICY = dict(kv_policy="h2o", kv_budget=32, kv_sinks=2, kv_recent=8)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-policy")
    plain = llmc.compile("tiny-llama", target="cpu", output=root / "plain.llmc", quiet=True, quant="none",
                         kernels="cpu")
    h2o = llmc.compile("tiny-llama", target="cpu", output=root / "h2o.llmc", quiet=True, quant="none",
                       kernels="cpu", **POLICY)
    return plain, h2o


def test_compiled_policy_is_recorded_and_loaded_unless_overridden(artifacts):
    _, h2o = artifacts
    manifest = Engine(h2o, EngineConfig(kv_memory="4MiB")).manifest
    assert manifest["kv_policy"] == {"kind": "h2o", "budget": 32, "recent": 8, "sinks": 2}
    assert Engine(h2o, EngineConfig(kv_memory="4MiB")).kv_policy.as_meta() == manifest["kv_policy"]
    assert Engine(h2o, EngineConfig(kv_memory="4MiB", kv_policy="none")).kv_policy is None
    other = Engine(h2o, EngineConfig(kv_memory="4MiB", kv_policy="streaming", kv_budget=48)).kv_policy
    assert (other.kind, other.budget, other.sinks) == ("streaming", 48, 4)


def test_gpu_target_refuses_the_policy_before_compiling(tmp_path):
    with pytest.raises(LlmcError, match="Triton attention kernels keep no attention scores"):
        llmc.compile("tiny-llama", target="h100-bf16", output=tmp_path / "gpu.llmc", quiet=True, **POLICY)
    assert not (tmp_path / "gpu.llmc").exists()


def test_eval_scores_through_the_policy_and_never_ignores_it(artifacts):
    plain, h2o = artifacts
    window = dict(max_tokens=160, context=80, stride=40)
    roomy = evaluate_text(plain, TEXT, ref=plain, kv_policy={"kv_policy": "h2o", "kv_budget": 128}, **window)
    assert roomy["kl"] < 1e-9 and roomy["top1_agreement"] == 1.0   # nothing evicted: the full cache's logits
    tight = evaluate_text(plain, TEXT, ref=plain, kv_policy={"kv_policy": "streaming", "kv_budget": 24}, **window)
    assert tight["kl"] > 1e-4 and tight["kv_policy"]["kind"] == "streaming"
    own = evaluate_text(h2o, TEXT, ref=plain, **window)
    assert own["kv_policy"]["kind"] == "h2o" and own["kl"] > 1e-4
    full = evaluate_text(h2o, TEXT, ref=plain, kv_policy={"kv_policy": "none"}, **window)
    assert full["kl"] == 0.0 and "kv_policy" not in full


def test_bench_reports_kv_bytes_held_per_sequence(artifacts):
    plain, _ = artifacts
    engine = Engine(plain, EngineConfig(kv_memory="4MiB", block_size=4, **POLICY))
    requests = [{"prompt_token_ids": list(range(3, 3 + n)), "max_tokens": 30, "ignore_eos": True, "arrival": 0.0}
                for n in (50, 10)]
    report = run_engine(engine, requests, progress=False).kv_per_seq
    block = 4 * engine.model["kv_bytes_per_token"]
    assert report["max_bytes"] == math.ceil(32 / 4) * block
    assert report["full_cache_mean_bytes"] > report["mean_bytes"]
    assert report["policy"].startswith("h2o: budget 32")


@pytest.mark.parametrize("args, where", [
    (["eval", "ART", "--kv-budget", "64"], "--kv-budget"),
    (["eval", "ART", "--kv-policy", "h2o"], "--kv-budget"),
    (["eval", "ART", "--kv-policy", "streaming", "--kv-budget", "64", "--kv-recent", "8"], "--kv-recent"),
    (["eval", "ART", "--context", "64", "--stride", "64"], "--stride"),
])
def test_bad_policy_flags_exit_2_in_one_line(artifacts, capfd, args, where):
    plain, _ = artifacts
    code, _, err = llmc_in_process(capfd, *[str(plain) if a == "ART" else a for a in args])
    assert code == 2 and where in error_line(err)
