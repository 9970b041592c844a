"""The semantic cache of `llmc serve --semantic-cache-threshold COSINE`: only a request that opts in
(`extra_body={"semantic_cache": true}`) is looked up, matched on the served model's own embedding of
its text against earlier requests equal in every other field, and answered whole or streamed with
`X-Cache: semantic-hit` and the similarity; a server without the option ignores the field."""

import numpy as np
import pytest
from conftest import KV_MEMORY, InProcessServer, start_serve, stop_serve

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.server.result_cache import CachedResult
from llmc.runtime.server.semantic_cache import PromptEmbedder, SemanticCache, make_semantic_cache

ASK = [{"role": "user", "content": "What is the capital of France?"}]
OPT_IN = {"semantic_cache": True}


@pytest.fixture(scope="module")
def served(compiled):
    served = start_serve(compiled, "--semantic-cache-threshold", "0.999")
    yield served
    stop_serve(served)


def chat(served, messages=ASK, **fields):
    ask = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0} | fields
    return served.client.chat.completions.with_raw_response.create(**ask)


def test_an_opted_in_request_is_answered_from_the_semantic_cache_with_its_similarity(served):
    first = chat(served, extra_body=OPT_IN)
    again = chat(served, extra_body=OPT_IN)
    assert first.headers["x-cache"] == "miss"
    assert again.headers["x-cache"] == "semantic-hit" and float(again.headers["x-cache-similarity"]) >= 0.999
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
    assert served.metric("llmc:semantic_cache_hits_total") >= 1


def test_a_request_that_does_not_opt_in_is_not_looked_up(served):
    chat(served, [{"role": "user", "content": "Not opted in"}], extra_body=OPT_IN)
    hits, misses = (served.metric(f"llmc:semantic_cache_{k}_total") for k in ("hits", "misses"))
    assert "x-cache" not in chat(served, [{"role": "user", "content": "Not opted in"}]).headers
    assert (served.metric("llmc:semantic_cache_hits_total"), served.metric("llmc:semantic_cache_misses_total")) == (
        hits, misses)


def test_only_requests_equal_in_every_other_field_match(served):
    messages = [{"role": "user", "content": "Name three colours."}]
    chat(served, messages, extra_body=OPT_IN)
    assert chat(served, messages, extra_body=OPT_IN, max_tokens=7).headers["x-cache"] == "miss"
    assert chat(served, messages, extra_body=OPT_IN, temperature=0.5, seed=1).headers["x-cache"] == "miss"
    assert chat(served, [{"role": "user", "content": "Write a haiku about the sea."}],
                extra_body=OPT_IN).headers["x-cache"] == "miss"


def test_a_semantic_hit_streams_like_the_original(served):
    messages = [{"role": "user", "content": "Count to five."}]
    ask = dict(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
               stream_options={"include_usage": True}, extra_body=OPT_IN)
    first = list(served.client.chat.completions.create(**ask))
    again = served.client.chat.completions.with_raw_response.create(**ask)
    assert again.headers["x-cache"] == "semantic-hit"
    chunks = list(again.parse())
    text = ["".join(c.choices[0].delta.content or "" for c in run if c.choices) for run in (first, chunks)]
    assert text[0] == text[1] and chunks[-1].usage == first[-1].usage


def test_the_similarity_is_the_cosine_of_the_models_own_embeddings(compiled):
    llm = llmc.load(compiled, kv_memory=KV_MEMORY, threads=1)
    embed = PromptEmbedder(llm.engine.runner.executor, llm.engine.tokenizer)
    a, b = "What is the capital of France?", "Which city is the capital of France?"
    expected = float(embed(a) @ embed(b))
    assert abs(np.linalg.norm(embed(a)) - 1) < 1e-5
    with InProcessServer(llm, semantic_cache_threshold=max(expected - 1e-3, 1e-3)) as served:
        chat(served, [{"role": "user", "content": a}], extra_body=OPT_IN)
        near = chat(served, [{"role": "user", "content": b}], extra_body=OPT_IN)
        assert near.headers["x-cache"] == "semantic-hit"
        assert float(near.headers["x-cache-similarity"]) == pytest.approx(expected, abs=1e-4)


def test_a_server_without_the_option_ignores_the_field(compiled):
    with InProcessServer(llmc.load(compiled, kv_memory=KV_MEMORY, threads=1)) as served:
        for _ in range(2):
            assert "x-cache" not in chat(served, extra_body=OPT_IN).headers


def result(name: str) -> CachedResult:
    return CachedResult(RequestOutput(name, name, []), [])


def unit(*values) -> np.ndarray:
    v = np.array(values, dtype=np.float32)
    return v / np.linalg.norm(v)


def test_the_cache_matches_the_nearest_of_the_same_context_above_the_threshold():
    cache = SemanticCache(3, 0.9)
    cache.put(b"a", unit(1, 0, 0), result("x"))
    cache.put(b"b", unit(1, 0.1, 0), result("other context"))
    cache.put(b"a", unit(0, 1, 0), result("y"))
    found, similarity = cache.get(b"a", unit(1, 0.2, 0))
    assert found.output.request_id == "x" and similarity == pytest.approx(float(unit(1, 0.2, 0) @ unit(1, 0, 0)))
    assert cache.get(b"a", unit(1, 1, 0)) is None   # cosine 0.71 to each
    assert cache.get(b"c", unit(1, 0, 0)) is None


def test_the_oldest_entry_goes_first_at_the_bound():
    cache = SemanticCache(2, 0.99, max_entries=2)
    for i, v in enumerate([unit(1, 0), unit(0, 1), unit(1, 1)]):
        cache.put(b"", v, result(str(i)))
    assert len(cache) == 2 and cache.index.ntotal == 2
    assert cache.get(b"", unit(1, 0)) is None
    assert cache.get(b"", unit(0, 1))[0].output.request_id == "1"


@pytest.mark.parametrize("threshold,entries,message", [
    (1.5, 10, r"must be a cosine similarity in \(0, 1\]"),
    (0.9, 0, "must be an integer >= 1"),
])
def test_bad_semantic_options_are_refused(threshold, entries, message):
    with pytest.raises(RuntimeLlmcError, match=message):
        make_semantic_cache(None, None, threshold, entries)


def test_the_embedding_is_the_hidden_state_the_lm_head_reads(compiled):
    """final_hidden_state times the LM head's weight gives the plan's own last-token logits."""
    import torch

    executor = llmc.load(compiled, kv_memory=KV_MEMORY, threads=1).engine.runner.executor
    ids = torch.randint(0, 500, (9,))
    inputs = {"input_ids": ids, "positions": torch.arange(9), "logits_indices": torch.tensor([8])}
    logits = executor.run_values({k: v for k, v in inputs.items() if k in executor.plan.inputs})["logits"][-1]
    head = next(s for s in executor.plan.steps if "logits" in s.outputs)
    state = executor.final_hidden_state(ids)
    torch.testing.assert_close(state @ executor.weight(head.inputs[1]).float().T, logits.float(), rtol=0, atol=1e-5)


def test_embedding_beside_running_steps_leaves_every_output_as_offline(compiled, offline):
    """The embedding pass runs on the prepare thread while the engine steps other requests."""
    from concurrent.futures import ThreadPoolExecutor

    from llmc.runtime.sampling_params import SamplingParams

    prompts = [f"Story number {i} begins with" for i in range(12)]
    want = [offline.generate(p, SamplingParams(max_tokens=30, temperature=0))[0].outputs[0].text for p in prompts]
    with InProcessServer(llmc.load(compiled, kv_memory=KV_MEMORY, threads=1), semantic_cache_threshold=1.0) as served:
        def ask(prompt):
            return served.client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                                    extra_body=OPT_IN).choices[0].text
        with ThreadPoolExecutor(12) as pool:
            assert list(pool.map(ask, prompts)) == want
