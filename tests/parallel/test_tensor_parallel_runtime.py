"""Tensor-parallel artifacts on real torch.distributed gloo ranks: tiny-llama compiled with --tp 2
(one follower process, started once for the module) gives the unsharded artifact's log-probabilities
and greedy tokens; `llmc run` and `llmc inspect` serve it; a killed or hung rank stops the run with
one error line and leaves no process; a rank whose files were changed fails to load; a --tp that does
not divide is refused at compile."""

import os
import signal
import time

import pytest

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.parallel import group
from llmc.runtime.sampling_params import SamplingParams
from tests.llmc_cli import error_line, llmc_in_process
from tests.parallel.sharded_checks import assert_a_changed_rank_1_fails_to_load

PROMPTS = ["The river starts as a thin stream", "Hello! How are you?", "Numbers help us count"]


@pytest.fixture(scope="module")
def tp2_artifact(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("tp") / "tiny-tp2.llmc", tp=2)


_running = []


@pytest.fixture(scope="module")
def tp2(tp2_artifact):
    """One launched group for the tests that only generate (starting ranks takes seconds)."""
    model = llmc.load(tp2_artifact)
    _running.append(model)
    yield model
    model.close()


@pytest.fixture
def ranks_free():
    """A process joins one torch.distributed group at a time: close the module's before another."""
    for model in _running:
        followers = model.engine.runner._ranks.procs
        model.close()
        assert all(p.poll() is not None for p in followers)


def outputs(model, prompts, max_tokens=64):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    return [o.outputs[0] for o in model.generate(prompts, params)]


def test_greedy_tokens_and_logprobs_equal_the_unsharded_artifact(compiled, tp2):
    want, got = outputs(llmc.load(compiled), PROMPTS), outputs(tp2, PROMPTS)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for step_w, step_g in zip(w.logprobs, g.logprobs):
            assert step_g.keys() == step_w.keys()
            for token, lp in step_w.items():
                assert abs(step_g[token].logprob - lp.logprob) < 1e-5


def test_batched_requests_equal_their_solo_runs(tp2):
    """Bit for bit (docs/architecture.md, "Exactness under --tp N"): each rank's kernels are
    batch-invariant and two ranks' partial sums are added in one order."""
    batched = outputs(tp2, PROMPTS, max_tokens=24)
    solo = [outputs(tp2, [p], max_tokens=24)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in solo]
    logprobs = lambda o: [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs]
    assert [logprobs(o) for o in batched] == [logprobs(o) for o in solo]


def test_an_hf_baseline_is_refused_for_a_sharded_artifact(tp2):
    from llmc.tools.bench import hf_model_from_artifact

    with pytest.raises(RuntimeLlmcError, match="give the unsharded artifact as --baseline PATH"):
        hf_model_from_artifact(tp2.engine)


def test_inspect_shows_each_ranks_weights_kv_and_collectives(tp2_artifact, capsys):
    code, out, _ = llmc_in_process(capsys, "inspect", tp2_artifact)
    assert code == 0
    assert "tensor parallel: 2 ranks" in out
    for rank in (0, 1):
        assert f"rank{rank}: weights 0.3 MiB, KV 256 bytes/token (1 KV heads, 2 query heads), collectives per " \
               f"step: all_gather 1, all_reduce 5" in out


def test_a_second_sharded_llm_in_one_process_is_refused_while_the_first_runs(tp2, tp2_artifact):
    from llmc.runtime.parallel.launch import start_ranks

    with pytest.raises(RuntimeLlmcError, match=r"already belongs to a torch.distributed group .* close that one "
                                               r"first \(LLM.close\(\)\)"):
        start_ranks(tp2_artifact, tp2.engine.manifest, None, None, 1)


def test_a_killed_rank_stops_the_run_with_one_error_and_no_process_left(tp2):
    # the last test of the module's group: it kills the group's follower
    (follower,) = tp2.engine.runner._ranks.procs
    engine = tp2.engine
    engine.add_request(prompt=PROMPTS[0], params=SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(follower.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeLlmcError, match=r"tensor-parallel rank 1 exited \(code -9\) during a step; "
                                               r"the run stopped"):
        for _ in range(200):
            engine.step()
    assert time.monotonic() - start < group.DEFAULT_TIMEOUT_S
    assert follower.poll() is not None
    with pytest.raises(RuntimeLlmcError, match="rank 1 exited"):  # the engine stays stopped
        engine.step()


def test_llmc_run_starts_the_ranks_and_prints_the_unsharded_text(compiled, tp2_artifact, ranks_free, capfd):
    args = ["--prompt", PROMPTS[0], "--max-tokens", "8", "--no-stream"]
    code, want, _ = llmc_in_process(capfd, "run", compiled, *args)
    assert code == 0
    # its prompt's prefill through ring attention on both ranks (the followers take rank 0's threshold)
    code, got, _ = llmc_in_process(capfd, "run", tp2_artifact, *args, "--ring-attention-threshold", "4")
    assert code == 0 and got == want


def test_a_hung_rank_stops_the_run_when_the_collective_times_out(tp2_artifact, ranks_free, monkeypatch):
    monkeypatch.setenv(group.TIMEOUT_ENV, "3")
    model = llmc.load(tp2_artifact)
    (follower,) = model.engine.runner._ranks.procs
    engine = model.engine
    engine.add_request(prompt=PROMPTS[1], params=SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(follower.pid, signal.SIGSTOP)
    with pytest.raises(RuntimeLlmcError, match=r"a collective across the 2 tensor-parallel ranks failed or timed "
                                               r"out \(limit 3 s, .*\); the run stopped"):
        for _ in range(200):
            engine.step()
    assert follower.poll() is not None  # killed, though it could not run


def test_a_rank_whose_weights_changed_after_compiling_fails_to_load_naming_its_file(tp2_artifact, ranks_free,
                                                                                      tmp_path, capfd):
    assert_a_changed_rank_1_fails_to_load(tp2_artifact, tmp_path, capfd, "tensor-parallel rank 1")


def test_tp_that_does_not_divide_is_refused_at_compile(tmp_path, capsys):
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--tp", "3", "-o", tmp_path / "x.llmc", "-q")
    assert code == 2
    assert error_line(err).startswith("--tp 3: the MLP's 128 channels do not split into 3 equal parts; sizes that "
                                      "work for this model: 2, 4, 8, 16 (attention heads split too for: 2)")
    assert not (tmp_path / "x.llmc").exists()
