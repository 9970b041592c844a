"""The engine on the compiled tiny-llama sample, checked against HF transformers and
against itself: in-flight batching changes no greedy token, prefix caching skips the
shared prefix's compute, preemption and aborts leak no KV block, n > 1 samples share
the prompt's blocks copy-on-write, and the Python API streams, stops, scores and chats."""

import pytest
import torch

import llmc
from llmc.compiler.frontends import load_model
from llmc.errors import RuntimeLlmcError
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams

VOCAB = 512
BLOCK = 16


@pytest.fixture(scope="module")
def reference():
    """The HF model and tokenizer the artifact was compiled from."""
    return load_model("tiny-llama")


def make_engine(artifact, kv_memory="4MiB", **options) -> Engine:
    return Engine(artifact, EngineConfig(kv_memory=kv_memory, block_size=BLOCK, **options))


def random_prompt(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()  # past the special ids


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_to_end(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Add every request, step until all finish; checks the block manager after each step."""
    for rid, ids, params in requests:
        engine.add_request(rid, prompt_token_ids=ids, params=params)
    return drain(engine)


def drain(engine: Engine) -> dict:
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} reported after it finished"
            if out.finished:
                done[out.request_id] = out
        engine.block_manager.check_invariants()
    assert not engine.has_unfinished(), "the engine did not finish its requests"
    return done


def tokens(outputs: dict) -> dict[str, list[list[int]]]:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in outputs.items()}


def assert_no_blocks_held(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.seqs
    bm.check_invariants()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full HF forwards, one token at a time."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under HF, in float64."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].double()
    rows = logits.log_softmax(-1)[len(prompt) - 1:-1]
    return [float(rows[i, t]) for i, t in enumerate(output)]


# --- in-flight batching -----------------------------------------------------------------

def test_batched_greedy_equals_each_request_alone_and_hf(artifact, reference):
    gen = torch.Generator().manual_seed(11)
    lengths = [2, 100] + torch.randint(2, 101, (14,), generator=gen).tolist()
    requests = [(f"r{i}", random_prompt(gen, n), greedy(int(torch.randint(3, 13, (1,), generator=gen))))
                for i, n in enumerate(lengths)]
    # a small token budget chunks the long prefills and mixes them with decodes
    batched = make_engine(artifact, max_num_batched_tokens=64, max_num_seqs=16)
    together = tokens(run_to_end(batched, requests))
    assert max(batched.metrics.batch_tokens) == 64 and batched.metrics.steps > 12
    assert_no_blocks_held(batched)

    alone_engine = make_engine(artifact, enable_prefix_caching=False)
    for rid, ids, params in requests:
        alone = tokens(run_to_end(alone_engine, [(rid, ids, params)]))[rid]
        assert together[rid] == alone, rid
        assert len(alone[0]) == params.max_tokens
    for rid, ids, params in [requests[0], requests[1], requests[5]]:
        assert together[rid][0] == hf_greedy(reference.module, ids, params.max_tokens), rid


# --- prefix caching ---------------------------------------------------------------------

def test_prefix_cache_serves_the_shared_prefix_and_computes_only_the_suffix(artifact):
    gen = torch.Generator().manual_seed(12)
    prefix = random_prompt(gen, 256)
    first, second = prefix + random_prompt(gen, 10), prefix + random_prompt(gen, 7)
    params = greedy(5)
    engine = make_engine(artifact)
    out1 = run_to_end(engine, [("first", first, params)])["first"]
    assert out1.metrics.num_cached_tokens == 0
    hits, computed = engine.scheduler.num_prefix_hit_tokens, engine.metrics.computed_tokens

    out2 = run_to_end(engine, [("second", second, params)])["second"]
    assert out2.metrics.num_cached_tokens == 256
    assert engine.scheduler.num_prefix_hit_tokens - hits == 256
    # the 7-token suffix, then one decode per token after the first
    assert engine.metrics.computed_tokens - computed == 7 + params.max_tokens - 1

    uncached = make_engine(artifact, enable_prefix_caching=False)
    plain = run_to_end(uncached, [("second", second, params)])["second"]
    assert uncached.metrics.computed_tokens == len(second) + params.max_tokens - 1
    assert plain.metrics.num_cached_tokens == 0
    assert out2.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_no_blocks_held(engine)


# --- preemption, rejection, aborts ------------------------------------------------------

def tight_kv_memory(artifact, num_blocks: int) -> int:
    bytes_per_token = make_engine(artifact).model["kv_bytes_per_token"]
    return num_blocks * BLOCK * bytes_per_token


def test_tight_kv_budget_preempts_and_resumes_with_identical_outputs(artifact):
    gen = torch.Generator().manual_seed(13)
    requests = [(f"r{i}", random_prompt(gen, int(n)), greedy(24))
                for i, n in enumerate(torch.randint(20, 41, (6,), generator=gen))]
    tight = make_engine(artifact, kv_memory=tight_kv_memory(artifact, 8))
    assert tight.block_manager.num_blocks == 8  # each request ends needing 3-4 blocks
    squeezed = run_to_end(tight, requests)
    assert tight.metrics.preemptions > 0
    roomy = run_to_end(make_engine(artifact), requests)
    assert tokens(squeezed) == tokens(roomy)
    assert all(o.outputs[0].finish_reason == "length" for o in squeezed.values())
    assert_no_blocks_held(tight)


def test_request_larger_than_the_cache_aborts_with_a_reason_while_others_finish(artifact):
    gen = torch.Generator().manual_seed(14)
    fine = [(f"ok{i}", random_prompt(gen, 20 + 7 * i), greedy(10)) for i in range(3)]
    too_long_prompt = ("huge-prompt", random_prompt(gen, 8 * BLOCK + 5), greedy(4))
    grows_too_long = ("grows", random_prompt(gen, 100), greedy(60))  # 160 tokens > 8 blocks
    engine = make_engine(artifact, kv_memory=tight_kv_memory(artifact, 8))
    done = run_to_end(engine, fine + [too_long_prompt, grows_too_long])

    huge = done["huge-prompt"].outputs[0]
    assert huge.finish_reason == "abort" and huge.token_ids == []
    assert "needs 9 KV blocks" in huge.stop_reason and "kv-memory" in huge.stop_reason
    grown = done["grows"].outputs[0]
    assert grown.finish_reason == "abort" and "grew to" in grown.stop_reason
    assert 0 < len(grown.token_ids) < 60
    roomy = run_to_end(make_engine(artifact), fine)
    for rid, _, _ in fine:
        assert done[rid].outputs[0].finish_reason == "length"
        assert done[rid].outputs[0].token_ids == roomy[rid].outputs[0].token_ids
    assert_no_blocks_held(engine)


def test_aborts_mid_generation_free_every_block(artifact):
    gen = torch.Generator().manual_seed(15)
    engine = make_engine(artifact, kv_memory=tight_kv_memory(artifact, 12), max_num_seqs=3)
    sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    engine.add_request("forked", prompt_token_ids=random_prompt(gen, 37), params=sampled)
    for i in range(5):
        engine.add_request(f"r{i}", prompt_token_ids=random_prompt(gen, 25), params=greedy(30))
    for _ in range(4):
        engine.step()
    assert len(engine.requests["forked"].samples) == 3
    waiting = [s.request_id for s in engine.scheduler.waiting]
    assert waiting, "the test wants a waiting request to abort"
    for rid in ("forked", "r0", waiting[-1]):
        engine.abort(rid)
    engine.abort("no-such-request")  # a no-op
    done = drain(engine)
    assert not {"forked", "r0", waiting[-1]} & set(done)
    assert all(o.outputs[0].finish_reason == "length" for o in done.values())
    assert_no_blocks_held(engine)


def test_prompt_longer_than_the_context_is_refused(artifact):
    engine = make_engine(artifact)
    with pytest.raises(RuntimeLlmcError, match="longer than the model's context of 512"):
        engine.add_request(prompt_token_ids=[5] * 513)
    with pytest.raises(RuntimeLlmcError, match=r"outside the vocabulary \[0, 512\)"):
        engine.add_request(prompt_token_ids=[5, 512])
    assert not engine.has_unfinished()


# --- n > 1 ------------------------------------------------------------------------------

def record_copies(engine: Engine) -> list[tuple[int, int]]:
    """Spy on the KV cache's copy-on-write copies."""
    copies, copy = [], engine.cache.copy_blocks

    def spy(pairs):
        copies.extend(pairs)
        copy(pairs)
    engine.cache.copy_blocks = spy
    return copies


def test_n_samples_share_prompt_blocks_copy_on_write(artifact, reference):
    gen = torch.Generator().manual_seed(16)
    prompt = random_prompt(gen, 37)  # two full blocks and a shared partial one
    engine = make_engine(artifact)
    copies = record_copies(engine)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=0)
    engine.add_request("s", prompt_token_ids=prompt, params=params)
    engine.step()  # the prefill samples the first tokens and forks
    seqs = [s.seq for s in engine.requests["s"].samples]
    assert len(seqs) == 3 and all(s.block_table == seqs[0].block_table for s in seqs)
    shared = list(seqs[0].block_table)
    assert [engine.block_manager.blocks[b].ref_count for b in shared] == [3, 3, 3]
    assert copies == []

    out = drain(engine)["s"]
    # each sample but the last to write got a private copy of the partial block
    assert len(copies) == 2 and all(src == shared[2] for src, _ in copies)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in out.outputs]
    assert all(len(t) == 12 for t in samples)
    assert len({tuple(t) for t in samples}) == 3, "temperature 1 samples should differ"
    for sample in out.outputs:  # each saw its own tokens' KV: its logprobs are HF's
        expected = hf_logprobs(reference.module, prompt, sample.token_ids)
        got = [sample.logprobs[i][t].logprob for i, t in enumerate(sample.token_ids)]
        assert got == pytest.approx(expected, abs=1e-4)
    assert_no_blocks_held(engine)


def test_seeded_samples_repeat_whatever_else_is_in_the_batch(artifact):
    gen = torch.Generator().manual_seed(17)
    prompt = random_prompt(gen, 29)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=123, max_tokens=10, ignore_eos=True)
    alone = tokens(run_to_end(make_engine(artifact), [("s", prompt, params)]))["s"]

    others = [(f"o{i}", random_prompt(gen, int(n)), SamplingParams(temperature=1.0, max_tokens=int(m)))
              for i, (n, m) in enumerate(torch.randint(2, 60, (5, 2), generator=gen))]
    crowded_engine = make_engine(artifact, max_num_batched_tokens=48, max_num_seqs=8, seed=99)
    crowded = tokens(run_to_end(crowded_engine, others[:3] + [("s", prompt, params)] + others[3:]))
    assert crowded["s"] == alone

    reseeded = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=124, max_tokens=10, ignore_eos=True)
    assert tokens(run_to_end(make_engine(artifact), [("s", prompt, reseeded)]))["s"] != alone


def test_greedy_n_samples_are_identical(artifact):
    prompt = random_prompt(torch.Generator().manual_seed(18), 21)
    engine = make_engine(artifact)
    out = run_to_end(engine, [("g", prompt, greedy(8, n=3)), ("one", prompt, greedy(8))])
    assert tokens(out)["g"] == tokens(out)["one"] * 3


def test_n_samples_with_one_token_each(artifact):
    prompt = random_prompt(torch.Generator().manual_seed(19), 21)
    engine = make_engine(artifact)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=1, ignore_eos=True)
    out = run_to_end(engine, [("s", prompt, params)])["s"]
    assert [len(c.token_ids) for c in out.outputs] == [1] * 4
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert_no_blocks_held(engine)


# --- the Python API ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(artifact):
    return llmc.load(artifact, kv_memory="4MiB", max_num_seqs=8, block_size=BLOCK)


PROMPT = "The river starts as a thin"


def test_stream_pieces_join_to_the_generated_text(llm):
    params = greedy(24)
    text = llm.generate(PROMPT, params)[0].outputs[0].text
    pieces = list(llm.stream(PROMPT, params))
    assert len(pieces) > 3 and "".join(pieces) == text
    assert not llm.engine.has_unfinished()


def test_stop_string_cuts_the_text_in_generate_and_stream(llm):
    full = llm.generate(PROMPT, greedy(24))[0].outputs[0]
    start = next(k for k in range(len(full.text) // 3, len(full.text) - 1)
                 if full.text[k:k + 2].isalpha())
    stop = full.text[start:start + 2]
    out = llm.generate(PROMPT, greedy(24, stop=[stop]))[0].outputs[0]
    assert out.text == full.text[:full.text.find(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(full.token_ids)
    assert "".join(llm.stream(PROMPT, greedy(24, stop=[stop]))) == out.text


def test_logprobs_match_hf_log_softmax(llm, reference):
    out = llm.generate(PROMPT, greedy(6, logprobs=3))[0]
    sample = out.outputs[0]
    ids = out.prompt_token_ids + sample.token_ids
    with torch.inference_mode():
        logits = reference.module(torch.tensor([ids])).logits[0].double()
    expected = logits.log_softmax(-1)[len(out.prompt_token_ids) - 1:-1]  # [outputs, vocab]
    assert len(sample.logprobs) == 6
    for step, (token, row) in enumerate(zip(sample.token_ids, expected)):
        entry = sample.logprobs[step]
        top = row.topk(3).indices.tolist()
        assert set(entry) == {token, *top} and entry[token].rank == 1
        assert [entry[t].rank for t in top] == [1, 2, 3]
        for tok, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[tok]), abs=1e-4)
    assert sample.cumulative_logprob == pytest.approx(
        sum(float(expected[i, t]) for i, t in enumerate(sample.token_ids)), abs=1e-3)


def test_chat_applies_the_chat_template(llm, reference):
    conversation = [{"role": "user", "content": "Hello! How are you?"}]
    expected = reference.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                       add_generation_prompt=True)
    assert expected.endswith("<|im_start|>assistant\n")
    out = llm.chat(conversation, greedy(8))[0]
    assert out.prompt == expected
    assert out.prompt_token_ids == reference.tokenizer(expected)["input_ids"]
    assert out.outputs[0].token_ids == llm.generate(expected, greedy(8))[0].outputs[0].token_ids
    both = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Fine."}]], greedy(4))
    assert [o.prompt.count("<|im_start|>") for o in both] == [2, 3]


def test_stream_raises_when_the_request_cannot_fit(artifact):
    small = llmc.load(artifact, kv_memory=tight_kv_memory(artifact, 2), block_size=BLOCK)
    with pytest.raises(RuntimeLlmcError, match="KV blocks"):
        list(small.stream({"prompt_token_ids": list(range(3, 3 + 40))}, greedy(4)))
    assert not small.engine.has_unfinished()
