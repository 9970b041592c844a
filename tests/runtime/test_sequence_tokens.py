"""A sample's tokens live in one store, its `Sequence`: the sampler's state, the stop checker
and its detokenizer read that store, every output token enters it through
`Sequence.append_token`, and what the engine reports is read from it, through penalties,
stop strings, n > 1 forks, prefix caching and preemption by recompute."""

from collections import Counter

import pytest
import torch

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence

BLOCK = 16
VOCAB = 512


def make_engine(artifact, num_blocks: int | None = None) -> Engine:
    """`num_blocks` None: a roomy cache; otherwise exactly that many KV blocks."""
    kv_memory = "4MiB"
    if num_blocks is not None:
        kv_memory = num_blocks * BLOCK * make_engine(artifact).model["kv_bytes_per_token"]
    return Engine(artifact, EngineConfig(kv_memory=kv_memory, block_size=BLOCK))


def sampled(seed: int, stop: list[str]) -> SamplingParams:
    """Two seeded samples with every penalty on: their tokens do not depend on the batch."""
    return SamplingParams(n=2, temperature=0.9, seed=seed, max_tokens=24, ignore_eos=True, logprobs=1,
                          repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, stop=stop)


def requests(stop: list[str]) -> list[tuple[str, list[int], SamplingParams]]:
    """Four requests sharing a two-block prefix (for the prefix cache), each with two samples."""
    gen = torch.Generator().manual_seed(31)
    shared = torch.randint(3, VOCAB, (2 * BLOCK,), generator=gen).tolist()
    return [(f"r{i}", shared + torch.randint(3, VOCAB, (int(n),), generator=gen).tolist(), sampled(50 + i, stop))
            for i, n in enumerate(torch.randint(4, 12, (4,), generator=gen))]


def run_checking_the_store(engine: Engine, reqs, appends: Counter) -> dict:
    """Runs `reqs` to the end, checking after every step that each sample's sampler state,
    stop checker and reported output read its sequence's tokens; returns, per request,
    its samples and final output."""
    samples = {}
    for rid, ids, params in reqs:
        engine.add_request(rid, prompt_token_ids=ids, params=params)
        samples[rid] = engine.requests[rid].samples  # grows as the request forks
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            by_index = {s.index: s for s in samples[out.request_id]}
            for completion in out.outputs:
                s = by_index[completion.index]
                assert s.state.seq is s.seq and s.stop.seq is s.seq and s.stop.detokenizer.seq is s.seq
                assert completion.token_ids == s.seq.output_token_ids
                assert completion.text == s.stop.output_text
                assert s.seq.prompt_token_ids == out.prompt_token_ids
            if out.finished:
                finals[out.request_id] = out
    for rid, request_samples in samples.items():
        assert len(request_samples) == 2
        for s in request_samples:
            assert appends[s.seq.seq_id] == s.seq.num_output_tokens, "a token entered the store another way"
    return {rid: (samples[rid], finals[rid]) for rid in samples}


def summary(runs: dict) -> dict:
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
            for rid, (_, out) in runs.items()}


@pytest.fixture
def appends(monkeypatch) -> Counter:
    """How many tokens each sequence took through `Sequence.append_token`."""
    counts, append = Counter(), Sequence.append_token

    def counting(seq, token_id):
        counts[seq.seq_id] += 1
        append(seq, token_id)
    monkeypatch.setattr(Sequence, "append_token", counting)
    return counts


def test_each_sample_reads_one_token_store_through_preemption_forks_and_stops(artifact, appends):
    free = summary(run_checking_the_store(make_engine(artifact), requests(stop=[]), appends))
    text = free["r0"][1][1]
    stop = next(text[k:k + 2] for k in range(len(text) // 3, len(text) - 1) if text[k:k + 2].isalpha())
    reqs = requests(stop=[stop, "never-produced"])

    roomy = run_checking_the_store(make_engine(artifact), reqs, appends)
    tight_engine = make_engine(artifact, num_blocks=8)  # each sample ends needing 3-4 blocks
    tight = run_checking_the_store(tight_engine, reqs, appends)

    assert tight_engine.metrics.preemptions > 0
    assert any(s.index == 1 and s.seq.num_preemptions for samples, _ in tight.values() for s in samples)
    assert summary(tight) == summary(roomy)
    reasons = [c.stop_reason for _, out in tight.values() for c in out.outputs]
    assert stop in reasons and None in reasons, "some samples stop on the string, others run to length"
    for rid, (_, out) in tight.items():
        for got, want in zip(out.outputs, roomy[rid][1].outputs):
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
