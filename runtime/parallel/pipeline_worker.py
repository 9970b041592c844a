"""A follower pipeline stage: loads its own plan, weights and KV cache (its layers only), joins the
ranks' group, and runs each step rank 0 sends down its stdin through its stage (steps.follow_step)
until told to stop; otherwise as worker.py, whose loading and exit rules it shares."""

from __future__ import annotations

import argparse
import os
import sys

from llmc.runtime.parallel.group import join_group, process_group_backend
from llmc.runtime.parallel.stage_groups import join_stage_groups
from llmc.runtime.parallel.steps import follow_step
from llmc.runtime.parallel.worker import load_rank, serve
from llmc.runtime.threads import apply_threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmc.runtime.parallel.pipeline_worker")
    for name in ("rank", "world", "port", "blocks", "block-size", "threads"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)  # tensor-parallel ranks per stage
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch-invariant", type=int, choices=(0, 1), default=None)   # rank 0's mode
    parser.add_argument("--q4-activations", choices=("int8", "int16"), default=None)   # rank 0's
    parser.add_argument("artifact")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    stages = args.world // args.tp

    def join(executor, cache, attention):  # no ring attention: the stages hold different layers
        join_group(args.rank, args.world, args.port, args.timeout, process_group_backend(executor.device))
        join_stage_groups(args.tp, stages, args.timeout)
        return follow_step({"tp": args.tp, "pp": stages}, executor, cache, attention)
    invariant = None if args.batch_invariant is None else bool(args.batch_invariant)
    return serve(lambda: load_rank(args.artifact, args.rank, args.blocks, args.block_size, device=args.device,
                                   local_rank=args.rank, batch_invariant=invariant,
                                   q4_activations=args.q4_activations), join)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
