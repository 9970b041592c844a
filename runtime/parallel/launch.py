"""Rank 0's side of a tensor-parallel engine: `ShardedModelRunner` starts the follower ranks (fresh
interpreters running worker.py, which load only their own plan and weights), joins their group,
and on each step sends the batch to the followers and runs its own part of it; the logits it
returns are whole (the plan's all_gather joins the vocabulary). A rank that dies or hangs stops the
run with one error line, and every follower is gone when the runner is closed, collected, or the
process ends."""

from __future__ import annotations

import subprocess
import sys
import time
import weakref
from dataclasses import dataclass

import torch

from llmc.errors import RuntimeLlmcError
from llmc.runtime.parallel.group import (
    STOP,
    collective_timeout,
    free_port,
    join_group,
    leave_group,
    process_group_backend,
    rank_device,
    send,
    wait_loaded,
)
from llmc.runtime.parallel.lead import LeadRunner
from llmc.runtime.parallel.ring_attention import ring_backend, ring_threshold
from llmc.runtime.parallel.steps import lead_step
from llmc.runtime.threads import apply_threads

# set by llmc.runtime.launch under torchrun, where every rank already runs: (manifest, executor, cache) -> runner
joined_runner = None


@dataclass
class _Ranks:
    """The followers (rank r is procs[r - 1]) and whether this process joined their group; shut
    down once."""
    procs: list[subprocess.Popen]
    joined: bool = False
    stopped: bool = False
    busy: bool = False          # mid-step: the followers wait in a collective, not for a message
    failure: str | None = None

    def stop(self, graceful: bool = True) -> None:
        if self.stopped:
            return
        self.stopped = True
        # interrupted mid-step (Ctrl-C), the group is left as it is: the process is on its way out
        clean = not self.busy
        if graceful and clean and self.joined:
            try:
                send(self.streams(), STOP)
            except OSError:  # a follower already gone
                pass
        for p in self.procs:
            if p.stdin:
                try:
                    p.stdin.close()  # a follower exits at the end of its stdin
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10 if graceful else 2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        if clean and self.joined:
            leave_group()

    def streams(self) -> list:
        return [p.stdin for p in self.procs]


class ShardedModelRunner(LeadRunner):
    """Rank 0's runner of a tensor-parallel artifact, its followers started here."""

    worker = "llmc.runtime.parallel.worker"   # the followers' module

    def __init__(self, path, manifest: dict, executor, cache, threads: int, ring_threshold: int):
        tp = manifest["parallel"]["tp"]
        self.tp, self.executor, self.cache = tp, executor, cache
        self.timeout = collective_timeout()
        self.ring_threshold = ring_threshold  # one value for every rank: the followers get rank 0's
        self.attention = ring_backend(executor.paged_backend(cache), manifest, self.ring_threshold, self.timeout)
        self.step = lead_step(manifest["parallel"], executor, cache, self.attention)
        threads = max(1, threads // tp)  # --threads is the machine's: each rank computes with its share
        apply_threads(threads)
        rank_device(executor.device, 0)  # rank r runs on this machine's GPU r
        port = free_port()
        self._ranks = _Ranks([self._start(path, r, port, threads) for r in range(1, tp)])
        self._finalizer = weakref.finalize(self, self._ranks.stop)
        try:
            wait_loaded(dict(enumerate(self._ranks.procs, 1)), self._rank_name)
            join_group(0, tp, port, self.timeout, process_group_backend(executor.device))
            self._ranks.joined = True
        except BaseException:
            self._ranks.stop(graceful=False)
            raise

    def _start(self, path, rank: int, port: int, threads: int) -> subprocess.Popen:
        args = {"rank": rank, "world": self.tp, "port": port, "blocks": self.cache.k_cache[0].shape[0],
                "block-size": self.cache.block_size, "threads": threads, "timeout": self.timeout,
                "device": self.executor.device.type, **self._worker_args()}
        command = [sys.executable, "-m", self.worker, *[f"--{k}={v}" for k, v in args.items()], str(path)]
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def _worker_args(self) -> dict:
        # the followers run rank 0's invariance mode and activation rounding (the load's, not only the artifact's)
        return {"ring-threshold": self.ring_threshold, "batch-invariant": int(self.executor.batch_invariant),
                "q4-activations": self.executor.q4_activations}

    def tell(self, kind: int, payload: torch.Tensor | None = None) -> None:
        send(self._ranks.streams(), kind, payload)

    def _rank_name(self, rank: int) -> str:
        return f"tensor-parallel rank {rank}"

    def _collective(self, work):
        if self._ranks.failure is not None:
            raise RuntimeLlmcError(self._ranks.failure)
        try:
            self._ranks.busy = True
            result = work()
            self._ranks.busy = False
            return result
        except (RuntimeError, OSError) as e:  # a collective failed or timed out; a follower's stdin broke
            self._ranks.busy = False  # the step failed as a whole: the group can be left
            self._ranks.failure = self._why_failed(e)
            self._ranks.stop(graceful=False)
            raise RuntimeLlmcError(self._ranks.failure) from None

    def _why_failed(self, error: Exception) -> str:
        for _ in range(20):  # a rank that died may take a moment to be reaped
            dead = [(r, p.poll()) for r, p in enumerate(self._ranks.procs, 1) if p.poll() is not None]
            # code 1 is how a follower leaves when a peer's collective failed: name the cause first
            dead.sort(key=lambda d: d[1] == 1)
            if dead:
                r, code = dead[0]
                return (f"{self._rank_name(r)} exited (code {code}) during a step; the run stopped and the other "
                        f"ranks were shut down")
            time.sleep(0.05)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"{self._links()} failed or timed out (limit {self.timeout:g} s, {first[:160]}); the run stopped"

    def _links(self) -> str:
        return f"a collective across the {self.tp} tensor-parallel ranks"

    def close(self) -> None:
        self._finalizer()


def start_ranks(path, manifest: dict, executor, cache, threads: int,
                ring_attention_threshold: int | None = None) -> LeadRunner:
    """The runner of a sharded artifact (manifest["parallel"]), its followers started: over gloo on
    the CPU, over NCCL on CUDA (rank r on this machine's GPU r). Tensor-parallel prefills of
    `ring_attention_threshold` tokens or more run ring attention (0: never; None:
    $LLMC_RING_ATTENTION_THRESHOLD, else 4096)."""
    if joined_runner is not None:
        return joined_runner(manifest, executor, cache)
    threshold = ring_threshold(ring_attention_threshold)
    if torch.distributed.is_initialized():
        raise RuntimeLlmcError(f"cannot start the ranks of '{path}': this process already belongs to a "
                               f"torch.distributed group (another tensor-parallel LLM still runs here); close "
                               f"that one first (LLM.close())")
    if "logits_indices" not in executor.plan.inputs:
        raise RuntimeLlmcError(f"artifact '{path}': its plan takes no logits_indices; recompile it")
    if manifest["parallel"].get("pp", 1) > 1:
        from llmc.runtime.parallel.pipeline import PipelineModelRunner  # parallel.pipeline imports this module: a cycle
        return PipelineModelRunner(path, manifest, executor, cache, threads)
    return ShardedModelRunner(path, manifest, executor, cache, threads, threshold)


__all__ = ["ShardedModelRunner", "start_ranks"]
