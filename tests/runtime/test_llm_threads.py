"""One `LLM` called from several threads at once: every generate, chat and stream call gets the
outputs it gets alone (the calls' requests share the engine's batches, and greedy and seeded
sampling do not depend on the batch), and a stream abandoned half-way frees its request."""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import llmc
from llmc.runtime.sampling_params import SamplingParams

THREADS, CALLS = 4, 20
WORDS = "the a cat dog ran sat on under tree house little big red blue".split()


@pytest.fixture(scope="module")
def llm(compiled):
    return llmc.load(compiled, kv_memory="16MiB", threads=1)


def _calls(seed: int) -> list[tuple]:
    """(kind, prompt or conversation, params) drawn at random: greedy and seeded sampling, n up to 2."""
    rng = random.Random(seed)
    calls = []
    for _ in range(THREADS * CALLS):
        text = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                **rng.choice([{"temperature": 0.0},
                                              {"temperature": 1.0, "seed": rng.randint(0, 10**6),
                                               "n": rng.randint(1, 2)}]))
        kind = rng.choice(["generate", "chat", "stream"])
        if kind == "stream":
            params.n = 1
        calls.append((kind, [{"role": "user", "content": text}] if kind == "chat" else text, params))
    return calls


def _run(llm, call) -> list:
    kind, prompt, params = call
    if kind == "stream":
        return ["".join(llm.stream(prompt, params))]
    outputs = (llm.chat if kind == "chat" else llm.generate)(prompt, params)[0].outputs
    return [(o.text, o.token_ids, o.finish_reason) for o in outputs]


def test_four_threads_of_twenty_calls_each_get_their_solo_outputs(llm):
    calls = _calls(seed=random.randrange(10**6))
    solo = [_run(llm, c) for c in calls]
    start = threading.Barrier(THREADS)

    def worker(t: int) -> list:
        start.wait()
        return [_run(llm, calls[i]) for i in range(t, len(calls), THREADS)]

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(worker, range(THREADS)))
    together = [None] * len(calls)
    for t, got in enumerate(results):
        together[t::THREADS] = got
    assert together == solo
    assert llm.engine.requests == {} and llm._outputs == {}
    assert llm.engine.block_manager.usage == 0


def test_calls_from_threads_share_engine_steps(llm):
    """Batched together, not taken in turns: some step runs requests of more than one call."""
    llm.engine.metrics.batch_seqs.clear()
    start = threading.Barrier(THREADS)

    def worker(t: int):
        start.wait()
        return llm.generate(f"thread {t} says", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(worker, range(THREADS)))
    assert max(llm.engine.metrics.batch_seqs) > 1


def test_an_abandoned_stream_frees_its_request_while_others_run(llm):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = llm.generate("a story", params)[0].outputs[0].text
    stream = llm.stream("abandoned", params)
    next(stream)
    other = threading.Thread(target=lambda: llm.generate("a story", params))
    other.start()
    stream.close()
    other.join()
    assert llm.generate("a story", params)[0].outputs[0].text == expected
    assert llm.engine.requests == {} and llm.engine.block_manager.usage == 0
