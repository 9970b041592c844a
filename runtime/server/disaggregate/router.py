"""The router: the server's core (what app.py and launch.py drive: submit, abort, drain, start, stop)
when prefill and decode run in engine processes of their own. It queues requests fairly, sends each to
the prefill and decode engines that hold the longest cached prefix of its prompt (affinity.py) unless
they are too busy (_overloaded says the bound), else to those with the least work, and follows each
request through its stages from the engines' messages (engine.py says what each sends):

  "prefill"   the prefill engine holds it (requests with n > 1 or prompt logprobs skip this stage and
              run whole on a decode engine);
  "transfer"  the prefill engine handed it off after its first token: its KV is on the way;
  "decode"    the decode engine took it in.

An abort goes to the engine of the request's stage (one that meets a handed-off request is sent on to
the decode engine when the handoff arrives); the router forgets a request when an engine finishes it
or says it dropped it. An engine that exits or stops answering (liveness.py) ends its requests with a
500 in the OpenAI error envelope; once the last of a role is gone, /health and new requests get 503.

Threads: one routes queued requests, one per engine sends it its messages in order (a hung engine
stalls only its own), one per engine reads what it says, one watches that each still answers."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field

from llmc.runtime.engine import EngineConfig
from llmc.runtime.kv_transfer import Channel
from llmc.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmc.runtime.server.admission import FairQueue, draining_refusal, queue_full_refusal, slo_refusal
from llmc.runtime.server.disaggregate.affinity import PrefixAffinity, prompt_block_hashes
from llmc.runtime.server.disaggregate.group import Roles, first_line, log
from llmc.runtime.server.disaggregate.liveness import EngineWatch
from llmc.runtime.server.disaggregate.metrics import DisaggregateMetrics
from llmc.runtime.server.engine_loop import SHUTDOWN_REASON, Job, SampleDelta, Update
from llmc.runtime.server.protocol import ApiError
from llmc.runtime.server.slo import TtftPredictor

STOP_WAIT_S = 5.0   # at shutdown, how long the engines' senders may take to deliver "stop"


@dataclass
class _Routed:
    job: Job
    prefill: int | None    # None: runs whole on the decode engine
    decode: int
    stage: str             # "prefill" | "transfer" | "decode"
    aborted: bool = False
    abort_sent_to: int | None = None
    handed_off: bool = False
    early: list[dict] = field(default_factory=list)   # the decode engine's updates read before the handoff
    deltas: list[SampleDelta] = field(default_factory=list)   # handed out so far
    first_token_time: float | None = None

    @property
    def holder(self) -> int:
        return self.prefill if self.stage == "prefill" else self.decode

    def held_by(self, rank: int) -> bool:
        """Whether the request is lost if engine `rank` is: it decodes there, or is still coming from there."""
        return rank == self.decode or (rank == self.prefill and self.stage in ("prefill", "transfer"))


class Router:
    """The server's core in front of engine processes (see the module's first lines)."""

    def __init__(self, roles: Roles, channel: Channel, metrics: DisaggregateMetrics, max_queue: int,
                 max_num_seqs: int, processes: dict[int, subprocess.Popen] | None = None,
                 ttft_slo_ms: float | None = None, block_size: int = EngineConfig.block_size,
                 prefix_caching: bool = True):
        self.roles, self.channel, self.metrics = roles, channel, metrics
        self.max_queue, self.max_num_seqs = max_queue, max_num_seqs
        # where prompts' blocks were sent, by role (none when the engines cache no prefixes)
        self.block_size = block_size
        self._affinity = {role: PrefixAffinity() for role in ("prefill", "decode")} if prefix_caching else None
        self.decode_slack = max(2, max_num_seqs // 8)   # see _overloaded
        # --ttft-slo-ms: each prefill engine's speed, as it last reported it
        self.slo_seconds = None if ttft_slo_ms is None else ttft_slo_ms / 1e3
        self._speed = {r: TtftPredictor(self.slo_seconds) for r in roles.prefill_ranks}
        self.queue = FairQueue()
        self.watch = EngineWatch(roles.engine_ranks, processes or {}, self._engine_gone)
        self._cond = threading.Condition()    # guards everything below
        self._queued: dict[str, Job] = {}
        self._routed: dict[str, _Routed] = {}
        self._outboxes: dict[int, queue.SimpleQueue] = {r: queue.SimpleQueue() for r in roles.engine_ranks}
        self._alive = dict.fromkeys(roles.engine_ranks, True)
        self._load = dict.fromkeys(roles.engine_ranks, 0)     # prefill: requests in prefill; decode: all it has
        self._engine_waiting = dict.fromkeys(roles.engine_ranks, 0)
        self._engine_used = dict.fromkeys(roles.decode_ranks, (0, 0))
        self._totals: dict[tuple[int, str], int] = {}
        self._drain_deadline: float | None = None
        self._on_drained = None
        self._stopped = self._closed = False
        self._senders = [_thread(self._send_to, f"to-{r}", r) for r in roles.engine_ranks]
        self._threads = [_thread(self._dispatch, "router"), *self._senders,
                         *(_thread(self._read, f"from-{r}", r) for r in roles.engine_ranks)]

    # -- what app.py and launch.py call ----------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()
        self.watch.start()

    def stop(self) -> None:
        """Tell the engines to stop (each waits at most STOP_WAIT_S for its sender); the router is done."""
        with self._cond:
            if self._closed:
                return
            self._stopped = self._closed = True
            alive = [r for r, up in self._alive.items() if up]
            self._cond.notify_all()
        self.watch.stop()
        for r in alive:
            self._outboxes[r].put({"op": "stop"})
        deadline = time.monotonic() + STOP_WAIT_S
        for r in self.roles.engine_ranks:
            self._outboxes[r].put(None)
        for t in self._senders:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def healthy(self) -> bool:
        return not self.draining and self._missing_role() is None

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.draining:
                raise draining_refusal()
            missing = self._missing_role()
            if missing is not None:
                raise ApiError(503, f"no {missing} engine is running (they exited or stopped answering); the "
                               f"server cannot serve, restart it", kind="service_unavailable")
            if len(self.queue) >= self.max_queue:
                raise queue_full_refusal(len(self.queue), self.max_queue)
            self._check_slo(job)
            self.queue.push(job)
            self._queued[job.request_id] = job
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        """The client left: drop the request where it is (the engine frees its KV blocks)."""
        with self._cond:
            job = self._queued.pop(request_id, None)
            if job is not None:
                self.queue.remove(job)
                return
            r = self._routed.get(request_id)
            if r is None or r.aborted:
                return
            r.aborted, r.abort_sent_to = True, r.holder
            self._send_later(r.holder, {"op": "abort", "rid": request_id})

    def drain(self, timeout: float, on_drained) -> None:
        with self._cond:
            if self.draining:
                return
            self._drain_deadline, self._on_drained = time.monotonic() + timeout, on_drained
            queued = self.queue.drain()
            self._queued.clear()
            self._cond.notify_all()
        for job in queued:
            job.deliver(Update([], error=ApiError(503, "the server shut down before this request started; send it "
                                                  "again to another replica", kind="service_unavailable")))

    def _check_slo(self, job: Job) -> None:
        """--ttft-slo-ms (locked): refuse the job (429) if its first token is predicted late on the prefill
        engine with the fewest prompt tokens ahead (the router's queue shared among the live ones)."""
        if self.slo_seconds is None:
            return
        live = [r for r in self.roles.prefill_ranks if self._alive[r]]   # one at least: submit checked
        ahead = self._prefill_tokens()
        rank = min(live, key=ahead.get)
        tokens = ahead[rank] + self.queue.prompt_tokens // len(live) + job.prompt_tokens
        predicted = self._speed[rank].misses_slo(tokens)
        if predicted is not None:
            raise slo_refusal(predicted, self.slo_seconds, {"Retry-After": str(self._speed[rank].retry_after(tokens))})

    # -- routing: the router thread ----------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            with self._cond:
                if not (self._stopped or self._can_route()):
                    self._cond.wait(0.25)
                if self._stopped:
                    return
                self._route_queued()
            self._check_drain()

    def _free(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if self._alive[r] and self._load[r] < self.max_num_seqs]

    def _can_route(self) -> bool:
        return bool(len(self.queue) and self._free(self.roles.prefill_ranks) and self._free(self.roles.decode_ranks))

    def _route_queued(self) -> None:
        """Queued jobs to the engines that hold their prompts' prefixes or have the least load, while both
        roles have room (locked)."""
        while self._can_route():
            job = self.queue.pop()
            del self._queued[job.request_id]
            hashes = prompt_block_hashes(job.prompt_token_ids, self.block_size) if self._affinity else []
            d, held = self._choose("decode", hashes)
            whole = job.params.n > 1 or job.params.prompt_logprobs is not None
            p = None if whole else self._choose("prefill", hashes)[0]
            self._routed[job.request_id] = _Routed(job, p, d, "decode" if whole else "prefill")
            for r in (p, d):
                if r is not None:
                    self._load[r] += 1
                    if self._affinity:
                        self._affinity[self.roles.role(r)].record(hashes, r)
            job.scheduled, job.scheduled_at = True, time.monotonic()
            self.metrics.queue_time.observe(max(job.scheduled_at - job.arrival, 0.0))
            self._send_later(d if whole else p, {
                "op": "add", "rid": job.request_id, "user": job.user, "priority": job.priority, "prompt": job.prompt,
                "prompt_token_ids": job.prompt_token_ids, "params": job.params, "decode": None if whole else d,
                "expect_held": held})

    def _choose(self, role: str, hashes: list[int]) -> tuple[int, int]:
        """The engine of `role` for a prompt with these block hashes (locked): the live one holding the
        longest cached prefix of it (the least loaded of those that tie), unless it is overloaded; else
        the least loaded with room. And how many of the prompt's blocks the chosen one is thought to hold."""
        ranks = self.roles.prefill_ranks if role == "prefill" else self.roles.decode_ranks
        least = min(self._free(ranks), key=lambda r: self._load[r])
        depth = self._affinity[role].matched(hashes) if hashes else {}
        held = [r for r in ranks if self._alive[r] and depth.get(r)]
        if not held:
            return least, depth.get(least, 0)
        best = max(held, key=lambda r: (depth[r], -self._load[r]))
        if self._overloaded(role, best, least, depth[best]):
            self.metrics.affinity_overloaded[role].inc()
            return least, depth.get(least, 0)
        self.metrics.affinity_hits[role].inc()
        return best, depth[best]

    def _overloaded(self, role: str, holder: int, least: int, blocks: int) -> bool:
        """Whether `holder`, whose prefix cache has the prompt's first `blocks`, is too busy to take it
        (locked). A full engine is. A prefill engine is when the prompt tokens queued on it beyond those on
        the least loaded one outnumber the tokens its cache saves: prefill time grows with the tokens
        computed, so past that the prompt's first token comes later there than where it is computed whole.
        A decode engine is when it runs more than `decode_slack` requests (max_num_seqs / 8, at least 2)
        beyond the least loaded: a decode step reads the weights once for the whole batch, so a few more
        rows cost each little, while a hit saves moving the blocks and storing them twice; the slack keeps
        the engines' batches, and so their requests' TPOT, within that many rows of each other."""
        if holder not in self._free([holder]):
            return True
        if role == "prefill":
            ahead = self._prefill_tokens()
            return ahead[holder] - ahead[least] > blocks * self.block_size
        return self._load[holder] - self._load[least] > self.decode_slack

    def _prefill_tokens(self) -> dict[int, int]:
        """Each prefill engine's prompt tokens in prefill (locked)."""
        ahead = dict.fromkeys(self.roles.prefill_ranks, 0)
        for routed in self._routed.values():
            if routed.stage == "prefill" and routed.prefill is not None:
                ahead[routed.prefill] += routed.job.prompt_tokens
        return ahead

    # -- sending: one thread per engine ------------------------------------------------------------
    def _send_later(self, rank: int, message: dict) -> None:
        self._outboxes[rank].put(message)

    def _send_to(self, rank: int) -> None:
        outbox = self._outboxes[rank]
        while (message := outbox.get()) is not None:
            if not self._alive[rank]:
                continue
            try:
                self.channel.send(rank, message)
            except RuntimeError as e:
                self._engine_gone(rank, self.watch.exited(rank, first_line(e)))

    # -- receiving: one thread per engine ----------------------------------------------------------
    def _read(self, rank: int) -> None:
        while True:
            try:
                messages = self.channel.recv(rank)   # what the engine said since it last sent, in order
            except RuntimeError as e:
                if not self._stopped:
                    self._engine_gone(rank, self.watch.exited(rank, first_line(e)))
                return
            self.watch.heard(rank)
            if not self._alive[rank]:
                continue   # declared hung, then woke up: its requests were ended already
            for message in messages:
                getattr(self, f"_on_{message['op']}")(rank, message)

    def _on_alive(self, rank: int, m: dict) -> None:
        pass   # a heartbeat: watch.heard() above is all it is for

    def _on_update(self, rank: int, m: dict) -> None:
        now = time.monotonic()
        with self._cond:
            r = self._routed.get(m["rid"])
            if r is None:
                return
            if rank != r.prefill and r.prefill is not None and not r.handed_off:
                r.early.append(m)   # the decode engine's, read before the handoff (and the first token)
                return
            if m["output"] is not None or m["error"] is not None:
                self._forget(r)
        if m["error"] is not None:
            self._finished(r, "abort", now)
            r.job.deliver(Update([], error=ApiError(**m["error"])))
            return
        if any(d.token_ids for d in m["deltas"]):
            if r.first_token_time is None:
                r.first_token_time = now
                self.metrics.ttft.observe(now - r.job.arrival)
            else:
                self.metrics.itl.observe(now - r.job.last_token_time)
            r.job.last_token_time = now
        r.deltas += m["deltas"]
        output = m["output"]
        if output is not None:
            output.metrics = self._finished(r, output.outputs[0].finish_reason or "abort", now, output)
            self._record_generated(r)
        r.job.deliver(Update(m["deltas"], output=output))

    def _on_handoff(self, rank: int, m: dict) -> None:
        with self._cond:
            r = self._routed.get(m["rid"])
            if r is None:
                return
            self._leave_prefill(r, "transfer")   # unless the decode engine's "received" came first
            r.handed_off, early, r.early = True, r.early, []
            if not self._alive[r.decode]:
                self._fail([r], f"{self.roles.name(r.decode)} was gone before this request's KV reached it")
            elif r.aborted and r.abort_sent_to != r.decode:
                self._send_later(r.decode, {"op": "abort", "rid": r.job.request_id})
                r.abort_sent_to = r.decode
        for message in early:
            self._on_update(r.decode, message)

    def _on_received(self, rank: int, m: dict) -> None:
        self.metrics.kv_transfer_bytes.inc(m["bytes"])
        self.metrics.kv_transfer_request_bytes.observe(m["bytes"])
        self.metrics.kv_transfer_seconds.observe(m["seconds"])
        self.metrics.kv_transfer_hold_seconds.observe(m["hold_seconds"])
        with self._cond:
            r = self._routed.get(m["rid"])
            if r is not None:
                self._leave_prefill(r, "decode")
                r.stage = "decode"

    def _on_aborted(self, rank: int, m: dict) -> None:
        with self._cond:
            r = self._routed.get(m["rid"])
            if r is None:
                return
            self._forget(r)
        self._finished(r, "abort", time.monotonic())

    def _on_source_gone(self, rank: int, m: dict) -> None:
        """A decode engine took in everything the dead prefill engine `m["source"]` had sent it: what is
        still in transfer from there will not come."""
        with self._cond:
            lost = [r for r in self._routed.values()
                    if r.stage == "transfer" and r.prefill == m["source"] and r.decode == rank]
            self._fail(lost, f"{self.roles.name(m['source'])} exited while sending this request's KV")

    def _on_stats(self, rank: int, m: dict) -> None:
        mx = self.metrics
        mx.engine_free_blocks[rank].set(m["free_blocks"])
        mx.engine_blocks[rank].set(m["blocks"])
        mx.engine_requests[rank].set(m["running"] + m["waiting"])
        mx.engine_kv_unsent_bytes[rank].set(m.get("kv_unsent_bytes", 0))
        for name, counter in mx.engine_counters().items():
            if name in m:
                counter.inc(max(m[name] - self._totals.get((rank, name), 0), 0))
                self._totals[rank, name] = m[name]
        with self._cond:
            if rank in self._speed and m["seconds_per_token"] is not None:
                self._speed[rank].seconds_per_token, self._speed[rank].step_seconds = (m["seconds_per_token"],
                                                                                       m["step_seconds"])
            self._engine_waiting[rank] = m["waiting"]
            if rank in self._engine_used:
                self._engine_used[rank] = (m["blocks"] - m["free_blocks"], m["blocks"])
            self._update_gauges()

    def _record_generated(self, r: _Routed) -> None:
        """The decode engine's prefix cache also holds the blocks of what it generated, which the next
        turn of a chat repeats in its prompt: remember them too."""
        if self._affinity and r.job.params.n == 1:
            tokens = r.job.prompt_token_ids + [t for d in r.deltas for t in d.token_ids]
            hashes = prompt_block_hashes(tokens, self.block_size)
            with self._cond:
                self._affinity["decode"].record(hashes, r.decode)

    # -- bookkeeping (locked) ----------------------------------------------------------------------
    def _leave_prefill(self, r: _Routed, stage: str) -> None:
        if r.stage == "prefill":
            self._load[r.prefill] -= 1
            r.stage = stage
            self._cond.notify_all()

    def _forget(self, r: _Routed) -> None:
        if self._routed.pop(r.job.request_id, None) is None:
            return
        if r.stage == "prefill" and r.prefill is not None:
            self._load[r.prefill] -= 1
        self._load[r.decode] -= 1
        self._cond.notify_all()

    def _finished(self, r: _Routed, reason: str, now: float, output: RequestOutput | None = None) -> RequestMetrics:
        """The request's metrics on the router's clock, recorded."""
        job = r.job
        generated = sum(len(d.token_ids) for d in r.deltas)
        m = RequestMetrics(job.arrival, r.first_token_time, now, job.prompt_tokens, generated,
                           output.metrics.num_cached_tokens if output is not None and output.metrics else 0)
        self.metrics.request_finished(reason, job.prompt_tokens, generated, now - job.arrival, m, job.scheduled_at)
        return m

    def _fail(self, records: list[_Routed], why: str) -> None:
        """End these requests with a 500; the engine of each one's stage, if it still serves, drops it
        (freeing its blocks; a decode engine drops a request in transfer when its KV comes)."""
        now = time.monotonic()
        for r in records:
            self._forget(r)
            if self._alive[r.holder]:
                self._send_later(r.holder, {"op": "abort", "rid": r.job.request_id})
            self._finished(r, "abort", now)
            r.job.deliver(Update([], error=ApiError(500, f"{why}; the request was ended, the server goes on with "
                                                         "its other engines", kind="internal_server_error")))

    def _missing_role(self) -> str | None:
        for role, ranks in (("prefill", self.roles.prefill_ranks), ("decode", self.roles.decode_ranks)):
            if not any(self._alive[r] for r in ranks):
                return role
        return None

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self._routed))
        self.metrics.waiting.set(len(self.queue) + sum(self._engine_waiting.values()))
        used, blocks = (sum(x) for x in zip(*self._engine_used.values()))
        self.metrics.kv_usage.set(used / blocks if blocks else 0.0)

    # -- engines that exit or hang -----------------------------------------------------------------
    def _engine_gone(self, rank: int, what: str) -> None:
        """Engine `rank` exited or stopped answering (`what` says which): end what it held."""
        self.watch.forget(rank)
        with self._cond:
            if self._stopped or not self._alive[rank]:
                return
            self._alive[rank] = False
            self.metrics.engine_up[rank].set(0)
            if self._affinity:
                self._affinity[self.roles.role(rank)].forget(rank)
            for other in self.roles.engine_ranks:   # they drop what they hold for it (engine.py)
                if self._alive[other]:
                    self._send_later(other, {"op": "engine_gone", "rank": rank})
            gone = f"{self.roles.name(rank)} (rank {rank}) {what}"
            lost = [r for r in self._routed.values() if r.held_by(rank)]
            self._fail(lost, f"{gone} while it held this request")
            missing = self._missing_role()
            queued = [] if missing is None else self.queue.drain()
            for job in queued:
                del self._queued[job.request_id]
        log(f"{gone}; {len(lost)} of its requests ended with an error"
            + ("" if missing is None else f"; no {missing} engine is left: /health answers 503 and new requests "
               "get 503"))
        for job in queued:
            job.deliver(Update([], error=ApiError(503, f"{gone}; no {missing} engine is left",
                                                  kind="service_unavailable")))

    # -- shutdown ----------------------------------------------------------------------------------
    def _check_drain(self) -> None:
        with self._cond:
            if self._drain_deadline is None or self._on_drained is None:
                return
            if self._routed and time.monotonic() < self._drain_deadline:
                return
            left = list(self._routed.values())
            for r in left:
                self._forget(r)
                self._send_later(r.holder, {"op": "abort", "rid": r.job.request_id})
            on_drained, self._on_drained = self._on_drained, None
        now = time.monotonic()
        for r in left:
            out = _cut_short(r, SHUTDOWN_REASON)
            out.metrics = self._finished(r, "abort", now)
            r.job.deliver(Update([SampleDelta(o.index, "", [], None, "abort", SHUTDOWN_REASON) for o in out.outputs],
                                 output=out))
        on_drained()


def _cut_short(r: _Routed, stop_reason: str) -> RequestOutput:
    """What the request made so far (its handed-out deltas), finished with "abort"."""
    job, outputs = r.job, []
    for index in range(job.params.n):
        mine = [d for d in r.deltas if d.index == index]
        logprobs = [lp for d in mine for lp in (d.logprobs or [])] if any(d.logprobs for d in mine) else None
        outputs.append(CompletionOutput(index, "".join(d.text for d in mine), [t for d in mine for t in d.token_ids],
                                        None, logprobs, "abort", stop_reason))
    return RequestOutput(job.request_id, job.prompt, job.prompt_token_ids, outputs, True)


def _thread(target, name: str, *args) -> threading.Thread:
    return threading.Thread(target=target, args=args, name=f"llmc-{name}", daemon=True)
