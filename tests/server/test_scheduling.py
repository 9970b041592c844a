"""Admission in front of the engine, on a server whose engine takes one request at a time: users
share it fairly, a full queue answers 429 with Retry-After, and SIGTERM drains (a running
request is aborted with a clear reason once the grace period is over)."""

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import start_serve, stop_serve


def complete(served, user: str, max_tokens: int = 8, **extra):
    return served.client.completions.create(model="tiny", prompt=f"a story for {user}", max_tokens=max_tokens,
                                            temperature=0, user=user, extra_body={"ignore_eos": True, **extra})


def hold_engine(served, max_tokens: int):
    """A stream that keeps the engine's one slot busy; returns it once its first token came."""
    stream = served.client.completions.create(model="tiny", prompt="hold", max_tokens=max_tokens, stream=True,
                                              extra_body={"ignore_eos": True})
    next(iter(stream))
    return stream


@pytest.fixture(scope="module")
def one_slot(compiled):
    served = start_serve(compiled, "--max-num-seqs", 1, "--max-queue", 8, "--shutdown-timeout", 0)
    yield served
    stop_serve(served)


def test_one_users_many_requests_do_not_starve_anothers_single_one(one_slot):
    finished, lock = [], threading.Lock()

    def send(user):
        # long enough that the order responses reach their client threads is the order they finished
        # in the engine, even on a loaded machine
        complete(one_slot, user, 48)
        with lock:
            finished.append(user)

    with ThreadPoolExecutor(8) as pool:
        stream = hold_engine(one_slot, 300)
        heavy = [pool.submit(send, "heavy") for _ in range(6)]
        one_slot.wait_metric("llmc:num_requests_waiting", 6)
        light = pool.submit(send, "light")
        one_slot.wait_metric("llmc:num_requests_waiting", 7)
        list(stream)
        for f in [*heavy, light]:
            f.result()
    # the light user's request is tagged with its own tokens only: it goes after at most one heavy request
    assert finished.index("light") <= 1, finished


def test_a_full_queue_is_a_429_with_retry_after(one_slot):
    with ThreadPoolExecutor(8) as pool:
        stream = hold_engine(one_slot, 300)
        queued = [pool.submit(complete, one_slot, f"user{i}", 2) for i in range(8)]
        one_slot.wait_metric("llmc:num_requests_waiting", 8)
        with pytest.raises(openai.RateLimitError) as caught:
            complete(one_slot, "late")
        list(stream)
        assert all(f.result().usage.completion_tokens == 2 for f in queued)
    assert caught.value.status_code == 429
    assert int(caught.value.response.headers["Retry-After"]) >= 1
    assert "--max-queue 8" in caught.value.body["message"]


def test_sigterm_past_the_grace_period_aborts_running_requests_and_refuses_queued_ones(one_slot):
    with ThreadPoolExecutor(1) as pool:
        stream = hold_engine(one_slot, 400)
        queued = pool.submit(complete, one_slot, "queued")
        one_slot.wait_metric("llmc:num_requests_waiting", 1)
        one_slot.proc.send_signal(signal.SIGTERM)
        last = [c for c in stream][-1].choices[0]
        with pytest.raises(openai.APIStatusError) as caught:
            queued.result()
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("abort", "server shutdown")
    assert caught.value.status_code == 503
    assert one_slot.proc.wait(timeout=60) == 0
