"""Pipeline-parallel artifacts on real torch.distributed gloo ranks: tiny-llama compiled with --pp 2
(one layer a stage, one follower process started once for the module) gives the unsharded
artifact's log-probabilities and greedy tokens; 16 mixed requests batched (micro-batches through
the stages) give what they give alone; inspect shows the stages; a killed stage stops the run with
one error line and leaves no process."""

import os
import signal
import time

import pytest
import torch

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.parallel import group
from llmc.runtime.sampling_params import SamplingParams
from tests.llmc_cli import error_line, llmc_in_process

PROMPTS = ["The river starts as a thin stream", "Hello! How are you?", "Numbers help us count"]


@pytest.fixture(scope="module")
def pp2_artifact(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("pp") / "tiny-pp2.llmc", pp=2)


@pytest.fixture(scope="module")
def pp2(pp2_artifact):
    model = llmc.load(pp2_artifact)
    yield model
    model.close()


def outputs(model, prompts, max_tokens=32):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    return [o.outputs[0] for o in model.generate(prompts, params)]


def test_greedy_tokens_and_logprobs_equal_the_unsharded_artifact(compiled, pp2):
    want, got = outputs(llmc.load(compiled), PROMPTS), outputs(pp2, PROMPTS)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for step_w, step_g in zip(w.logprobs, g.logprobs):
            assert step_g.keys() == step_w.keys()
            for token, lp in step_w.items():
                assert abs(step_g[token].logprob - lp.logprob) < 1e-4


def test_16_mixed_requests_batched_equal_their_solo_runs(pp2):
    gen = torch.Generator().manual_seed(0)
    base = pp2.engine.tokenizer(" ".join(PROMPTS))["input_ids"]
    prompts = [{"prompt_token_ids": base[: 2 + int(torch.randint(0, len(base) - 2, (1,), generator=gen))]}
               for _ in range(16)]
    params = [SamplingParams(max_tokens=4 + i % 5, temperature=0.0, ignore_eos=True) for i in range(16)]
    together = [o.outputs[0].token_ids for o in pp2.generate(prompts, params)]
    alone = [pp2.generate(p, q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone


def test_inspect_shows_each_stages_layers_and_weights(pp2_artifact, capsys):
    code, out, _ = llmc_in_process(capsys, "inspect", pp2_artifact)
    assert code == 0
    assert "pipeline parallel: 2 stages, layers split 1,1" in out
    assert "rank0: layers 0-0 (1), weights 0.3 MiB, KV 256 bytes/token" in out
    assert "rank1: layers 1-1 (1), weights 0.3 MiB, KV 256 bytes/token" in out


def test_a_killed_stage_stops_the_run_with_one_error_and_no_process_left(pp2):
    # the last test of the module's group: it kills the follower
    (follower,) = pp2.engine.runner._ranks.procs
    engine = pp2.engine
    engine.add_request(prompt=PROMPTS[0], params=SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(follower.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeLlmcError, match=r"pipeline stage 1 \(rank 1\) exited \(code -9\) during a step; "
                                               r"the run stopped"):
        for _ in range(200):
            engine.step()
    assert time.monotonic() - start < group.DEFAULT_TIMEOUT_S
    assert follower.poll() is not None


def test_bad_pp_split_is_refused_at_compile(tmp_path, capsys):
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--pp", "2", "--pp-split", "2,1",
                                   "-o", tmp_path / "x.llmc", "-q")
    assert code == 2
    assert error_line(err) == ("--pp-split 2,1: give 2 layer counts of at least 1 adding up to this model's 2 "
                               "decoder layers (e.g. 1,1)")
    assert not (tmp_path / "x.llmc").exists()
