"""One engine process of a disaggregated server (start.py starts it with `python -m
llmc.runtime.server.disaggregate.engine`, or torchrun on another machine): the server's AsyncEngine
loop with the router (rank 0) in place of HTTP clients. A prefill engine runs each request's prompt,
samples its first token, streams it to the router and hands the request to the decode engine the
router named (kv_transfer.py: the prompt's KV blocks packed, sent, freed here, the full ones kept in
this prefix cache); a decode engine takes those requests in, decodes them, and runs whole the requests
the router sends it directly (n > 1, prompt logprobs). A decode engine preempts by recompute, as any
engine: the preempted request is prefilled again here, not sent back.

What an engine tells the router (each batch of messages one list, in order): "update" (a request's new
tokens, its output or error), "handoff" (prefill: a request left for its decode engine), "received"
(decode: a handoff's KV arrived, its bytes and seconds), "aborted" (dropped on the router's word),
"source_gone" (decode: a prefill engine's connection failed), "stats" (its blocks and counters, twice
a second while it steps) and "alive" (a heartbeat when it has said nothing for HEARTBEAT_S, from its
sender thread, so a long step is not taken for a hang). It exits when the router is gone.

An engine the router declares gone ("engine_gone": it exited, or hung; under torchrun the router cannot
kill a hung one, so its connections stay open and a wait on it never ends) is done with: a prefill
engine drops the packed KV it still holds for it (queued, or waiting for its answer), a decode engine
releases the prefix blocks it held for handoffs from it whose KV had not come; the router has ended
those requests already. A handoff whose KV is being written to a hung engine stays referenced by that
send until the process ends (torch.distributed cannot cancel it)."""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

import llmc
from llmc.compiler.artifact import read_manifest
from llmc.errors import LlmcError, RuntimeLlmcError
from llmc.runtime.device import resolve_device
from llmc.runtime.kv_transfer import Channel, Handoff, can_hand_off, export_request, recv_kv, send_kv
from llmc.runtime.parallel.group import process_group_backend, rank_device
from llmc.runtime.sequence import Sequence
from llmc.runtime.server.disaggregate.group import ROUTER, Roles, first_line, join_groups, log, parse_roles
from llmc.runtime.server.engine_loop import AsyncEngine, Job, Update
from llmc.runtime.server.metrics import ServerMetrics
from llmc.runtime.server.protocol import ApiError

STATS_EVERY_S = 0.5
HEARTBEAT_S = 0.5            # "alive" after this long without a message to the router
RECENT_IDS = 4096            # a decode engine remembers this many finished requests (a late abort is for none)


@dataclass
class RemoteJob(Job):
    """A request the router sent: its updates go back to the router."""
    worker: EngineWorker | None = None
    decode: int | None = None    # a prefill engine's: the decode engine to hand it to
    expect_held: int = 0         # ... and how many of its prompt's blocks the router expects it to hold

    def deliver(self, update: Update) -> None:
        self.worker.send_update(self.request_id, update)


class EngineWorker(AsyncEngine):
    """The engine loop of one prefill or decode engine, on this process's main thread."""

    def __init__(self, engine, roles: Roles, rank: int, channel: Channel, kv_group):
        super().__init__(engine, ServerMetrics(roles.name(rank)), max_queue=1 << 30)
        self.roles, self.rank, self.role = roles, rank, roles.role(rank)
        self.channel, self.kv_group = channel, kv_group
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()   # from the reader threads
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # to the router, by its sender thread
        self._pending: list[Handoff] = []            # decode: KV here, no room yet; first come first
        self._pending_kv: dict[str, torch.Tensor] = {}
        self._tombstones: set[str] = set()        # decode: aborted before their KV came
        self._held: dict[str, Sequence] = {}      # decode: a handoff's blocks found in this prefix cache
        self._skipped: dict[str, int] = {}        # decode: how many of them its KV left out
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._held_from: dict[str, int] = {}      # decode: the prefill engine each held handoff comes from
        self._outboxes = {d: queue.SimpleQueue() for d in roles.decode_ranks} if self.role == "prefill" else {}
        # prefill: each handed-off request's decode engine and its packed KV ([kv] until sent or dropped)
        self._unsent: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._unsent_lock = threading.Lock()
        self._gone: set[int] = set()              # engines the router declared gone
        self._dropped = 0                         # prefill: handoffs dropped for them
        self._last_stats = 0.0

    def serve(self) -> None:
        """Run until the router says stop (or is gone: the process exits)."""
        self._thread_for(self._read_router, "from-router")
        self._thread_for(self._send_router, "to-router")
        if self.role == "decode":
            for p in self.roles.prefill_ranks:
                self._thread_for(lambda p=p: self._read_kv(p), f"kv-from-{p}")
        for d, outbox in self._outboxes.items():
            self._thread_for(lambda d=d, outbox=outbox: self._send_kv(d, outbox), f"kv-to-{d}")
        self._run()

    def _thread_for(self, target, name: str) -> None:
        threading.Thread(target=target, name=f"llmc-{name}", daemon=True).start()

    # -- reader and sender threads -----------------------------------------------------------
    def _read_router(self) -> None:
        while True:
            try:
                message = self.channel.recv(ROUTER)
            except RuntimeError:   # the router is gone: nothing is left to serve
                os._exit(1)
            if message["op"] == "stop":
                self._stopped = True
            self._inbox.put(message)
            self._wake.set()

    def _read_kv(self, src: int) -> None:
        """Decode: each handoff from prefill engine `src` and its KV, received while this engine steps:
        the engine thread holds the prompt's blocks this prefix cache has, and only the others come (those
        after the router's expected hits at once, while the engine thread answers; the expected ones this
        cache lacks after the answer)."""
        handoff = None
        try:
            while True:
                handoff = self.channel.recv(src)
                started = time.perf_counter()
                held = queue.SimpleQueue()
                self._inbox.put({"op": "hold", "handoff": handoff, "held": held, "source": src})
                self._wake.set()
                expected = handoff.expect_held
                tail = recv_kv(src, self._blocks_shape(handoff, handoff.kv_shape[2] - expected), self.engine.device,
                               self.kv_group)   # sent without waiting for the answer: it overlaps the hold
                skipped, answered = held.get()
                hold_seconds = answered - started   # the engine thread's answer: up to a step
                self.channel.send(src, skipped)
                if skipped < expected:   # the blocks between come after the answer
                    middle = recv_kv(src, self._blocks_shape(handoff, expected - skipped), self.engine.device,
                                     self.kv_group)
                    kv, moved = torch.cat([middle, tail], dim=2), middle.numel() + tail.numel()
                else:   # held more than expected: those came for nothing
                    kv, moved = tail[:, :, skipped - expected:].contiguous(), tail.numel()
                self._inbox.put({"op": "kv", "handoff": handoff, "kv": kv, "skipped": skipped, "source": src,
                                 "moved": moved, "seconds": time.perf_counter() - started,
                                 "hold_seconds": hold_seconds})
                self._wake.set()
                handoff = None
        except RuntimeError as e:   # that engine is gone: what it had not sent in full will not come
            log(f"{self.roles.name(self.rank)}: {self.roles.name(src)} is gone ({first_line(e)})")
            self._inbox.put({"op": "source_gone", "source": src,
                             "unsent": None if handoff is None else handoff.request_id})
            self._wake.set()

    @staticmethod
    def _blocks_shape(handoff: Handoff, blocks: int) -> tuple[int, ...]:
        return (*handoff.kv_shape[:2], blocks, *handoff.kv_shape[3:])

    def _send_kv(self, dst: int, outbox: queue.SimpleQueue) -> None:
        """Prefill: the handoffs for decode engine `dst`, one after another: the notice, the KV of the
        blocks after those the router expects it to hold (at once: it overlaps the decode engine's wait
        for its engine thread), its answer (how many leading blocks it holds), the expected blocks it
        lacks. The KV stays in its box (not in this frame), so that _on_engine_gone can drop it while
        this thread waits (a tensor given to a send stays referenced by that send)."""
        gone = False
        while True:
            handoff, box = outbox.get()
            try:
                if gone or dst in self._gone:
                    continue   # the router ends these requests: it saw that engine go too
                with self._unsent_lock:
                    kv = box[0] if box else None
                if kv is None:
                    continue   # dropped: the router declared `dst` gone
                expected = handoff.expect_held
                self.channel.send(dst, handoff)
                send_kv(dst, kv[:, :, expected:], self.kv_group)
                kv = None
                skipped = self.channel.recv(dst)   # leading blocks its prefix cache holds
                with self._unsent_lock:
                    kv = box.pop() if box else None
                if kv is not None and skipped < expected:   # else dropped while waiting, or all sent
                    send_kv(dst, kv[:, :, skipped:expected], self.kv_group)
                kv = None
            except RuntimeError as e:
                gone = True
                log(f"{self.roles.name(self.rank)}: {self.roles.name(dst)} is gone ({first_line(e)})")
            finally:
                with self._unsent_lock:
                    self._unsent.pop(handoff.request_id, None)
                    box.clear()   # dropped: nothing refers to its KV while this thread waits for the next

    # -- the engine thread -------------------------------------------------------------------
    def send_update(self, request_id: str, update: Update) -> None:
        e = update.error
        error = None if e is None else {"status": e.status, "message": e.message, "param": e.param,
                                        "code": e.code, "kind": e.kind}
        self._tell({"op": "update", "rid": request_id, "deltas": update.deltas, "output": update.output,
                    "error": error})

    def _tell(self, message: dict) -> None:
        """To the router, in order, by the sender thread: a step never waits on the router's reading."""
        self._outbox.put(message)

    def _send_router(self) -> None:
        """What the engine thread told the router, each batch of it in one message (a list). A handoff's
        KV goes to its decode engine's sender only once the router has the request's first token and
        the handoff notice: the decode engine's tokens never overtake them."""
        while True:
            try:
                batch, item = [], self._outbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                batch, item = [{"op": "alive"}], None
            while isinstance(item, dict):
                batch.append(item)
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    item = None
            try:
                if batch:
                    self.channel.send(ROUTER, batch)
            except RuntimeError:   # the router is gone: nothing is left to serve
                os._exit(1)
            if item is not None:   # (decode rank, handoff, [kv])
                self._outboxes[item[0]].put(item[1:])

    def _take_commands(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            getattr(self, f"_on_{message['op']}")(message)
        if self._pending:
            self._adopt_pending()
        super()._take_commands()
        self._report()

    def _on_stop(self, message: dict) -> None:
        self._stopped = True

    def _on_add(self, m: dict) -> None:
        job = RemoteJob(m["rid"], m["user"], m["priority"], m["prompt"], m["prompt_token_ids"], m["params"],
                        self.engine.max_model_len, loop=None, worker=self, decode=m["decode"],
                        expect_held=m.get("expect_held", 0))
        try:
            self.submit(job)
        except ApiError as e:
            job.deliver(Update([], error=e))

    def _on_abort(self, m: dict) -> None:
        """Drop the request wherever it is here and say so; a decode engine remembers an abort that
        came before the request's KV (the router sends it only once the prefill engine handed it over)."""
        rid = m["rid"]
        with self._lock:
            job = self._queued.pop(rid, None)
            if job is not None:
                self.queue.remove(job)
        if job is None and rid in self._jobs:
            job = self._jobs.pop(rid)
            self._finish(job, self._cut_short(job, "abort", None))
        held = job is not None or self._drop_pending(rid)
        if held:
            self._tell({"op": "aborted", "rid": rid})
        elif self.role == "decode" and rid not in self._recent:
            self._tombstones.add(rid)

    def _drop_pending(self, rid: str) -> bool:
        self._pending = [h for h in self._pending if h.request_id != rid]
        self._release(rid)
        self._skipped.pop(rid, None)
        return self._pending_kv.pop(rid, None) is not None

    def _on_hold(self, m: dict) -> None:
        """Decode: a handoff's notice came; hold the blocks of its prompt this prefix cache has (they need
        not travel) and tell the reader how many."""
        h, bm = m["handoff"], self.engine.block_manager
        if h.request_id in self._tombstones or m["source"] in self._gone:
            m["held"].put((0, time.perf_counter()))
            return
        held = Sequence(h.prompt_token_ids + [h.first_token], request_id=h.request_id)
        held.uses_prefix_cache = bm.window is None   # as Scheduler.admit_prefilled
        m["held"].put((bm.hold_cached_prefix(held), time.perf_counter()))
        self._held[h.request_id], self._held_from[h.request_id] = held, m["source"]

    def _release(self, rid: str) -> None:
        self._held_from.pop(rid, None)
        held = self._held.pop(rid, None)
        if held is not None:
            self.engine.block_manager.free(held)

    def _on_kv(self, m: dict) -> None:
        """Decode: a handoff and its KV arrived (the transfer's bytes and time go to the router); it is
        taken in once the batch and the blocks have room."""
        h = m["handoff"]
        if m["source"] in self._gone:   # the router ended it when it declared that engine gone
            self._release(h.request_id)
            return
        if h.request_id in self._tombstones:
            self._tombstones.discard(h.request_id)
            self._release(h.request_id)
            self._tell({"op": "aborted", "rid": h.request_id})
            return
        self._tell({"op": "received", "rid": h.request_id, "bytes": m["moved"],
                    "seconds": h.pack_seconds + m["seconds"], "hold_seconds": m["hold_seconds"]})
        self._pending.append(h)
        self._pending_kv[h.request_id], self._skipped[h.request_id] = m["kv"], m["skipped"]

    def _on_engine_gone(self, m: dict) -> None:
        """The router declared engine `m["rank"]` gone (and ended the requests it held): drop the KV
        queued for it (prefill), release the blocks held for its handoffs (decode)."""
        rank = m["rank"]
        self._gone.add(rank)
        with self._unsent_lock:
            lost = [rid for rid, (d, _) in self._unsent.items() if d == rank]
            for rid in lost:
                self._unsent.pop(rid)[1].clear()
        self._dropped += len(lost)
        outbox = self._outboxes.get(rank)
        while outbox is not None and not outbox.empty():
            try:
                outbox.get_nowait()   # the notices: their sender thread may wait on `rank` for ever
            except queue.Empty:
                break
        for rid in [rid for rid, src in self._held_from.items() if src == rank]:
            self._release(rid)
            self._skipped.pop(rid, None)
        if lost:
            log(f"{self.roles.name(self.rank)}: dropped the KV of {len(lost)} handoffs for {self.roles.name(rank)}")
        self._last_stats = 0.0   # report at once

    def _on_source_gone(self, m: dict) -> None:
        if m["unsent"] is not None:
            self._release(m["unsent"])
        self._tell(m)   # after every handoff that came from there: the router ends the ones still on their way

    def _adopt_pending(self) -> None:
        """Decode: take in the handed-over requests, first come first, while the batch and blocks have room."""
        while self._pending:
            h = self._pending[0]
            try:
                if not self.engine.add_prefilled(h, self._pending_kv[h.request_id], self._skipped[h.request_id]):
                    return
            except RuntimeLlmcError as e:   # it can never fit this engine's cache
                self.send_update(h.request_id, Update([], error=ApiError(400, str(e))))
            self._drop_pending(h.request_id)   # the held blocks go: the request holds them now
            if h.request_id in self.engine.requests:
                self._adopted(h)

    def _adopted(self, h: Handoff) -> None:
        now = time.monotonic()
        job = RemoteJob(h.request_id, "", h.priority, h.prompt, h.prompt_token_ids, h.params,
                        self.engine.max_model_len, loop=None, worker=self, sent={0: 1}, scheduled=True,
                        scheduled_at=now, last_token_time=now)
        job.request = self.engine.requests[h.request_id]
        self._jobs[h.request_id] = job

    def _step(self) -> None:
        super()._step()
        if self.role == "prefill":
            for job in [j for j in self._jobs.values() if j.decode is not None]:
                if can_hand_off(self.engine, job.request_id):
                    self._hand_off(job)

    def _hand_off(self, job: RemoteJob) -> None:
        """Prefill: the request's first token went out with the step's updates; its KV goes to the decode
        engine now, and it leaves this engine (its blocks freed)."""
        handoff, kv = export_request(self.engine, job.request_id)
        handoff.expect_held = min(job.expect_held, handoff.kv_shape[2] - 1)   # the last block always goes
        del self._jobs[job.request_id]
        self._tell({"op": "handoff", "rid": job.request_id})
        if job.decode in self._gone:
            self._dropped += 1
            return
        box = [kv]
        with self._unsent_lock:
            self._unsent[job.request_id] = (job.decode, box)
        self._outbox.put((job.decode, handoff, box))   # to its sender once the router has the above

    def _finish(self, job: Job, out) -> None:
        super()._finish(job, out)
        self._recent[job.request_id] = None
        while len(self._recent) > RECENT_IDS:
            self._recent.popitem(last=False)

    def _report(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_EVERY_S:
            return
        self._last_stats = now
        s, bm, spec = self.engine.scheduler, self.engine.block_manager, self.engine.metrics.speculative
        stats = {"op": "stats", "free_blocks": bm.num_free_blocks, "blocks": bm.num_blocks,
                 "running": s.num_running, "waiting": s.num_waiting + len(self.queue) + len(self._pending),
                 "prefix_queries": s.num_admitted_tokens, "prefix_hits": s.num_prefix_hit_tokens,
                 "preemptions": s.num_preemptions, "seconds_per_token": self.predictor.seconds_per_token,
                 "step_seconds": self.predictor.step_seconds, "kv_dropped": self._dropped}
        with self._unsent_lock:
            stats["kv_unsent_bytes"] = sum(box[0].numel() for _, box in self._unsent.values() if box)
        if spec is not None:
            stats |= {"spec_drafts": spec.num_drafts, "spec_draft_tokens": spec.num_draft_tokens,
                      "spec_accepted": spec.num_accepted_tokens}
        self._tell(stats)


def engine_device(path: str, options: dict, local_index: int) -> torch.device:
    """Where this engine runs: the CPU, or its own GPU (this machine's `local_index`-th, made current)."""
    return rank_device(resolve_device(read_manifest(Path(path)), options.get("device"), path), local_index)


def run_engine(path: str, roles: Roles, rank: int, options: dict, init_method: str, local_index: int,
               say=None) -> int:
    """An engine's life: load the artifact (telling `say(dict)` whether it did), join the groups, serve."""
    say = say or (lambda message: log(f"{roles.name(rank)}: {json.dumps(message)}"))
    try:
        device = engine_device(path, options, local_index)
        engine = llmc.load(path, **options).engine
    except LlmcError as e:
        say({"error": str(e)})
        return 2
    say({"loaded": True})
    kv_group = join_groups(rank, roles.world, init_method, process_group_backend(device))
    EngineWorker(engine, roles, rank, Channel(), kv_group).serve()
    return 0


def _follow_router() -> None:
    """Started by the router on this machine: its end of our stdin closes when it exits, and so do we.
    Ctrl-C and SIGTERM sent to the whole process group are the router's to handle (it drains, then
    stops the engines): this process ignores them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch():
        sys.stdin.buffer.read()
        os._exit(1)
    threading.Thread(target=watch, name="llmc-stdin", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmc.runtime.server.disaggregate.engine")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--roles", required=True)
    parser.add_argument("--options", default="{}", help="llmc.load's engine options, as JSON")
    parser.add_argument("artifact")
    args = parser.parse_args(argv)
    _follow_router()
    return run_engine(args.artifact, parse_roles(args.roles), args.rank, json.loads(args.options),
                      f"tcp://127.0.0.1:{args.port}", args.rank - 1,
                      say=lambda message: print(json.dumps(message), flush=True))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # at once: no goodbye with peers that may be gone
