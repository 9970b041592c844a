"""The admission queue's order (priority, then weighted fair queueing on tokens between users) and
the TTFT predictor behind --ttft-slo-ms, on their own; and that `llmc.load` does not import the
server."""

import random
import subprocess
import sys
from dataclasses import dataclass

import pytest

from llmc.runtime.server.admission import FairQueue
from llmc.runtime.server.slo import TtftPredictor


@dataclass(eq=False)
class Job:
    user: str
    cost: int
    priority: int = 0
    prompt_tokens: int = 1


def test_a_single_request_is_not_starved_by_another_users_hundred():
    queue = FairQueue()
    heavy = [Job("heavy", random.randint(20, 40)) for _ in range(100)]
    for job in heavy:
        queue.push(job)
    queue.push(light := Job("light", 30))   # below any two heavy requests
    order = queue.drain()
    assert order.index(light) <= 1
    assert [j for j in order if j is not light] == heavy   # each user's own requests stay in order


def test_users_share_tokens_not_requests():
    queue = FairQueue()
    for _ in range(30):
        queue.push(Job("small", 10))
        queue.push(Job("big", 100))
    first = queue.drain()[:22]
    tokens = {user: sum(j.cost for j in first if j.user == user) for user in ("small", "big")}
    assert abs(tokens["small"] - tokens["big"]) <= 100   # about equal tokens: ten small per big one


def test_priority_comes_before_fairness():
    queue = FairQueue()
    low = [Job("a", 5) for _ in range(3)]
    for job in low:
        queue.push(job)
    queue.push(urgent := Job("a", 500, priority=1))
    assert queue.drain() == [urgent, *low]


def test_a_removed_job_is_never_admitted_and_its_tokens_leave_the_count():
    queue = FairQueue()
    jobs = [Job(f"u{i}", 10, prompt_tokens=i + 1) for i in range(4)]
    for job in jobs:
        queue.push(job)
    assert queue.remove(jobs[1]) and not queue.remove(jobs[1])
    assert len(queue) == 3 and queue.prompt_tokens == 1 + 3 + 4
    assert queue.drain() == [jobs[0], jobs[2], jobs[3]]
    assert queue.pop() is None and queue.prompt_tokens == 0


def test_the_predictor_refuses_only_what_it_predicts_over_the_slo():
    predictor = TtftPredictor(slo_seconds=0.5)
    assert predictor.misses_slo(10**6) is None            # nothing measured yet: admit
    predictor.observe_step(0.1, 100)                      # 1 ms a token, 0.1 s a step
    assert predictor.predict(200) == pytest.approx(0.2 + 0.1)
    assert predictor.misses_slo(300) is None
    assert predictor.misses_slo(500) == pytest.approx(0.5 + 0.1)
    assert predictor.retry_after(5000) == 6


def test_llmc_load_imports_no_server_module():
    check = ("import llmc, llmc.api, llmc.runtime.engine, sys; print(sorted(m for m in sys.modules if "
             "m.split('.')[0] in {'fastapi', 'uvicorn', 'starlette', 'prometheus_client'} "
             "or m.startswith('llmc.runtime.server')))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_llmc_serve_refuses_bad_options_before_loading_anything(tmp_path):
    import llmc
    from llmc.errors import RuntimeLlmcError

    for options, named in (({"max_queue": 0}, "max_queue"), ({"ttft_slo_ms": -5}, "ttft_slo_ms"),
                           ({"shutdown_timeout": float("nan")}, "shutdown_timeout")):
        with pytest.raises(RuntimeLlmcError, match=named):
            llmc.serve(tmp_path / "no-such.llmc", port=0, **options)
