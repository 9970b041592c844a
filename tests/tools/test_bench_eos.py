"""Benchmarks measure real requests: text workloads end at EOS (random ones, with no natural end,
never do; --ignore-eos forces the fixed length), the HF baseline counts a row's tokens only up to
its EOS though `generate` pads it to the batch's end, every side starts warm, the speculative
figures weigh requests by their tokens, and bench/speculative.py checks that speculation gave plain
decoding's tokens."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from llmc_cli import llmc_in_process

from llmc.runtime.engine import Engine, EngineConfig
from llmc.tools import bench
from llmc.tools.bench import Workload, decode_time_per_token, hf_model_from_artifact, run_engine, run_hf_baseline

ROOT = Path(__file__).resolve().parents[2]
# seed 7 draws samples/open.jsonl's prompt 17 first: tiny-llama answers it with 8 tokens, EOS the
# 8th, while the next prompt runs past OUTPUT_LEN
OPEN = dict(num_requests=2, output_len=16, seed=7, kind="open")
SHORT, OUTPUT_LEN = 8, 16


@pytest.fixture(scope="module")
def engine(artifact):
    return Engine(artifact, EngineConfig(kv_memory="4MiB"))


def test_text_workloads_honour_eos_unless_told_and_random_ones_never(engine):
    assert not Workload(**OPEN).ignore_eos and Workload(**OPEN, ignore_eos=True).ignore_eos
    assert Workload(num_requests=2).ignore_eos
    vocab = engine.model["vocab_size"]
    assert all(r["ignore_eos"] for r in Workload(num_requests=2).build(vocab))
    honoured = run_engine(engine, Workload(**OPEN).build(vocab, engine.tokenizer), progress=False)
    assert [len(ids) for ids in honoured.token_ids.values()] == [SHORT, OUTPUT_LEN]
    assert honoured.token_ids["bench-0"][-1] in engine.eos_token_ids
    assert honoured.output_tokens == SHORT + OUTPUT_LEN == sum(n for _, n in honoured.timeline)
    fixed = run_engine(engine, Workload(**OPEN, ignore_eos=True).build(vocab, engine.tokenizer), progress=False)
    assert fixed.output_tokens == 2 * OUTPUT_LEN
    assert fixed.token_ids["bench-0"][:SHORT] == honoured.token_ids["bench-0"]


def test_hf_baseline_counts_a_padded_row_only_up_to_its_eos(engine):
    """Both requests run in one batch: `generate` pads the one that ended until the other does."""
    model, vocab = hf_model_from_artifact(engine), engine.model["vocab_size"]
    pad, eos = engine.tokenizer.pad_token_id, engine.eos_token_ids
    assert pad not in eos   # else padding would read as EOS and hide a miscount
    honoured = run_hf_baseline(model, Workload(**OPEN).build(vocab, engine.tokenizer), pad, eos, progress=False)
    assert honoured.output_tokens == SHORT + OUTPUT_LEN
    fixed = Workload(**OPEN, ignore_eos=True).build(vocab, engine.tokenizer)
    assert run_hf_baseline(model, fixed, pad, eos, progress=False).output_tokens == 2 * OUTPUT_LEN


def test_decode_time_per_token_weighs_requests_by_their_tokens():
    # one token after the first in 1 s, four in 2 s: 3 s / 5 tokens (a mean of TPOTs says 0.75)
    assert decode_time_per_token([[0.0, 1.0], [0.0, 0.5, 1.0, 1.5, 2.0], [3.0]]) == pytest.approx(0.6)
    assert decode_time_per_token([[1.0], []]) is None


def test_cli_bench_honours_eos_warms_every_side_and_ignore_eos_forces_the_length(artifact, capsys, monkeypatch):
    warm = []
    monkeypatch.setattr(bench, "warm_up", lambda engine, real=bench.warm_up: warm.append("llmc") or real(engine))
    monkeypatch.setattr(bench, "warm_up_hf", lambda *a, real=bench.warm_up_hf: warm.append("hf") or real(*a))
    args = ["bench", artifact, "--workload", "open", "-n", 2, "--seed", 7, "--output-len", OUTPUT_LEN,
            "--kv-memory", "4MiB", "--json"]
    code, out, _ = llmc_in_process(capsys, *args, "--baseline", "hf")
    assert code == 0
    report = json.loads(out)
    assert report["output_tokens"] == report["baseline"]["output_tokens"] == SHORT + OUTPUT_LEN
    assert not report["workload"]["ignore_eos"] and warm == ["llmc", "hf"]
    code, out, _ = llmc_in_process(capsys, *args, "--ignore-eos")
    assert code == 0
    report = json.loads(out)
    assert report["output_tokens"] == 2 * OUTPUT_LEN and report["workload"]["ignore_eos"]


def test_cli_bench_speculative_summary_over_requests_of_different_lengths(artifact, capsys):
    code, out, _ = llmc_in_process(capsys, "bench", artifact, "--workload", "open", "-n", 2, "--seed", 7,
                                   "--output-len", OUTPUT_LEN, "--kv-memory", "4MiB", "--speculative", "ngram",
                                   "--json")
    assert code == 0
    report = json.loads(out)
    spec = report["speculative"]
    assert report["output_tokens"] == SHORT + OUTPUT_LEN and spec["same_tokens_as_plain"]
    assert spec["speedup"] == pytest.approx(report["output_tokens_per_s"] / spec["plain_output_tokens_per_s"])
    assert spec["decode_speedup"] > 0


@pytest.fixture(scope="module")
def speculative_script():
    spec = importlib.util.spec_from_file_location("bench_speculative", ROOT / "bench" / "speculative.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_speculative"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_speculative"]


def test_speculative_script_ends_requests_at_eos_unless_told(speculative_script, artifact, capsys):
    args = [str(artifact), "--workload", "open", "-n", "2", "--seed", "7", "--output-len", str(OUTPUT_LEN), "-k", "3"]
    speculative_script.main(args)
    result = json.loads(capsys.readouterr().out)
    assert result["mean_output_tokens"] == (SHORT + OUTPUT_LEN) / 2 and not result["ignore_eos"]
    speculative_script.main(args + ["--ignore-eos"])
    assert json.loads(capsys.readouterr().out)["mean_output_tokens"] == OUTPUT_LEN


def test_speculative_script_stops_where_speculation_changed_the_tokens(speculative_script):
    speculative_script.check_same_tokens(0, {"plain": [1, 2, 3], "speculative": [1, 2, 3]})
    with pytest.raises(SystemExit, match="prompt 4: speculative decoding differs from plain at output token 2"):
        speculative_script.check_same_tokens(4, {"plain": [1, 2, 3], "speculative": [1, 2, 5]})
