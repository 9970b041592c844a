"""Speculative decoding in the engine on tiny-llama: greedy requests give exactly the tokens of
plain decoding (n-gram lookup, a real `--draft-of` draft, and the target as its own draft),
batched, alone and beside requests that cannot speculate; no KV block of the target or of the
draft outlives its requests, through preemption and aborts; seeded sampling repeats itself; and
the values a user can get wrong are refused with one line."""

import json
import random

import pytest
import torch
from llmc_cli import error_line, llmc_in_process
from tampered import rehash

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams

VOCAB = 512


@pytest.fixture(scope="module")
def draft(artifact, tmp_path_factory):
    """A real draft of the tiny-llama artifact: half its layers, int4 weights."""
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("draft") / "draft.llmc",
                        draft_of=str(artifact))


def methods(artifact, draft) -> dict[str, dict]:
    """Not adaptive: these tests check that drafting is exact, so every request drafts every step
    (adaptive k would rightly stop drafting where tiny-llama's drafts are seldom kept)."""
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
            "draft": {"method": "draft", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False},
            "self-draft": {"method": "draft", "model": str(artifact), "num_speculative_tokens": 2, "adaptive": False}}


def make_engine(artifact, speculative=None, kv_memory="4MiB") -> Engine:
    return Engine(artifact, EngineConfig(kv_memory=kv_memory, block_size=16, speculative=speculative))


def repetitive_prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts that repeat a random phrase, so prompt lookup finds drafts, right and wrong."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(3, 14, (1,), generator=gen)),), generator=gen).tolist()
            * int(torch.randint(2, 5, (1,), generator=gen)) for _ in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    ids = [engine.add_request(prompt_token_ids=p, params=sp) for p, sp in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants()
    return [done[i] for i in ids]


def assert_no_blocks_held(engine: Engine) -> None:
    engine.step()  # lets the speculator drop what finished sequences held
    managers = [engine.block_manager]
    if hasattr(engine.speculator.proposer, "block_manager"):
        managers.append(engine.speculator.proposer.block_manager)
    for bm in managers:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks and not bm.seqs


@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
def test_greedy_speculation_gives_plain_decodings_tokens(artifact, draft, method):
    prompts = repetitive_prompts(1, 6)
    # requests that cannot speculate (logprobs, penalties) share the batches; one stops at 5 tokens
    requests = [(p, greedy(48)) for p in prompts] + [(prompts[0], greedy(20, logprobs=1)),
                                                     (prompts[1], greedy(20, repetition_penalty=1.3)),
                                                     (prompts[2], greedy(5))]
    plain = run(make_engine(artifact), requests)
    engine = make_engine(artifact, methods(artifact, draft)[method])
    assert run(engine, requests) == plain
    assert [run(engine, [r])[0] for r in requests[:2]] == plain[:2]
    spec = engine.metrics.speculative
    assert spec.num_accepted_tokens > 0
    if method != "self-draft":
        assert spec.num_accepted_tokens < spec.num_draft_tokens  # rejections were rolled back too
    assert engine.metrics.generation_tokens == 6 * 48 + 20 + 20 + 5 + 2 * 48
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("method,num_requests", [("ngram", 500), ("draft", 40)])
def test_no_kv_block_outlives_mixed_requests_preemption_and_aborts(artifact, draft, method, num_requests):
    """Speculative and plain requests (logprobs decode plainly) in one batch, aborted at random."""
    engine = make_engine(artifact, methods(artifact, draft)[method], kv_memory="192KiB")
    rng = random.Random(0)
    prompts = repetitive_prompts(2, num_requests)
    live = []
    for step in range(100 * num_requests):
        if prompts and rng.random() < 0.5:
            sampled = rng.random() < 0.5
            params = SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.9, seed=rng.randrange(99),
                                    max_tokens=rng.randrange(1, 40), ignore_eos=True,
                                    logprobs=1 if rng.random() < 0.2 else None)
            live.append(engine.add_request(prompt_token_ids=prompts.pop(), params=params))
        if live and rng.random() < 0.08:
            engine.abort(live.pop(rng.randrange(len(live))))
        engine.step()
        engine.block_manager.check_invariants()
        if not prompts and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.metrics.preemptions > 0 and engine.metrics.speculative.num_drafts > 0
    assert_no_blocks_held(engine)


def test_seeded_sampling_repeats_and_a_self_draft_is_always_kept(artifact, draft):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=123, max_tokens=30, ignore_eos=True)
    requests = [(p, params) for p in repetitive_prompts(3, 3)]
    first = run(make_engine(artifact, methods(artifact, draft)["draft"]), requests)
    assert run(make_engine(artifact, methods(artifact, draft)["draft"]), requests) == first
    engine = make_engine(artifact, methods(artifact, draft)["self-draft"])
    run(engine, requests)
    spec = engine.metrics.speculative
    # q equals p up to rounding, so min(1, p/q) keeps nearly every draft
    assert spec.num_accepted_tokens >= 0.95 * spec.num_draft_tokens > 0


@pytest.mark.parametrize("speculative, fragment", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an integer >= 1"),
    ({"method": "medusa"}, "method 'medusa' is unknown"),
    ({"method": "draft"}, "needs model=PATH"),
    ({"method": "draft", "model": "/no/such/draft.llmc"}, "is no artifact directory"),
    ({"method": "ngram", "k": 3}, "unknown key(s) k"),
    ("draft:", "needs model=PATH"),
])
def test_bad_speculative_values_are_refused(artifact, speculative, fragment):
    with pytest.raises(RuntimeLlmcError) as e:
        llmc.load(artifact, kv_memory="4MiB", speculative=speculative)
    assert fragment in str(e.value)


def test_a_draft_with_another_tokenizer_is_refused(artifact, art):
    tokenizer_json = art / "tokenizer" / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == 100)
    vocab[token + "x"] = vocab.pop(token)
    tokenizer_json.write_text(json.dumps(data))
    rehash(art)
    with pytest.raises(RuntimeLlmcError, match="another tokenizer"):
        make_engine(artifact, f"draft:{art}")


def test_cli_runs_speculatively_and_refuses_bad_flags(artifact, tmp_path, capsys):
    prompt = tmp_path / "article_and_question.txt"
    prompt.write_text("the cat sat on the mat. the cat sat on the mat.\nQuestion: where did the cat sit?\n")
    args = ["run", artifact, "--prompt-file", prompt, "--max-tokens", 24, "--kv-memory", "4MiB"]
    code, plain, _ = llmc_in_process(capsys, *args)
    assert code == 0
    code, out, _ = llmc_in_process(capsys, *args, "--speculative", "ngram", "--num-speculative-tokens", 5)
    assert code == 0 and out == plain
    for bad, fragment in ((["--speculative", "bogus"], "method 'bogus' is unknown"),
                          (["--speculative", "ngram", "--num-speculative-tokens", 0], "--num-speculative-tokens"),
                          (["--num-speculative-tokens", 3], "needs --speculative"),
                          (["--speculative", f"draft:{tmp_path / 'missing'}"], "is no artifact directory")):
        code, _, err = llmc_in_process(capsys, *args, *bad)
        assert code == 2 and fragment in error_line(err)


def test_bench_json_reports_acceptance_and_speedup(artifact, capsys):
    code, out, _ = llmc_in_process(capsys, "bench", artifact, "-n", 3, "--input-len", 24, "--output-len", 16,
                                   "--kv-memory", "4MiB", "--speculative", "ngram", "--json")
    assert code == 0
    spec = json.loads(out)["speculative"]
    assert spec["method"] == "ngram" and spec["speedup"] > 0 and spec["plain_output_tokens_per_s"] > 0
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
            "acceptance_rate_per_position", "mean_accepted_length"} <= set(spec)


def test_k_follows_acceptance_and_speculation_stops_where_it_would_not_pay(artifact):
    from llmc.runtime.speculative import PROBE_AFTER

    engine = make_engine(artifact, {"method": "ngram", "num_speculative_tokens": 5})
    engine.add_request("r", prompt_token_ids=[5, 6, 7], params=greedy(200))
    engine.step()
    sample = engine.requests["r"].samples[0]
    speculator = engine.speculator
    assert speculator._k(sample.seq, sample.state, 1) == 5  # optimistic at first
    for _ in range(30):
        speculator.acceptance[sample.seq.seq_id].update(5, 0)  # every first draft rejected
    ks = [speculator._k(sample.seq, sample.state, 1) for _ in range(PROBE_AFTER)]
    assert ks == [0] * (PROBE_AFTER - 1) + [5]  # off, then one probe to measure again
    for _ in range(30):
        speculator.acceptance[sample.seq.seq_id].update(5, 5)
    assert speculator._k(sample.seq, sample.state, 1) == 5
    # on a CPU a step of 2 tokens costs 1.3x one of 1 (2x where the linears are not blocked, see
    # StepCost): drafting alone pays where most drafts are kept, not where few are
    assert speculator.tokens_per_cost(0.8, 4, 1) > 1.3 * speculator.tokens_per_cost(0.8, 0, 1)
    assert speculator.tokens_per_cost(0.2, 4, 1) < speculator.tokens_per_cost(0.2, 0, 1)


def test_drafts_are_priced_against_the_rows_others_already_added(artifact):
    """Steps cost little more up to 8 rows and much more past them (as measured on the default
    artifact: the native program, then the walk): a sequence drafting alone gets its k; one that would
    push a step already holding 8 decodes and another's drafts past them gets none, and the step's
    rows grow only by the drafts given."""
    from llmc.runtime.step_cost import StepCost

    engine = make_engine(artifact, {"method": "ngram", "num_speculative_tokens": 4})
    engine.add_request("r", prompt_token_ids=[5, 6, 7], params=greedy(200))
    engine.step()
    sample = engine.requests["r"].samples[0]
    speculator = engine.speculator
    speculator.step_cost = StepCost(table=((1, 1.0), (2, 1.05), (4, 1.1), (8, 1.2), (16, 8.0)))
    speculator._k(sample.seq, sample.state, 1)   # its acceptance record, at the prior
    for _ in range(30):
        speculator.acceptance[sample.seq.seq_id].update(4, 4)
    alone = [1.0, 1.0]
    assert speculator._k(sample.seq, sample.state, 1, step=alone) == 4 and alone[0] == 5
    crowded = [12.0, 12.5]   # 8 decodes and another sequence's 4 drafts
    assert speculator._k(sample.seq, sample.state, 8, step=crowded) == 0 and crowded == [12.0, 12.5]
