"""A follower rank: loads its own plan, weights and KV cache, joins the ranks' group, and runs each
step rank 0 sends down its stdin until told to stop. launch.py starts it as `python -m
llmc.runtime.parallel.worker`; it says on stdout, in one JSON line, whether it loaded, and it exits
when its stdin closes (rank 0's process ended) or a collective fails, so no rank outlives the engine."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from llmc.compiler.artifact import read_artifact
from llmc.compiler.ops import TORCH_DTYPES
from llmc.errors import LlmcError, RuntimeLlmcError
from llmc.runtime.batch_invariance import compiled_mode
from llmc.runtime.device import resolve_device
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.kernel_check import verified_plan
from llmc.runtime.kv_quant import is_quantized_kv
from llmc.runtime.paged_attention import PagedKVCache
from llmc.runtime.parallel.group import (
    REPORT,
    STOP,
    gather_stats,
    join_group,
    process_group_backend,
    rank_device,
    receive,
)
from llmc.runtime.parallel.ring_attention import ring_backend
from llmc.runtime.parallel.step_batch import StepBatch
from llmc.runtime.parallel.steps import follow_step
from llmc.runtime.threads import apply_threads


def load_rank(path: str, rank: int, num_blocks: int, block_size: int, ring_threshold: int = 0,
              timeout: float = 60.0, device: str = "cpu", local_rank: int = 0, batch_invariant: bool | None = None,
              q4_activations: str | None = None):
    """(executor, cache, attention backend) of rank `rank`: its plan and weights only, on `device`
    ("cuda": this machine's GPU `local_rank`); prefills of `ring_threshold` tokens or more run ring
    attention (0: never); `batch_invariant` and `q4_activations` as rank 0 runs (None: the artifact's)."""
    art = read_artifact(path, rank=rank)
    # first: a GPU artifact run on the CPU must choose Triton's interpreter before triton loads
    where = rank_device(resolve_device(art.manifest, device, path), local_rank)
    model = art.manifest["model"]
    dtype = TORCH_DTYPES[model["kv_cache"]["dtype"]]
    if is_quantized_kv(dtype):
        raise RuntimeLlmcError(f"artifact '{path}': a sharded (--tp, --pp) rank cannot serve a quantised KV cache; "
                               f"recompile with --kv-cache none")
    plan = verified_plan(art)
    # rank 0's batch-invariance mode (runtime/batch_invariance.py): a rank rounding otherwise, or not ringing
    # where rank 0 rings, would part from it
    executor = PlanExecutor(plan, art.weights, where,
                            batch_invariant=compiled_mode(plan) if batch_invariant is None else batch_invariant,
                            q4_activations=q4_activations)
    cache = PagedKVCache(model["num_layers"], num_blocks, block_size, model["num_kv_heads"], model["head_dim"], dtype,
                         device=where)
    attention = ring_backend(executor.paged_backend(cache), art.manifest, ring_threshold, timeout)
    return executor, cache, attention


@torch.inference_mode()
def follow(next_message, run_step) -> None:
    """Runs rank 0's steps as they arrive (`next_message()` gives (kind, payload), `run_step(batch)`
    runs one) until it says stop."""
    while True:
        kind, payload = next_message()
        if kind == STOP:
            return
        if kind == REPORT:
            gather_stats()
            continue
        run_step(StepBatch.decode(payload))


def say(**message) -> None:
    print(json.dumps(message), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmc.runtime.parallel.worker")
    for name in ("rank", "world", "port", "blocks", "block-size", "threads"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--ring-threshold", type=int, default=0)
    parser.add_argument("--batch-invariant", type=int, choices=(0, 1), default=None)
    parser.add_argument("--q4-activations", choices=("int8", "int16"), default=None)   # rank 0's
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("artifact")
    args = parser.parse_args(argv)
    apply_threads(args.threads)

    def join(executor, cache, attention):
        join_group(args.rank, args.world, args.port, args.timeout, process_group_backend(executor.device))
        return follow_step({"tp": args.world}, executor, cache, attention)
    invariant = None if args.batch_invariant is None else bool(args.batch_invariant)
    return serve(lambda: load_rank(args.artifact, args.rank, args.blocks, args.block_size, args.ring_threshold,
                                   args.timeout, args.device, args.rank, invariant, args.q4_activations), join)


def serve(load, join) -> int:
    """A follower's life: `load()` its rank (saying on stdout whether it did), `join(*loaded)` the
    groups, which returns the step to run, then follow rank 0 until it stops."""
    try:
        loaded = load()
    except LlmcError as e:
        say(error=str(e))
        return 2
    say(loaded=True)
    try:
        follow(lambda: receive(sys.stdin.buffer), join(*loaded))
    except RuntimeError:  # rank 0 stopped, or a rank died: rank 0 reports it, this one just ends
        os._exit(1)
    return 0  # the group goes with the process (rank 0 may already be gone: no goodbye collective)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # at once: nothing of this process (a half-torn-down group) is worth tidying
