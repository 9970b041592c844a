"""`torchrun ... -m llmc.runtime.launch` on one machine: three ranks of a --tp 3 tiny Llama joined by
env rendezvous (one thread each), their prompts' prefills run by ring attention, print the
in-process launcher's greedy tokens (no ring attention there) and leave no process behind; so do
tiny-llama's --pp 2 stages and its --tp 2 --pp 2 ranks; a killed rank makes the others exit, each
with one error line, well within the collective timeout; without torchrun's environment, with the
wrong number of ranks, or with an unsharded artifact, the entry says so."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

import llmc
from llmc import SamplingParams
from llmc.runtime import launch
from llmc.runtime.parallel.group import TIMEOUT_ENV, free_port

PROMPTS = ["The river starts as a thin stream", "Numbers help us count"]


@pytest.fixture(scope="module")
def tp3_artifact(tmp_path_factory):
    from tiny_hf_models import SPECIAL, VOCAB, save_checkpoint
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("torchrun")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512, **SPECIAL)
    save_checkpoint(config, folder / "hf", seed=12)
    return llmc.compile(str(folder / "hf"), target="cpu", output=folder / "tiny-tp3.llmc", tp=3)


def torchrun(artifact, *args, monitor_s: float = 0.1, ranks: int = 3) -> subprocess.Popen:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", LLMC_NUM_THREADS="1", **{TIMEOUT_ENV: "20"})
    command = [torchrun, "--nnodes", "1", "--nproc-per-node", str(ranks), "--master-port", str(free_port()),
               "--monitor-interval", str(monitor_s), "-m", "llmc.runtime.launch", str(artifact), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def left_behind(artifact) -> list[int]:
    """Processes still running with the artifact on their command line."""
    return [p.pid for p in psutil.process_iter(["cmdline"]) if str(artifact) in " ".join(p.info["cmdline"] or [])]


def assert_torchrun_prints_the_in_process_launchers_tokens(artifact, ranks: int, *args, max_tokens: int = 16):
    proc = torchrun(artifact, "--max-tokens", str(max_tokens), "--json", *args,
                    *[a for p in PROMPTS for a in ("--prompt", p)], ranks=ranks)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    got = [json.loads(line) for line in out.splitlines()]
    model = llmc.load(artifact, threads=1, ring_attention_threshold=0)
    try:
        want = model.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    finally:
        model.close()
    assert [g["prompt"] for g in got] == PROMPTS
    assert [g["token_ids"] for g in got] == [w.outputs[0].token_ids for w in want]
    assert [g["text"] for g in got] == [w.outputs[0].text for w in want]
    assert left_behind(artifact) == []


def test_torchrun_ranks_print_the_in_process_launchers_greedy_tokens(tp3_artifact):
    assert_torchrun_prints_the_in_process_launchers_tokens(tp3_artifact, 3, "--ring-attention-threshold", "8")




@pytest.fixture(scope="module")
def pp2_artifact(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("torchrun") / "tiny-pp2.llmc", pp=2)


def test_torchrun_runs_pipeline_stages_as_the_in_process_launcher_does(pp2_artifact):
    assert_torchrun_prints_the_in_process_launchers_tokens(pp2_artifact, 2, max_tokens=12)


def test_torchrun_runs_tp_x_pp_ranks_as_the_in_process_launcher_does(tmp_path):
    artifact = llmc.compile("tiny-llama", target="cpu", output=tmp_path / "tiny-tp2pp2.llmc", tp=2, pp=2)
    assert_torchrun_prints_the_in_process_launchers_tokens(artifact, 4, max_tokens=12)


@pytest.mark.parametrize("sharded, ranks", [("tp3_artifact", 3), ("pp2_artifact", 2)], ids=["tp3", "pp2"])
def test_a_killed_rank_makes_the_others_exit_with_one_error_line_each(sharded, ranks, request):
    artifact = request.getfixturevalue(sharded)
    # torchrun checks its ranks every 10 s here: the survivors must stop by themselves first (at 5 s a
    # survivor slowed by other work on a 2-core machine was sometimes killed before it said why)
    proc = torchrun(artifact, "--max-tokens", "400", "--ignore-eos",
                    *[a for i in range(8) for a in ("--prompt", f"prompt {i}")], monitor_s=10, ranks=ranks)
    for line in proc.stderr:
        if f"{ranks} ranks ready" in line:
            break
    procs = {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children()}
    procs[1].kill()
    killed = time.monotonic()
    survivors = [p for rank, p in procs.items() if rank != 1]
    _, still = psutil.wait_procs(survivors, timeout=15)
    assert still == [] and time.monotonic() - killed < 15  # the collective timeout is 20 s
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    errors = sorted(line for line in err.splitlines() if line.startswith("error: rank"))
    assert [e[:13] for e in errors] == [f"error: rank {r}" for r in sorted(procs) if r != 1]
    assert f"a collective across the {ranks} torchrun ranks failed or timed out" in errors[0]
    assert left_behind(artifact) == []


def test_without_torchrun_or_with_the_wrong_world_the_entry_says_what_to_do(tp3_artifact, compiled, monkeypatch,
                                                                            capsys):
    for name in launch.RENDEZVOUS_ENV:
        monkeypatch.delenv(name, raising=False)
    assert launch.main([str(tp3_artifact), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == ("error: rank ?: llmc.runtime.launch: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                                       "not set; start it with torchrun (torchrun --nproc-per-node N -m "
                                       "llmc.runtime.launch ART ...) or set them\n")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert launch.main([str(tp3_artifact), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (f"error: rank 0: artifact '{tp3_artifact}' has 3 ranks but torchrun started 2; "
                                       f"make --nnodes x --nproc-per-node = 3\n")
    assert launch.main([str(compiled), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (f"error: rank 0: artifact '{compiled}' is not sharded; this entry serves "
                                       f"--tp/--pp artifacts; use `llmc run` for it\n")
