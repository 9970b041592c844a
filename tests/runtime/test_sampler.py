"""The batched sampler against float64 references, and stop detection with incremental
detokenisation against a real (small, built here) tokenizer."""

import math

import pytest
import torch

from llmc.runtime.sampler import Sampler, SamplingState, apply_penalties
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence
from llmc.runtime.stop import IncrementalDetokenizer, StopChecker

VOCAB = 8
DRAWS = 20_000


def random_logits(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2.0


def sequence(prompt, output=()) -> Sequence:
    """The token store the sampler and the stop checker read: `prompt`, then `output`."""
    seq = Sequence(list(prompt))
    for token in output:
        seq.append_token(token)
    return seq


def state(params, prompt, output=(), **kw) -> SamplingState:
    return SamplingState(params, sequence(prompt, output), **kw)


def states_for(params, rows, prompt=(1, 2, 3)):
    return [state(params, prompt) for _ in range(rows)]


# ---------------------------------------------------------------- float64 references

def reference_distribution(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Filtered distribution by hand: temperature, top-k, top-p, min-p, in float64."""
    z = [x / temperature for x in logits.double().tolist()]
    weights = [math.exp(v - max(z)) for v in z]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    total = sum(weights[i] for i in keep)
    mass, kept_p = 0.0, set()
    for i in order:
        if i not in keep or mass >= top_p:
            continue
        kept_p.add(i)
        mass += weights[i] / total
    best = max(weights[i] for i in kept_p)
    final = {i for i in kept_p if weights[i] >= min_p * best}
    norm = sum(weights[i] for i in final)
    return [weights[i] / norm if i in final else 0.0 for i in range(len(z))]


def reference_penalties(logits, prompt, output, repetition, frequency, presence):
    out = logits.double().tolist()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.8, top_k=1)])
def test_greedy_is_argmax(params):
    logits = random_logits(16, 50, seed=1)
    out = Sampler(eos_token_id=None).sample(logits, states_for(params, 16))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.top_logprobs is None


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    logits = random_logits(6, 30, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.9)] * 3
    states = [state(p, [1]) for p in params]
    out = Sampler(eos_token_id=None, seed=0).sample(logits, states)
    for row in (0, 2, 4):
        assert out.token_ids[row] == logits[row].argmax().item()


# ---------------------------------------------------------------- filtered distributions

def sampled_frequencies(logits_row, params, seed=1234):
    logits = logits_row.unsqueeze(0).expand(DRAWS, -1)
    out = Sampler(eos_token_id=None, seed=seed).sample(logits, states_for(params, DRAWS))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel())
    return (counts.double() / DRAWS).tolist()


def top_p_between_masses(logits_row, temperature, after):
    """A top-p halfway between two cumulative masses, so the kept set is unambiguous."""
    probs = sorted(reference_distribution(logits_row, temperature), reverse=True)
    return (sum(probs[:after]) + sum(probs[:after + 1])) / 2


@pytest.mark.parametrize("case", ["temperature", "top_k", "top_p", "min_p", "all"])
def test_empirical_frequencies_match_the_filtered_distribution(case):
    logits_row = random_logits(1, VOCAB, seed=3)[0]
    kwargs = {"temperature": {"temperature": 0.7},
              "top_k": {"top_k": 3},
              "top_p": {"top_p": top_p_between_masses(logits_row, 1.0, after=2)},
              "min_p": {"min_p": 0.15},
              "all": {"temperature": 1.3, "top_k": 6,
                      "top_p": top_p_between_masses(logits_row, 1.3, after=4), "min_p": 0.1},
              }[case]
    expected = reference_distribution(logits_row, **kwargs)
    observed = sampled_frequencies(logits_row, SamplingParams(**kwargs))
    assert max(abs(o - e) for o, e in zip(observed, expected)) < 0.02
    # filtered-out tokens are never drawn, and the filter removed something (except temperature)
    assert all(o == 0.0 for o, e in zip(observed, expected) if e == 0.0)
    assert (case == "temperature") or any(e == 0.0 for e in expected)


def test_each_row_uses_its_own_top_k_and_top_p():
    logits = random_logits(1, VOCAB, seed=4).expand(DRAWS, -1)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.999999)]
    states = [state(params[i % 2], [0]) for i in range(DRAWS)]
    tokens = torch.tensor(Sampler(None, seed=5).sample(logits, states).token_ids)
    top2 = set(logits[0].topk(2).indices.tolist())
    assert set(tokens[0::2].tolist()) <= top2
    assert len(set(tokens[1::2].tolist())) > 2


# ---------------------------------------------------------------- penalties

def test_penalties_match_float64_reference():
    logits = random_logits(3, 20, seed=6)
    prompts = [[1, 2, 2, 5], [7, 8], [0, 19]]
    outputs = [[5, 5, 9, 3, 5], [8, 8, 8, 11], []]
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3),
              SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)]
    states = [state(p, pr, out) for p, pr, out in zip(params, prompts, outputs)]
    got = apply_penalties(logits, states)
    for row, (p, pr, out) in enumerate(zip(params, prompts, outputs)):
        want = reference_penalties(logits[row], pr, out, p.repetition_penalty,
                                   p.frequency_penalty, p.presence_penalty)
        torch.testing.assert_close(got[row].double(), want, rtol=1e-6, atol=1e-6)
        assert not torch.equal(got[row], logits[row])


def test_rows_without_penalties_keep_their_logits():
    logits = random_logits(2, 12, seed=7)
    states = [state(SamplingParams(repetition_penalty=1.5), [1, 2], [3]),
              state(SamplingParams(), [1, 2], [3, 3])]
    got = apply_penalties(logits, states)
    assert torch.equal(got[1], logits[1])
    assert apply_penalties(logits, [states[1], states[1]]) is logits


def test_greedy_pick_follows_the_penalised_logits():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    row = state(SamplingParams(temperature=0.0, repetition_penalty=1.2), [0])
    assert Sampler(None).sample(logits, [row]).token_ids == [1]


# ---------------------------------------------------------------- min_tokens

def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0, 2.0]])  # eos=1 then stop id 2 are the best
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler(eos_token_id=1)
    assert sampler.sample(logits, [state(params, [0], [4])]).token_ids == [4]
    assert sampler.sample(logits, [state(params, [0], [4, 4])]).token_ids == [1]


def test_min_tokens_leaves_eos_alone_when_eos_is_ignored():
    logits = torch.tensor([[0.0, 9.0, 8.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler(eos_token_id=[1]).sample(logits, [state(params, [0])]).token_ids == [1]


# ---------------------------------------------------------------- seeds

def generate(sampler, states, steps, vocab=64):
    """Feeds the same random logits to every row each step; returns each row's tokens."""
    for step in range(steps):
        logits = random_logits(1, vocab, seed=100 + step).expand(len(states), -1)
        for row, token in zip(states, sampler.sample(logits, states).token_ids):
            row.seq.append_token(token)
    return [s.seq.output_token_ids for s in states]


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = generate(Sampler(None), [state(seeded, [1])], steps=12)[0]
    batch = [state(SamplingParams(temperature=1.2), [5]),
             state(seeded, [1]),
             state(SamplingParams(temperature=0.0), [2]),
             state(SamplingParams(temperature=0.9, seed=7), [3]),
             state(SamplingParams(top_k=5), [4])]
    assert generate(Sampler(None, seed=9), batch, steps=12)[1] == alone
    other_seed = generate(Sampler(None), [state(SamplingParams(seed=43), [1])], steps=12)
    assert other_seed[0] != alone


def test_parallel_samples_of_a_seeded_request_differ():
    params = SamplingParams(seed=42, n=2)
    first, second = generate(Sampler(None), [state(params, [1], sample_index=i)
                                             for i in range(2)], steps=12)
    assert first != second


# ---------------------------------------------------------------- logprobs

def test_no_logprobs_are_computed_when_no_row_asks():
    logits = random_logits(3, 40, seed=9)
    states = [state(SamplingParams(temperature=t), [1, 2], [3]) for t in (0.0, 0.7, 1.0)]
    out = Sampler(None, seed=3).sample(logits, states)
    assert out.logprobs is None and out.ranks is None and out.top_logprobs is None
    assert out.token_ids[0] == int(logits[0].argmax())


def test_logprobs_are_the_raw_model_logprobs():
    logits = random_logits(4, 40, seed=8)
    params = [SamplingParams(temperature=0.5, top_k=4, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(top_p=0.5),
              SamplingParams(min_p=0.3, logprobs=3)]
    states = [state(p, [1, 2], [3]) for p in params]
    out = Sampler(None, seed=3).sample(logits, states)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(reference[row, token].item(), abs=1e-5)
        assert out.ranks[row] == 1 + int((reference[row] > reference[row, token]).sum())
    assert [len(t) for t in out.top_logprobs] == [5, 0, 0, 3]
    for row in (0, 3):
        values = [lp for _, lp in out.top_logprobs[row]]
        assert values == sorted(values, reverse=True)
        want = reference[row].topk(len(values))
        assert [t for t, _ in out.top_logprobs[row]] == want.indices.tolist()
        assert values == pytest.approx(want.values.tolist(), abs=1e-5)


# ---------------------------------------------------------------- stop strings, detokenisation

@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE tokenizer trained here on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, the end.",
              "Stop here and there; then go on."] * 20
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def metaspace_words():
    """A SentencePiece-style word tokenizer: the first word decodes without its space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "</s>", "▁hello", "▁world", "▁the", "▁end", "▁of", "▁it", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def checker_for(tokenizer, params, prompt=None, **kw) -> StopChecker:
    """A stop checker on a fresh sequence; no prompt stands for no decoding context: the
    EOS token alone, which decodes to no text."""
    return StopChecker(tokenizer, params, sequence(prompt or [tokenizer.eos_token_id]), **kw)


def feed(checker, token) -> bool:
    """Appends a sampled token to the checker's sequence, as the engine does, and checks it."""
    checker.seq.append_token(token)
    return checker.check_new_token()


def run_checker(tokenizer, text, prompt="Hello", **params):
    checker = checker_for(tokenizer, SamplingParams(max_tokens=1000, **params), tokenizer.encode(prompt))
    ids = tokenizer.encode(text)
    streamed = ""
    for token in ids:
        if feed(checker, token):
            break
        streamed += checker.new_text()
    return checker, ids, streamed + checker.new_text()


@pytest.mark.parametrize("text", ["Hello world, the end. Stop here!",
                                  "naïve 日本語 ✓ fox\u00e9 🙂🙂 done"])
def test_incremental_text_equals_full_decode(byte_bpe, text):
    checker, ids, streamed = run_checker(byte_bpe, text)
    assert len(ids) > 8 and checker.output_text == byte_bpe.decode(ids) == text
    assert streamed == text and not checker.finished


def test_incremental_text_keeps_the_leading_space_after_the_prompt(metaspace_words):
    prompt = metaspace_words.encode("hello world")
    seq = sequence(prompt)
    detok = IncrementalDetokenizer(metaspace_words, seq)
    output = metaspace_words.encode("the end of it")
    assert metaspace_words.unk_token_id not in output
    text = ""
    for t in output:
        seq.append_token(t)
        text += detok.decode_new()
    full = metaspace_words.decode(prompt + output)
    assert text == " the end of it" == full[len(metaspace_words.decode(prompt)):]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_truncates(byte_bpe, include):
    text, stop = "Hello world, the end. Stop here and there", "d, th"
    checker, ids, streamed = run_checker(byte_bpe, text, stop=["zzz", stop],
                                         include_stop_str_in_output=include)
    pieces = [byte_bpe.decode([t]) for t in ids]
    start = text.index(stop)
    # the stop string really spans a token boundary
    assert any(start < end < start + len(stop) for end in _boundaries(pieces))
    expected = text[:start + len(stop)] if include else text[:start]
    assert (checker.finish_reason, checker.stop_reason) == ("stop", stop)
    assert checker.output_text == expected and streamed == expected
    assert byte_bpe.decode(checker.seq.output_token_ids).startswith(text[:start + len(stop)])


def test_earliest_stop_string_wins(byte_bpe):
    checker, _, _ = run_checker(byte_bpe, "Hello world, the end.", stop=["end", "the e"])
    assert (checker.output_text, checker.stop_reason) == ("Hello world, ", "the e")


def test_stop_strings_count_only_after_min_tokens(byte_bpe):
    text = "Hello world, Hello world, the end."
    ids = byte_bpe.encode(text)
    first_hello = byte_bpe.encode("Hello")
    checker, _, _ = run_checker(byte_bpe, text, stop=["Hello"], min_tokens=len(first_hello))
    assert checker.output_text == "Hello world, " and checker.finish_reason == "stop"
    assert len(checker.seq.output_token_ids) < len(ids)


def test_eos_and_stop_token_ids_finish_with_stop(byte_bpe):
    eos = byte_bpe.eos_token_id
    ids = byte_bpe.encode("Hello world")
    checker = checker_for(byte_bpe, SamplingParams())
    assert not any(feed(checker, t) for t in ids)
    assert feed(checker, eos)
    assert (checker.finish_reason, checker.stop_reason) == ("stop", None)
    assert checker.output_text == "Hello world" and checker.seq.output_token_ids[-1] == eos

    comma = byte_bpe.encode(",")[0]
    checker = checker_for(byte_bpe, SamplingParams(stop_token_ids=[comma]))
    ids = byte_bpe.encode("Hello world, the end")
    steps = next(i + 1 for i, t in enumerate(ids) if feed(checker, t))
    assert ids[steps - 1] == comma and checker.seq.output_token_ids == ids[:steps]
    assert (checker.finish_reason, checker.stop_reason, checker.output_text) == \
        ("stop", comma, "Hello world")


def test_ignore_eos_and_min_tokens_keep_going(byte_bpe):
    eos = byte_bpe.eos_token_id
    checker = checker_for(byte_bpe, SamplingParams(ignore_eos=True, max_tokens=3))
    assert [feed(checker, t) for t in (eos, eos, eos)] == [False, False, True]
    assert checker.finish_reason == "length" and checker.stop_reason is None
    checker = checker_for(byte_bpe, SamplingParams(min_tokens=2))
    assert [feed(checker, t) for t in (eos, eos, eos)] == [False, False, True]
    assert checker.finish_reason == "stop"


def test_length_limits(byte_bpe):
    ids = byte_bpe.encode("Hello world, the end. Stop here")
    checker = checker_for(byte_bpe, SamplingParams(max_tokens=4))
    assert [feed(checker, t) for t in ids[:4]] == [False, False, False, True]
    assert checker.finish_reason == "length" and checker.output_text == byte_bpe.decode(ids[:4])
    checker = checker_for(byte_bpe, SamplingParams(max_tokens=None), ids[:3], max_model_len=5)
    assert [feed(checker, t) for t in ids[3:5]] == [False, True]
    assert checker.finish_reason == "length"


def _boundaries(pieces):
    ends, pos = set(), 0
    for piece in pieces:
        pos += len(piece)
        ends.add(pos)
    return ends
