"""Pipeline-parallel artifacts on real torch.distributed gloo ranks: tiny-llama compiled with --pp 2
(one layer a stage, one follower process started once for the module) gives the unsharded
artifact's log-probabilities and greedy tokens; 16 mixed requests batched (micro-batches through
the stages) give what they give alone; inspect shows the stages; a killed stage stops the run with
one error line and leaves no process; a stage whose files changed fails to load, named by its stage;
a KV cache too small for the batch preempts and still gives the unsharded artifact's tokens."""

import os
import signal
import time

import pytest
import torch

import llmc
from llmc.compiler.artifact import read_manifest
from llmc.errors import RuntimeLlmcError
from llmc.runtime.parallel import group
from llmc.runtime.sampling_params import SamplingParams
from tests.llmc_cli import error_line, llmc_in_process
from tests.parallel.sharded_checks import (
    assert_a_changed_rank_1_fails_to_load,
    assert_mixed_requests_batched_equal_alone,
    assert_same_tokens_and_logprobs,
    outputs,
)

PROMPTS = ["The river starts as a thin stream", "Hello! How are you?", "Numbers help us count"]


@pytest.fixture(scope="module")
def pp2_artifact(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("pp") / "tiny-pp2.llmc", pp=2)


@pytest.fixture(scope="module")
def pp2(pp2_artifact):
    model = llmc.load(pp2_artifact)
    yield model
    model.close()


@pytest.fixture
def ranks_free(pp2):
    """A process joins one torch.distributed group at a time: close the module's before another."""
    pp2.close()


def test_greedy_tokens_and_logprobs_equal_the_unsharded_artifact(compiled, pp2):
    want, got = outputs(llmc.load(compiled), PROMPTS), outputs(pp2, PROMPTS)
    assert_same_tokens_and_logprobs(want, got, 1e-4)


def test_16_mixed_requests_batched_equal_their_solo_runs(pp2):
    assert_mixed_requests_batched_equal_alone(pp2, " ".join(PROMPTS), 16, lambda i: 4 + i % 5)


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


def test_a_stage_whose_weights_changed_after_compiling_fails_to_load_naming_its_stage(pp2_artifact, ranks_free,
                                                                                       tmp_path, capfd):
    assert_a_changed_rank_1_fails_to_load(pp2_artifact, tmp_path, capfd, "pipeline stage 1 (rank 1)")


def test_bad_pp_split_is_refused_at_compile(tmp_path, capsys):
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--pp", "2", "--pp-split", "2,1",
                                   "-o", tmp_path / "x.llmc", "-q")
    assert code == 2
    assert error_line(err) == ("--pp-split 2,1: give 2 layer counts of at least 1 adding up to this model's 2 "
                               "decoder layers (e.g. 1,1)")
    assert not (tmp_path / "x.llmc").exists()


def test_a_tight_kv_cache_preempts_and_gives_the_unsharded_tokens(pp2_artifact, ranks_free, compiled):
    gen = torch.Generator().manual_seed(13)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (int(n),), generator=gen).tolist()}
               for n in torch.randint(20, 41, (6,), generator=gen)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    rank0_kv = read_manifest(pp2_artifact)["parallel"]["ranks"][0]["kv_bytes_per_token"]  # --kv-memory is a rank's
    tight = llmc.load(pp2_artifact, kv_memory=8 * 16 * rank0_kv, block_size=16)
    try:
        assert tight.engine.block_manager.num_blocks == 8  # each request ends needing 3-4 blocks
        squeezed = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
        assert tight.engine.metrics.preemptions > 0
    finally:
        tight.close()
    assert squeezed == [o.outputs[0].token_ids for o in llmc.load(compiled).generate(prompts, params)]
