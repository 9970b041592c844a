"""Bad values through the Python API: each raises `llmc.LlmcError` naming the field and the
request, and a call that fails leaves the engine as it found it (nothing queued, every KV
block it took given back), so a later call returns only its own outputs."""

import math
import random

import pytest

import llmc
from llmc import LlmcError, SamplingParams


@pytest.fixture(scope="module")
def llm(artifact):
    return llmc.load(artifact, kv_memory="4MiB")


@pytest.fixture
def rng(request):
    return random.Random(request.node.name)


def good_ids(rng, n=None) -> list[int]:
    """Random ids inside tiny-llama's vocabulary (it has more than 100 tokens)."""
    return [rng.randrange(100) for _ in range(n or rng.randrange(2, 9))]


def engine_state(llm) -> tuple[bool, int]:
    return llm.engine.has_unfinished(), llm.engine.block_manager.num_free_blocks


def assert_refused_and_clean(llm, call, *fragments):
    """`call()` raises an LlmcError whose message holds every fragment, and the engine is
    left as it was: no request queued, no KV block held."""
    before = engine_state(llm)
    assert before[0] is False
    with pytest.raises(LlmcError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert engine_state(llm) == before


@pytest.mark.parametrize("kind", ["str", "float", "bool", "None", "negative", "past-vocab"])
def test_a_bad_token_id_is_named_by_request_and_position(llm, rng, kind):
    vocab = llm.engine.model["vocab_size"]
    bad, fragment = {"str": ("abc", "is a str ('abc')"), "float": (5.7, "is a float (5.7)"),
                     "bool": (True, "is a bool (True)"), "None": (None, "is a NoneType (None)"),
                     "negative": (-1 - rng.randrange(100), "outside the vocabulary"),
                     "past-vocab": (vocab + rng.randrange(100), "outside the vocabulary")}[kind]
    ids = good_ids(rng)
    where = rng.randrange(len(ids))
    ids[where] = bad
    prompts = ["hello there", {"prompt_token_ids": good_ids(rng)}, {"prompt_token_ids": ids}]
    assert_refused_and_clean(llm, lambda: llm.generate(prompts, SamplingParams(max_tokens=2)),
                             f"prompts[2].prompt_token_ids[{where}]", fragment)


@pytest.mark.parametrize("prompt, fragments", [
    (123, ["prompts[1] is an int (123)", "a prompt is a str"]),
    (b"bytes", ["prompts[1] is a bytes"]),
    ("ok \ud800 text", ["prompts[1] is not valid Unicode text", "lone surrogate", "character 3"]),
    ({"text": "hi"}, ["prompts[1]: a dict prompt needs the key 'prompt_token_ids'"]),
    ({"prompt_token_ids": "1 2 3"}, ["prompts[1].prompt_token_ids is a str"]),
    ({"prompt_token_ids": []}, ["prompts[1]: the prompt has no tokens"]),
])
def test_a_bad_prompt_after_a_good_one_adds_neither(llm, rng, prompt, fragments):
    first = {"prompt_token_ids": good_ids(rng)}
    assert_refused_and_clean(llm, lambda: llm.generate([first, prompt], SamplingParams(max_tokens=2)),
                             *fragments)
    # the first prompt did not stay queued for someone else's call to return
    ids = good_ids(rng)
    outs = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, temperature=0))
    assert [o.prompt_token_ids for o in outs] == [ids]


def test_a_prompt_longer_than_the_context_is_refused_before_anything_runs(llm, rng):
    too_long = good_ids(rng, llm.engine.max_model_len + 1 + rng.randrange(10))
    assert_refused_and_clean(llm, lambda: llm.generate(["a", {"prompt_token_ids": too_long}]),
                             "prompts[1]", f"prompt of {len(too_long)} tokens", "shorten")


@pytest.mark.parametrize("fields, fragment", [
    ({"seed": 2**70}, "SamplingParams.seed must lie in [0, 2**64 - 1]"),
    ({"seed": -1}, "SamplingParams.seed must lie in [0, 2**64 - 1]"),
    ({"seed": 2**64 - 1, "n": 2}, "SamplingParams.seed + n - 1 must be at most 2**64 - 1"),
    ({"seed": True}, "SamplingParams.seed must be an integer"),
    ({"temperature": math.inf}, "SamplingParams.temperature must be in [0, inf), got inf"),
    ({"top_p": math.nan}, "SamplingParams.top_p must be in (0, 1], got nan"),
    ({"repetition_penalty": math.inf}, "SamplingParams.repetition_penalty must be in (0, inf)"),
    ({"max_tokens": True}, "SamplingParams.max_tokens must be an integer"),
    ({"n": 0}, "SamplingParams.n must be an integer >= 1"),
])
def test_bad_sampling_params_are_refused_when_made(fields, fragment):
    with pytest.raises(LlmcError) as info:
        SamplingParams(**fields)
    assert fragment in str(info.value)


def test_sampling_params_changed_after_they_were_made_are_checked_again(llm, rng):
    params = SamplingParams(max_tokens=2, seed=rng.randrange(2**32))
    params.seed = 2**64 + rng.randrange(2**10)
    assert_refused_and_clean(llm, lambda: llm.generate(["a", "b"], params),
                             "prompts[0]", "SamplingParams.seed must lie in [0, 2**64 - 1]")


@pytest.mark.parametrize("params, fragment", [
    ({"temperature": 0}, "prompts[0]: sampling params are a dict"),
    ([SamplingParams()], "got 2 prompts but 1 sampling_params"),
])
def test_sampling_params_that_are_not_sampling_params_are_refused(llm, params, fragment):
    assert_refused_and_clean(llm, lambda: llm.generate(["a", "b"], params), fragment)


def test_a_bad_priority_is_refused(llm):
    assert_refused_and_clean(llm, lambda: llm.generate(["a", "b"], priority=[0, "high"]),
                             "prompts[1]: priority is a str ('high')")


@pytest.mark.parametrize("messages, fragment", [
    ("hello", "messages is a str ('hello')"),
    ([], "messages is a list ([])"),
    ([{"role": "user"}], "messages[0] is a dict ({'role': 'user'})"),
    ([{"role": "user", "content": 5}], "messages[0] is a dict"),
    ([[{"role": "user", "content": "hi"}], ["hi"]], "messages[1][0] is a str ('hi')"),
    ([[{"role": "user", "content": "hi"}], []], "messages[1] is a list ([])"),
])
def test_messages_that_are_not_role_content_dicts_are_refused(llm, messages, fragment):
    assert_refused_and_clean(llm, lambda: llm.chat(messages, SamplingParams(max_tokens=2)), fragment)


def test_a_bad_stream_prompt_adds_nothing(llm):
    assert_refused_and_clean(llm, lambda: list(llm.stream(123)), "prompt is an int (123)")
    assert_refused_and_clean(llm, lambda: list(llm.stream("x\udcff")), "prompt is not valid Unicode text")


def test_a_failure_while_generating_aborts_what_the_call_added(llm, rng, monkeypatch):
    engine = llm.engine
    real_step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 2:
            raise LlmcError("simulated failure in the second step")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    prompts = [{"prompt_token_ids": good_ids(rng)} for _ in range(3)]
    assert_refused_and_clean(llm, lambda: llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True)),
                             "simulated failure")
    assert len(steps) == 2


def test_a_stream_closed_early_gives_its_request_back(llm, rng):
    before = engine_state(llm)
    pieces = llm.stream({"prompt_token_ids": good_ids(rng)}, SamplingParams(max_tokens=16, ignore_eos=True))
    next(pieces)
    assert llm.engine.has_unfinished()
    pieces.close()
    assert engine_state(llm) == before


@pytest.mark.parametrize("options, fragment", [
    ({"max_num_seqs": 0}, "max_num_seqs=0 must be an integer >= 1"),
    ({"block_size": 2.5}, "block_size=2.5 must be an integer >= 1"),
    ({"seed": 2**70}, "seed=1180591620717411303424 must be an integer in [0, 2**64 - 1]"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching='no' must be True or False"),
    ({"kv_memroy": "1GiB"}, "unknown engine option(s) kv_memroy"),
    ({"kv_memory": "100TiB"}, "the KV cache needs 102400.00 GiB"),
    ({"kv_memory": "banana"}, "cannot read 'banana' as a size"),
])
def test_bad_engine_options_are_refused_at_load(artifact, options, fragment):
    with pytest.raises(LlmcError) as info:
        llmc.load(artifact, **options)
    assert fragment in str(info.value)
