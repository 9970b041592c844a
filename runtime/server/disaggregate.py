"""`llmc serve ART --disaggregate prefill:P,decode:D`: prefill and decode run in engine processes of
their own (disaggregate_engine.py) behind the same OpenAI server, so long prompts no longer stall the
decode steps of running requests. This process is the router (rank 0 of a torch.distributed group;
the engines are ranks 1 .. P + D): it tokenises, queues fairly, and sends each request to the prefill
engine with the least work, naming the decode engine with the fewest requests; the prefill engine
streams the first token back and sends the request's KV blocks to that decode engine, which streams
the rest. Requests that need their prompt and samples in one engine (n > 1, prompt logprobs) run
whole on a decode engine.

A request is in one stage at a time: "prefill" (the prefill engine holds it), "transfer" (handed off,
its KV on the way) or "decode" (the decode engine holds it). An abort goes to the engine of its stage
(one sent in "prefill" that meets a handed-off request is sent on to the decode engine when the
handoff arrives); the router forgets a request when an engine finishes it or says it dropped it. An
engine that exits ends its requests with a 500 (a stream: an error event), logs one line, and,
if it was the last of its role, /health answers 503 and new requests get 503.

On one machine the router starts the engines itself (rendezvous on the loopback); across machines
torchrun starts every rank through the same env rendezvous as llmc.runtime.launch:

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr HOST0 --master-port 29500 \\
        -m llmc.runtime.server.disaggregate smol.llmc --disaggregate prefill:2,decode:1 --host 0.0.0.0
    # rank 0 (on HOST0) serves HTTP; ranks 1, 2 prefill; rank 3 decodes (--node-rank 1 on the other)
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge, Histogram

from llmc.compiler.artifact import TOKENIZER_DIR, read_manifest
from llmc.compiler.tokenizer_files import load_tokenizer
from llmc.errors import LlmcError, RuntimeLlmcError
from llmc.runtime.device import resolve_device
from llmc.runtime.engine import Engine
from llmc.runtime.kv_transfer import Channel
from llmc.runtime.launch import rendezvous_env
from llmc.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmc.runtime.parallel.group import free_port
from llmc.runtime.server.admission import FairQueue
from llmc.runtime.server.disaggregate_engine import ROUTER, Roles, join_groups, parse_roles, run_engine
from llmc.runtime.server.engine_loop import SHUTDOWN_REASON, Job, SampleDelta, Update
from llmc.runtime.server.metrics import ServerMetrics
from llmc.runtime.server.protocol import ApiError
from llmc.runtime.structured_output import GrammarCompiler
from llmc.runtime.threads import resolve_threads

LOAD_TIMEOUT_S = 600.0
# set by main() under torchrun: every rank is already running, join by its env rendezvous
rendezvous: str | None = None
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTES_BUCKETS = tuple(2 ** e for e in range(16, 34, 2))   # 64 KiB .. 4 GiB


class RoutedModel:
    """What the server's front needs of the model (tokenizer, context, grammars) without its weights:
    the engines hold those."""

    prompt_ids = Engine.prompt_ids   # reads only the tokenizer, the vocabulary and the context

    def __init__(self, path):
        self.path = Path(path)
        manifest = read_manifest(self.path)
        if manifest.get("parallel"):
            raise RuntimeLlmcError(f"artifact '{path}' is sharded (--tp/--pp); --disaggregate serves an unsharded "
                                   f"artifact, each engine whole")
        self.manifest, self.model = manifest, manifest["model"]
        self.tokenizer = load_tokenizer(self.path / TOKENIZER_DIR, self.model["vocab_size"], f"artifact '{path}'")
        self.max_model_len = self.model["max_position_embeddings"]
        eos = self.model["eos_token_ids"] or [self.tokenizer.eos_token_id]
        self.grammars = GrammarCompiler(self.tokenizer, self.model["vocab_size"], eos)


class DisaggregateMetrics(ServerMetrics):
    """The server's metrics, and the KV transfers and engines of a disaggregated one."""

    def __init__(self, model_name: str, roles: Roles):
        super().__init__(model_name)
        counter, histogram = self._family(Counter), self._family(Histogram)
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV bytes moved from prefill to decode engines.")
        self.kv_transfer_seconds = histogram(
            "kv_transfer_seconds", "Per request: its KV blocks packed on the prefill engine and received on the "
            "decode engine.", buckets=_SECONDS_BUCKETS)
        self.kv_transfer_request_bytes = histogram("kv_transfer_request_bytes", "Per request: the KV bytes moved.",
                                                   buckets=_BYTES_BUCKETS)

        def engine_gauge(name, doc):
            gauge = Gauge(f"llmc:{name}", doc, ["model_name", "engine"], registry=self.registry)
            return {r: gauge.labels(engine=roles.name(r), **self.labels) for r in range(1, roles.world)}
        self.engine_up = engine_gauge("engine_up", "1 while the engine process serves, 0 once it is gone.")
        self.engine_free_blocks = engine_gauge("engine_kv_free_blocks", "The engine's free KV blocks (prefix-cached "
                                               "ones included), as it last reported.")
        self.engine_blocks = engine_gauge("engine_kv_blocks", "The engine's KV blocks.")
        self.engine_requests = engine_gauge("engine_requests", "Requests the engine holds: running, waiting, and "
                                            "(decode) handed over but not yet taken in.")
        for up in self.engine_up.values():
            up.set(1)


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


class Router:
    """The server's core (what app.py and launch.py drive: submit, abort, drain, start, stop) when
    the engines run in processes of their own. One thread sends every message to the engines, in
    order; one thread per engine reads its messages."""

    def __init__(self, roles: Roles, channel: Channel, metrics: DisaggregateMetrics, max_queue: int,
                 max_num_seqs: int, processes: dict[int, subprocess.Popen] | None = None):
        self.roles, self.channel, self.metrics = roles, channel, metrics
        self.max_queue, self.max_num_seqs, self.processes = max_queue, max_num_seqs, processes or {}
        self.queue = FairQueue()
        self._cond = threading.Condition()    # guards everything below
        self._queued: dict[str, Job] = {}
        self._routed: dict[str, _Routed] = {}
        self._outbox: list[tuple[int, dict]] = []
        self._alive = {r: True for r in range(1, roles.world)}
        self._load = {r: 0 for r in range(1, roles.world)}     # prefill: requests in prefill; decode: all it has
        self._engine_waiting = {r: 0 for r in range(1, roles.world)}
        self._engine_used = {r: (0, 0) for r in roles.decode_ranks}
        self._totals: dict[tuple[int, str], int] = {}
        self._drain_deadline: float | None = None
        self._on_drained = None
        self._stopped = self._closed = False
        self._threads = [threading.Thread(target=self._dispatch, name="llmc-router", daemon=True)]
        self._threads += [threading.Thread(target=self._read, args=(r,), name=f"llmc-from-{r}", daemon=True)
                          for r in range(1, roles.world)]
        if self.processes:
            self._threads.append(threading.Thread(target=self._watch, name="llmc-watch", daemon=True))

    # -- what app.py and launch.py call ----------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._stopped = self._closed = True
            alive = [r for r, up in self._alive.items() if up]
            self._cond.notify_all()
        for r in alive:
            try:
                self.channel.send(r, {"op": "stop"})
            except RuntimeError:
                pass
        stop_processes(self.processes)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def healthy(self) -> bool:
        return not self.draining and self._missing_role() is None

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.draining:
                raise ApiError(503, "the server is shutting down and takes no new requests; send it to another "
                               "replica", kind="service_unavailable")
            missing = self._missing_role()
            if missing is not None:
                raise ApiError(503, f"no {missing} engine is running (they exited); the server cannot serve, "
                               f"restart it", kind="service_unavailable")
            if len(self.queue) >= self.max_queue:
                raise ApiError(429, f"the server's queue is full ({len(self.queue)} requests waiting, --max-queue "
                               f"{self.max_queue}); retry later", kind="rate_limit_exceeded")
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

    # -- sending: the dispatcher thread ----------------------------------------------------------
    def _send_later(self, rank: int, message: dict) -> None:
        self._outbox.append((rank, message))
        self._cond.notify_all()

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._outbox or self._can_route()):
                    if not self._cond.wait(0.25) and self.draining:
                        break
                if self._stopped:
                    return
                self._route_queued()
                out, self._outbox = self._outbox, []
            for rank, message in out:
                self._send(rank, message)
            self._check_drain()

    def _send(self, rank: int, message: dict) -> None:
        if not self._alive[rank]:
            return
        try:
            self.channel.send(rank, message)
        except RuntimeError as e:
            self._engine_gone(rank, _first_line(e))

    def _free(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if self._alive[r] and self._load[r] < self.max_num_seqs]

    def _can_route(self) -> bool:
        return bool(len(self.queue) and self._free(self.roles.prefill_ranks) and self._free(self.roles.decode_ranks))

    def _route_queued(self) -> None:
        """Queued jobs to the engines with the least load, while both roles have room (locked)."""
        while self._can_route():
            job = self.queue.pop()
            del self._queued[job.request_id]
            d = min(self._free(self.roles.decode_ranks), key=lambda r: self._load[r])
            whole = job.params.n > 1 or job.params.prompt_logprobs is not None
            p = None if whole else min(self._free(self.roles.prefill_ranks), key=lambda r: self._load[r])
            self._routed[job.request_id] = _Routed(job, p, d, "decode" if whole else "prefill")
            for r in (p, d):
                if r is not None:
                    self._load[r] += 1
            job.scheduled, job.scheduled_at = True, time.monotonic()
            self.metrics.queue_time.observe(max(job.scheduled_at - job.arrival, 0.0))
            self._send_later(d if whole else p, {
                "op": "add", "rid": job.request_id, "user": job.user, "priority": job.priority, "prompt": job.prompt,
                "prompt_token_ids": job.prompt_token_ids, "params": job.params, "decode": None if whole else d})

    # -- receiving: one thread per engine --------------------------------------------------------
    def _read(self, rank: int) -> None:
        while True:
            try:
                messages = self.channel.recv(rank)   # what the engine said since it last sent, in order
            except RuntimeError as e:
                if not self._stopped:
                    self._engine_gone(rank, _first_line(e))
                return
            for message in messages:
                getattr(self, f"_on_{message['op']}")(rank, message)

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
        r.job.deliver(Update(m["deltas"], output=output))

    def _on_handoff(self, rank: int, m: dict) -> None:
        with self._cond:
            r = self._routed.get(m["rid"])
            if r is None:
                return
            self._leave_prefill(r, "transfer")   # unless the decode engine's "received" came first
            r.handed_off, early, r.early = True, r.early, []
            if not self._alive[r.decode]:
                self._fail([r], f"{self.roles.name(r.decode)} exited before this request's KV reached it")
            elif r.aborted and r.abort_sent_to != r.decode:
                self._send_later(r.decode, {"op": "abort", "rid": r.job.request_id})
                r.abort_sent_to = r.decode
        for message in early:
            self._on_update(r.decode, message)

    def _on_received(self, rank: int, m: dict) -> None:
        self.metrics.kv_transfer_bytes.inc(m["bytes"])
        self.metrics.kv_transfer_request_bytes.observe(m["bytes"])
        self.metrics.kv_transfer_seconds.observe(m["seconds"])
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
        for counter, name in ((mx.prefix_queries, "prefix_queries"), (mx.prefix_hits, "prefix_hits"),
                              (mx.preemptions, "preemptions")):
            counter.inc(max(m[name] - self._totals.get((rank, name), 0), 0))
            self._totals[rank, name] = m[name]
        with self._cond:
            self._engine_waiting[rank] = m["waiting"]
            if rank in self._engine_used:
                self._engine_used[rank] = (m["blocks"] - m["free_blocks"], m["blocks"])
            self._update_gauges()

    # -- bookkeeping (locked) --------------------------------------------------------------------
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
        now = time.monotonic()
        for r in records:
            self._forget(r)
            if r.stage == "prefill" and r.prefill is not None and self._alive[r.prefill]:
                self._send_later(r.prefill, {"op": "abort", "rid": r.job.request_id})   # it frees the blocks
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

    # -- engines that exit -----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopped:
            for rank, proc in self.processes.items():
                if self._alive[rank] and proc.poll() is not None:
                    self._engine_gone(rank, "")
            time.sleep(0.5)

    def _engine_gone(self, rank: int, why: str) -> None:
        code = self._exit_code(rank)
        with self._cond:
            if self._stopped or not self._alive[rank]:
                return
            self._alive[rank] = False
            self.metrics.engine_up[rank].set(0)
            name = self.roles.name(rank)
            exited = f"{name} (rank {rank}) exited" + (f" with code {code}" if code is not None else "")
            lost = [r for r in self._routed.values()
                    if r.decode == rank or (r.stage == "prefill" and r.prefill == rank)]
            self._fail(lost, f"{exited} while it held this request")
            queued = [] if self._missing_role() is None else self.queue.drain()
            for job in queued:
                del self._queued[job.request_id]
        _log(f"{exited}{f' ({why})' if why else ''}; {len(lost)} of its requests ended with an error"
             + ("" if self._missing_role() is None else f"; no {self._missing_role()} engine is left: /health "
                "answers 503 and new requests get 503"))
        for job in queued:
            job.deliver(Update([], error=ApiError(503, f"{exited}; no engine of its role is left", kind=
                                                  "service_unavailable")))

    def _exit_code(self, rank: int) -> int | None:
        proc = self.processes.get(rank)
        for _ in range(20):   # a process that died may take a moment to be reaped
            if proc is None or proc.poll() is not None:
                break
            time.sleep(0.05)
        return None if proc is None else proc.poll()

    # -- shutdown --------------------------------------------------------------------------------
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


def _log(line: str) -> None:
    print(f"llmc serve: {line}", file=sys.stderr, flush=True)


def _first_line(error: Exception) -> str:
    return ((str(error).strip().splitlines() or [type(error).__name__])[0])[:160]


# -- starting the engines ------------------------------------------------------------------------
@dataclass
class Engines:
    """The router's side of started engines: the model for the server's front, and the core."""
    model: RoutedModel
    core: Router

    def close(self) -> None:
        self.core.stop()


def check_options(roles: Roles, engine_options: dict, refused: dict) -> dict:
    """Each engine's llmc.load options: --threads (the machine's) split between the engines; options
    that do not combine with --disaggregate (`refused`: flag -> value) are an error."""
    given = [flag for flag, value in refused.items() if value is not None]
    if engine_options.get("speculative") is not None:
        given.append("--speculative")
    if given:
        raise RuntimeLlmcError(f"{given[0]} does not combine with --disaggregate yet; serve without one of them")
    engines = roles.prefill + roles.decode
    threads = max(1, resolve_threads(engine_options.get("threads")) // engines)
    return {k: v for k, v in engine_options.items() if k != "speculative"} | {"threads": threads}


def start_engines(path, roles_text: str, served_name: str, max_queue: int, engine_options: dict,
                  refused: dict | None = None) -> Engines:
    """Parse --disaggregate, start the engine processes (on this machine; under torchrun, join those
    already running), and make the router."""
    roles = parse_roles(roles_text)
    options = check_options(roles, engine_options, refused or {})
    model = RoutedModel(path)
    backend = _kv_backend(model, options, roles)
    processes, port = ({}, None) if rendezvous is not None else _start_processes(path, roles, options)
    try:
        join_groups(ROUTER, roles.world, rendezvous or f"tcp://127.0.0.1:{port}", backend)
    except BaseException:
        stop_processes(processes)
        raise
    metrics = DisaggregateMetrics(served_name, roles)
    return Engines(model, Router(roles, Channel(), metrics, max_queue, options.get("max_num_seqs", 64), processes))


def _kv_backend(model: RoutedModel, options: dict, roles: Roles) -> str:
    device = resolve_device(model.manifest, options.get("device"), model.path)
    if device.type != "cuda":
        return "gloo"
    engines = roles.prefill + roles.decode
    if rendezvous is None and torch.cuda.device_count() < engines:
        raise RuntimeLlmcError(f"--disaggregate {roles}: {engines} engines need a GPU each, this machine has "
                               f"{torch.cuda.device_count()}")
    return "nccl"


def _start_processes(path, roles: Roles, options: dict) -> tuple[dict[int, subprocess.Popen], int]:
    """The engine processes, each loaded (or the error that stopped one), and their rendezvous port."""
    port = free_port()
    procs = {}
    try:
        for rank in range(1, roles.world):
            command = [sys.executable, "-m", "llmc.runtime.server.disaggregate_engine", f"--rank={rank}",
                       f"--port={port}", f"--roles={roles}", f"--options={json.dumps(options)}", str(path)]
            procs[rank] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        _wait_loaded(roles, procs)
    except BaseException:
        stop_processes(procs)
        raise
    return procs, port


def _wait_loaded(roles: Roles, procs: dict[int, subprocess.Popen]) -> None:
    waiting = {p.stdout: rank for rank, p in procs.items()}
    selector = selectors.DefaultSelector()
    for stream in waiting:
        selector.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while waiting:
        ready = selector.select(timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeLlmcError(f"{', '.join(roles.name(r) for r in waiting.values())} did not load within "
                                   f"{LOAD_TIMEOUT_S:.0f} s")
        for key, _ in ready:
            rank = waiting.pop(key.fileobj)
            selector.unregister(key.fileobj)
            try:
                status = json.loads(key.fileobj.readline())
            except ValueError:
                status = {}
            if not isinstance(status, dict) or status.get("loaded") is not True:
                why = status.get("error") if isinstance(status, dict) else None
                raise RuntimeLlmcError(f"{roles.name(rank)} failed to load: "
                                       f"{why or f'it exited with code {procs[rank].wait()} before loading'}")


def stop_processes(procs: dict[int, subprocess.Popen]) -> None:
    """Close the engines' stdin (they exit at its end), then wait for them; kill what stays."""
    for p in procs.values():
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()


# -- torchrun ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Every rank of a disaggregated server started by torchrun (see the module's first lines)."""
    import llmc.runtime.server.disaggregate as imported  # what launch.py reads: under -m this one is __main__
    from llmc.runtime.server.launch import serve  # here: launch.py imports this module when asked to disaggregate

    parser = argparse.ArgumentParser(prog="torchrun ... -m llmc.runtime.server.disaggregate",
                                     description="serve an llmc artifact with prefill and decode on torchrun's ranks")
    parser.add_argument("artifact")
    parser.add_argument("--disaggregate", required=True, metavar="prefill:P,decode:D")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("LLMC_API_KEY"))
    parser.add_argument("--served-model-name")
    parser.add_argument("--kv-memory", default="1GiB", help="each engine's KV cache budget")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, help="CPU threads of each engine (default: $LLMC_NUM_THREADS, else "
                        "the machine's physical cores over the engines on it)")
    parser.add_argument("--device", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    try:
        rank, world = rendezvous_env()
        roles = parse_roles(args.disaggregate)
        if world != roles.world:
            raise RuntimeLlmcError(f"--disaggregate {roles} needs {roles.world} ranks (a router and "
                                   f"{roles.world - 1} engines) but torchrun started {world}")
        imported.rendezvous = "env://"
        options = {"kv_memory": args.kv_memory, "max_num_seqs": args.max_num_seqs, "device": args.device,
                   "threads": args.threads}
        if rank == ROUTER:
            serve(args.artifact, args.host, args.port, api_key=args.api_key, served_model_name=args.served_model_name,
                  disaggregate=args.disaggregate, **options)
            return 0
        local = int(os.environ.get("LOCAL_RANK", rank))
        local_engines = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        options["threads"] = args.threads or max(1, resolve_threads(None) // local_engines)
        return run_engine(args.artifact, roles, rank, options, "env://", local)
    except LlmcError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
