"""Rank 0's side of a pipeline-parallel engine: `PipelineModelRunner` is the tensor-parallel runner
(launch.py: followers started, group joined, a dead or hung rank stopping the run in one line, no
process left behind) with pipeline stages for ranks: its followers run pipeline_worker.py, and a
step runs stage 0 on each micro-batch, the logits coming back from the last stage."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from llmc.errors import RuntimeLlmcError
from llmc.runtime.parallel.group import STEP, send
from llmc.runtime.parallel.launch import ShardedModelRunner
from llmc.runtime.parallel.pipeline_step import run_first_stage
from llmc.runtime.parallel.stage_groups import join_stage_groups
from llmc.runtime.parallel.step_batch import StepBatch


class PipelineModelRunner(ShardedModelRunner):
    """ModelRunner's `execute` for rank 0 (stage 0) of a pipeline-parallel artifact."""

    def __init__(self, path, manifest: dict, executor, cache, threads: int):
        parallel = manifest["parallel"]
        self.pp, self.logits, self.stage_tp = parallel["pp"], parallel["logits"], parallel.get("tp", 1)
        # the group is tp ranks per stage (rank = stage * tp + tp_rank); the base runner sizes it by "tp"
        super().__init__(path, dict(manifest, parallel=dict(parallel, tp=self.pp * self.stage_tp)), executor, cache,
                         threads)
        try:
            join_stage_groups(self.stage_tp, self.pp, self.timeout)
        except BaseException:
            self._ranks.stop(graceful=False)
            raise
        self.attention = executor.paged_backend(cache)  # stages hold different layers: no ring attention

    def _start(self, path, rank: int, port: int, threads: int) -> subprocess.Popen:
        args = {"rank": rank, "world": self.tp, "tp": self.stage_tp, "port": port,
                "blocks": self.cache.k_cache[0].shape[0], "block-size": self.cache.block_size, "threads": threads,
                "timeout": self.timeout}
        command = [sys.executable, "-m", "llmc.runtime.parallel.pipeline_worker",
                   *[f"--{k}={v}" for k, v in args.items()], str(path)]
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    @torch.inference_mode()
    def execute(self, scheduled, sampled, blocks_to_copy, drafts=None) -> torch.Tensor:
        """logits [len(sampled), vocab], rows in `sampled` order, as ModelRunner.execute."""
        if drafts:
            raise RuntimeLlmcError("speculative decoding does not run on a pipeline-parallel artifact yet; "
                                   "load it without a speculative config")
        batch = StepBatch.from_schedule(scheduled, sampled, blocks_to_copy)
        return self._collective(lambda: (send(self._ranks.streams(), STEP, batch.encode()),
                                         run_first_stage(batch, self.pp, self.executor, self.cache, self.attention,
                                                         self.logits))[1])

    def _why_failed(self, error: Exception) -> str:
        for _ in range(20):  # a rank that died may take a moment to be reaped
            dead = [(r, p.poll()) for r, p in enumerate(self._ranks.procs, 1) if p.poll() is not None]
            # code 1 is how a follower leaves when a peer's send or collective failed: name the cause first
            dead.sort(key=lambda d: d[1] == 1)
            if dead:
                r, code = dead[0]
                return (f"pipeline stage {r // self.stage_tp} (rank {r}) exited (code {code}) during a step; the run "
                        f"stopped and the other ranks were shut down")
            time.sleep(0.05)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (f"a send/recv between the {self.pp} pipeline stages failed or timed out "
                f"(limit {self.timeout:g} s, {first[:160]}); the run stopped")


__all__ = ["PipelineModelRunner"]
