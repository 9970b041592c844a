"""Rank 0's side of a pipeline-parallel engine: `PipelineModelRunner` is the tensor-parallel runner
(launch.py: followers started, group joined, a dead or hung rank stopping the run in one line, no
process left behind) with pipeline stages for ranks: its followers run pipeline_worker.py, and a
step runs stage 0 on each micro-batch, the logits coming back from the last stage (steps.lead_step)."""

from __future__ import annotations

from llmc.runtime.parallel.launch import ShardedModelRunner
from llmc.runtime.parallel.stage_groups import join_stage_groups


class PipelineModelRunner(ShardedModelRunner):
    """Rank 0's (stage 0's) runner of a pipeline-parallel artifact, its followers started here."""

    worker = "llmc.runtime.parallel.pipeline_worker"

    def __init__(self, path, manifest: dict, executor, cache, threads: int):
        parallel = manifest["parallel"]
        self.pp, self.stage_tp = parallel["pp"], parallel.get("tp", 1)
        # the group is tp ranks per stage (rank = stage * tp + tp_rank); the base runner sizes it by "tp";
        # no ring attention: the stages hold different layers
        super().__init__(path, dict(manifest, parallel=dict(parallel, tp=self.pp * self.stage_tp)), executor, cache,
                         threads, ring_threshold=0)
        try:
            join_stage_groups(self.stage_tp, self.pp, self.timeout)
        except BaseException:
            self._ranks.stop(graceful=False)
            raise

    def _worker_args(self) -> dict:
        return {"tp": self.stage_tp, "batch-invariant": int(self.executor.batch_invariant),
                "q4-activations": self.executor.q4_activations}

    def _rank_name(self, rank: int) -> str:
        return f"pipeline stage {rank // self.stage_tp} (rank {rank})"

    def _links(self) -> str:
        return f"a send/recv between the {self.pp} pipeline stages"


__all__ = ["PipelineModelRunner"]
