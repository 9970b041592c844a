"""The engine behind the HTTP server: one thread owns the `Engine` and steps it while any request
is in flight. Handlers on the asyncio side `submit` jobs and `abort` them; the thread applies
both between steps (requests join and leave the batch there), moves jobs from the fair queue
into the engine while it has room, and hands each job the new text of every step as an `Update`
on the job's asyncio queue."""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from dataclasses import dataclass, field

from llmc.errors import RuntimeLlmcError
from llmc.runtime.outputs import CompletionOutput, RequestOutput
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.admission import FairQueue, draining_refusal, queue_full_refusal, slo_refusal
from llmc.runtime.server.metrics import ServerMetrics
from llmc.runtime.server.protocol import ApiError
from llmc.runtime.server.slo import TtftPredictor

# The stop_reason of requests still running when a shutdown's grace period ends.
SHUTDOWN_REASON = "server shutdown"


@dataclass
class SampleDelta:
    """What one sample gained in one step."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Update:
    deltas: list[SampleDelta]
    output: RequestOutput | None = None   # the whole result, with the request's last update
    error: ApiError | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None or self.error is not None


@dataclass
class Job:
    """One request on its way through the server: made by a handler, then the engine thread's."""
    request_id: str
    user: str
    priority: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    arrival: float = field(default_factory=time.monotonic)
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    request: object = None                       # the engine's request, once admitted
    sent: dict[int, int] = field(default_factory=dict)   # tokens handed out, by sample index
    done: set[int] = field(default_factory=set)          # samples whose finish was handed out
    scheduled: bool = False
    scheduled_at: float | None = None   # when a step first ran it
    last_token_time: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cost(self) -> int:
        """Tokens the request may take: the fair queue's price for it."""
        room = self.max_model_len - self.prompt_tokens
        return self.prompt_tokens + self.params.n * min(self.params.max_tokens or room, room)

    def deliver(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.updates.put_nowait, update)


class AsyncEngine:
    def __init__(self, engine, metrics: ServerMetrics, max_queue: int = 256, ttft_slo_ms: float | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.predictor = TtftPredictor(None if ttft_slo_ms is None else ttft_slo_ms / 1e3)
        self.queue = FairQueue()
        self._lock = threading.Lock()        # guards the queue, _queued, _aborts and the drain state
        self._wake = threading.Event()
        self._queued: dict[str, Job] = {}
        self._aborts: list[str] = []
        self._jobs: dict[str, Job] = {}      # engine thread only: jobs in the engine
        self._pending_tokens = 0             # prompt tokens the engine has still to prefill
        self._counts: dict = {"steps": 0}   # the engine's totals last read, by counter
        self._drain_deadline: float | None = None
        self._on_drained = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="llmc-engine", daemon=True)

    # -- the asyncio side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def healthy(self) -> bool:
        """What /health answers: serving (not shutting down)."""
        return not self.draining

    def submit(self, job: Job) -> None:
        """Queue `job`, or refuse it: 503 while shutting down, 429 when the queue is full or the
        request is predicted to miss the TTFT SLO."""
        with self._lock:
            if self.draining:
                raise draining_refusal()
            ahead = self.queue.prompt_tokens + self._pending_tokens + job.prompt_tokens
            retry = {"Retry-After": str(self.predictor.retry_after(ahead))}
            if len(self.queue) >= self.max_queue:
                raise queue_full_refusal(len(self.queue), self.max_queue, retry)
            predicted = self.predictor.misses_slo(ahead)
            if predicted is not None:
                raise slo_refusal(predicted, self.predictor.slo_seconds, retry)
            self.queue.push(job)
            self._queued[job.request_id] = job
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """The client left: drop the request before the engine's next step, freeing its KV blocks."""
        with self._lock:
            job = self._queued.pop(request_id, None)
            if job is not None:
                self.queue.remove(job)
                return
            self._aborts.append(request_id)
        self._wake.set()

    def drain(self, timeout: float, on_drained) -> None:
        """Shutdown: admit nothing more, refuse what is queued, let running requests finish for
        `timeout` seconds, then abort the rest; `on_drained()` runs (on the engine thread) after."""
        with self._lock:
            if self.draining:
                return
            self._drain_deadline, self._on_drained = time.monotonic() + timeout, on_drained
            queued = self.queue.drain()
            self._queued.clear()
        for job in queued:
            job.deliver(Update([], error=ApiError(503, "the server shut down before this request started; "
                                                  "send it again to another replica", kind="service_unavailable")))
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            try:
                self._take_commands()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._wake.wait(0.25)
                self._check_drain()
            except Exception as e:  # a bug or a kernel failure: fail what is in flight, keep serving
                traceback.print_exc()
                self._fail_all(e)

    def _take_commands(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, []
            admitted = []
            room = self.engine.config.max_num_seqs - len(self.engine.requests)
            while len(admitted) < room and not self.draining and (job := self.queue.pop()) is not None:
                del self._queued[job.request_id]
                admitted.append(job)
        for request_id in aborts:
            job = self._jobs.pop(request_id, None)
            if job is not None:
                self._finish(job, self._cut_short(job, "abort", None))
        for job in admitted:
            self._admit(job)
        self._update_gauges()

    def _admit(self, job: Job) -> None:
        try:
            self.engine.add_request(job.request_id, job.prompt, job.params, job.prompt_token_ids,
                                    priority=job.priority, arrival_time=job.arrival)
        except RuntimeLlmcError as e:
            job.deliver(Update([], error=ApiError(400, str(e))))
            return
        except Exception as e:  # a bug: this request fails, the others go on
            traceback.print_exc()
            job.deliver(Update([], error=ApiError(500, f"the engine could not take this request "
                                                  f"({type(e).__name__}: {e})", kind="internal_server_error")))
            return
        job.request = self.engine.requests[job.request_id]
        self._jobs[job.request_id] = job

    def _step(self) -> None:
        started = time.monotonic()
        outputs = self.engine.step()   # raising, it fails the requests in flight (see _run)
        now = time.monotonic()
        self._observe_step()
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is not None:
                self._publish(job, out, started, now)

    def _publish(self, job: Job, out: RequestOutput, started: float, now: float) -> None:
        if not job.scheduled:
            job.scheduled, job.scheduled_at = True, started
            self.metrics.queue_time.observe(max(started - job.arrival, 0.0))
        error = out.outputs[0].stop_reason if out.outputs[0].finish_reason == "abort" else None
        if isinstance(error, str):   # the scheduler refused it (it can never fit the KV cache)
            self._jobs.pop(job.request_id)
            self._finish(job, out)
            job.deliver(Update([], error=ApiError(400, error)))
            return
        deltas = self._deltas(job, out)
        if any(d.token_ids for d in deltas):
            if job.last_token_time is None:
                self.metrics.ttft.observe(now - job.arrival)
            else:
                self.metrics.itl.observe(now - job.last_token_time)
            job.last_token_time = now
        if out.finished:
            self._jobs.pop(job.request_id)
            self._finish(job, out)
        job.deliver(Update(deltas, output=out if out.finished else None))

    def _deltas(self, job: Job, out: RequestOutput) -> list[SampleDelta]:
        """Each sample's new text, tokens and logprobs since the last update; a stop string's
        possible start is held back until it is known not to be one."""
        deltas = []
        for sample, result in zip(sorted(job.request.samples, key=lambda s: s.index), out.outputs):
            sent = job.sent.get(sample.index, 0)
            text, token_ids = sample.stop.new_text(), result.token_ids[sent:]
            finish = result.finish_reason if sample.index not in job.done else None
            if not (text or token_ids or finish):
                continue
            job.sent[sample.index] = len(result.token_ids)
            if finish:
                job.done.add(sample.index)
            logprobs = result.logprobs[sent:] if result.logprobs is not None else None
            deltas.append(SampleDelta(sample.index, text, token_ids, logprobs, finish, result.stop_reason))
        return deltas

    def _finish(self, job: Job, out: RequestOutput) -> None:
        m = out.metrics
        e2e = None if m is None or m.finished_time is None else m.finished_time - m.arrival_time
        self.metrics.request_finished(out.outputs[0].finish_reason or "abort", len(out.prompt_token_ids),
                                      sum(len(o.token_ids) for o in out.outputs), e2e, m, job.scheduled_at)

    def _cut_short(self, job: Job, reason: str, stop_reason: str | None) -> RequestOutput:
        """Abort an admitted job now (its KV blocks are freed at once) and give what it made."""
        self.engine.abort(job.request_id)
        req = job.request
        req.metrics.finished_time = time.monotonic()
        outputs = [CompletionOutput(s.index, s.stop.output_text, list(s.seq.output_token_ids), s.cumulative_logprob,
                                    s.logprobs, reason, stop_reason)
                   for s in sorted(req.samples, key=lambda s: s.index)]
        return RequestOutput(job.request_id, job.prompt, job.prompt_token_ids, outputs, True, req.metrics)

    def _fail_all(self, error: Exception) -> None:
        for job in list(self._jobs.values()):
            self._jobs.pop(job.request_id)
            self._finish(job, self._cut_short(job, "abort", "engine failure"))
            job.deliver(Update([], error=ApiError(
                500, f"the engine failed while running this request ({type(error).__name__}: {error}); the "
                     "request was aborted, the server goes on serving others", kind="internal_server_error")))

    def _check_drain(self) -> None:
        if self._drain_deadline is None or self._on_drained is None:
            return
        if self._jobs and time.monotonic() < self._drain_deadline:
            return
        for job in list(self._jobs.values()):
            self._jobs.pop(job.request_id)
            out = self._cut_short(job, "abort", SHUTDOWN_REASON)
            self._finish(job, out)
            job.deliver(Update(self._deltas(job, out), output=out))
        on_drained, self._on_drained = self._on_drained, None
        self._update_gauges()
        on_drained()

    def _observe_step(self) -> None:
        """Engine counters into Prometheus; the engine's own sample lists are emptied as they are
        read, since a server runs for days and the histograms keep the distributions."""
        e, s = self.engine.metrics, self.engine.scheduler
        if e.steps > self._counts["steps"]:
            self._counts["steps"] = e.steps
            self.metrics.step_tokens.observe(e.batch_tokens[-1])
            self.metrics.step_seqs.observe(e.batch_seqs[-1])
            self.predictor.observe_step(e.step_seconds[-1], e.batch_tokens[-1])
        for counter, value in self._engine_counts():
            counter.inc(value - self._counts.get(counter, 0))
            self._counts[counter] = value
        for samples in (e.step_seconds, e.batch_tokens, e.batch_seqs, e.kv_waste_samples, e.ttft, e.tpot, e.e2e):
            samples.clear()
        self._pending_tokens = sum(seq.num_tokens - seq.num_computed_tokens for seq in s.waiting)
        self._update_gauges()

    def _engine_counts(self) -> list[tuple]:
        """(Prometheus counter, the engine's running total it follows)."""
        m, s, spec = self.metrics, self.engine.scheduler, self.engine.metrics.speculative
        counts = [(m.prefix_queries, s.num_admitted_tokens), (m.prefix_hits, s.num_prefix_hit_tokens),
                  (m.preemptions, s.num_preemptions)]
        if spec is not None:
            counts += [(m.spec_drafts, spec.num_drafts), (m.spec_draft_tokens, spec.num_draft_tokens),
                       (m.spec_accepted, spec.num_accepted_tokens)]
        return counts

    def _update_gauges(self) -> None:
        s = self.engine.scheduler
        self.metrics.running.set(s.num_running)
        self.metrics.waiting.set(s.num_waiting + len(self.queue))
        self.metrics.kv_usage.set(self.engine.block_manager.usage)
