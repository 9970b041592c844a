"""Tensor and pipeline parallelism together: tiny-llama compiled with --tp 2 --pp 2 (rank = stage * 2
+ tp_rank; three follower processes, one thread each, started once for the module) gives the
unsharded artifact's log-probabilities and greedy tokens, and batched requests (micro-batches through
both stages' tp groups) what they give alone; a killed rank stops the run in one line with no process
left; each rank holds half its stage's layer; the manifest and inspect name each rank's stage and tp
rank; `llmc bench` reports each rank's weights, memory and time in all_reduce and send/recv; a
combination that does not fit is refused in one line."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import llmc
from llmc.compiler.artifact import read_artifact, read_manifest
from llmc.errors import RuntimeLlmcError
from llmc.runtime.parallel import group
from llmc.runtime.sampling_params import SamplingParams
from tests.llmc_cli import error_line, llmc_in_process
from tests.parallel.sharded_checks import (
    assert_mixed_requests_batched_equal_alone,
    assert_same_tokens_and_logprobs,
    outputs,
)

PROMPTS = ["The river starts as a thin stream", "Hello! How are you?", "Numbers help us count"]


@pytest.fixture(scope="module")
def tp2pp2_artifact(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("tp-pp") / "tiny-tp2pp2.llmc",
                        tp=2, pp=2)


@pytest.fixture(scope="module")
def tp2pp2(tp2pp2_artifact):
    model = llmc.load(tp2pp2_artifact)  # one thread per rank (the machine's threads over 4 ranks, at least 1)
    yield model
    model.close()


def test_greedy_tokens_and_logprobs_equal_the_unsharded_artifact(compiled, tp2pp2):
    want, got = outputs(llmc.load(compiled), PROMPTS), outputs(tp2pp2, PROMPTS)
    assert_same_tokens_and_logprobs(want, got, 1e-4)


def test_mixed_requests_batched_equal_their_solo_runs(tp2pp2):
    assert_mixed_requests_batched_equal_alone(tp2pp2, " ".join(PROMPTS), 6, lambda i: 3 + i % 4)


def test_a_killed_rank_stops_the_run_with_one_error_and_no_process_left(tp2pp2):
    # the last test of the module's group: it kills stage 1's tp rank 1, whose all_reduce partner then fails too
    followers = tp2pp2.engine.runner._ranks.procs
    engine = tp2pp2.engine
    engine.add_request(prompt=PROMPTS[0], params=SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(followers[2].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeLlmcError, match=r"^pipeline stage 1 \(rank 3\) exited \(code -9\) during a "
                                               r"step; the run stopped and the other ranks were shut down$"):
        for _ in range(200):
            engine.step()
    assert time.monotonic() - start < group.DEFAULT_TIMEOUT_S
    assert all(p.poll() is not None for p in followers)


def test_each_rank_holds_half_of_its_stages_layer(tp2pp2_artifact):
    manifest = read_manifest(tp2pp2_artifact)
    parallel, config = manifest["parallel"], manifest["model"]["hf_config"]
    assert (parallel["tp"], parallel["pp"], parallel["split"], parallel["logits"]["rank"]) == (2, 2, [1, 1], 2)
    assert [(r["stage"], r["tp_rank"], r["layers"]) for r in parallel["ranks"]] == [
        (0, 0, [0, 1]), (0, 1, [0, 1]), (1, 0, [1, 2]), (1, 1, [1, 2])]
    h, inter, vocab, d = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "head_dim"))
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = (h * (q + 2 * kv) + q * h + 3 * h * inter) // 2 + 2 * h  # norms whole on every rank
    rope = d // 2                                                    # inverse frequencies, whole
    embedding = head = vocab // 2 * h
    want = [embedding + layer + rope] * 2 + [layer + h + head + rope] * 2
    got = [sum(w.numel() for w in read_artifact(tp2pp2_artifact, rank=r).weights.values()) for r in range(4)]
    assert got == want
    assert (manifest["model"]["num_layers"], manifest["model"]["num_kv_heads"]) == (2, config["num_key_value_heads"])


def test_inspect_names_each_ranks_stage_and_tp_rank(tp2pp2_artifact, capsys):
    code, out, _ = llmc_in_process(capsys, "inspect", tp2pp2_artifact)
    assert code == 0
    assert "pipeline parallel: 2 stages x 2 tensor-parallel ranks each, layers split 1,1" in out
    assert "rank3 (stage 1, tp rank 1): layers 1-1 (1)" in out


def test_bench_reports_each_ranks_weights_memory_and_time_in_collectives_and_send_recv(tp2pp2_artifact):
    # a process of its own: this one already belongs to the module's group
    llmc_cli = os.path.join(os.path.dirname(sys.executable), "llmc")
    run = subprocess.run([llmc_cli, "bench", str(tp2pp2_artifact), "-n", "4", "--input-len", "8", "--output-len", "4",
                          "--kv-memory", "16MiB", "--threads", "1", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    ranks = json.loads(run.stdout)["ranks"]
    manifest = read_manifest(tp2pp2_artifact)["parallel"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["weight_bytes"] for r in ranks] == [sum(m["weight_bytes"].values()) for m in manifest]
    assert [r["layers"] for r in ranks] == [[0, 1], [0, 1], [1, 2], [1, 2]]
    for r in ranks:  # every rank all-reduces within its stage and sends or receives hidden states or logits
        assert r["rss_bytes"] > r["weight_bytes"] and r["all_reduce_s"] > 0 and r["send_recv_s"] > 0


def test_more_stages_than_layers_is_refused_in_one_line(tmp_path, capsys):
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--tp", "2", "--pp", "3",
                                   "-o", tmp_path / "x.llmc", "-q")
    assert code == 2
    assert error_line(err) == ("--pp 3: this model has 2 decoder layers and a pipeline stage needs at least one; "
                               "give --pp 2 or fewer")
    assert not (tmp_path / "x.llmc").exists()
