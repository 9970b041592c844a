"""A follower rank: loads its own plan, weights and KV cache, joins the ranks' group, and runs each
step rank 0 broadcasts until told to stop. launch.py starts it as `python -m
llmc.runtime.parallel.worker`; it says on stdout, in one JSON line, whether it loaded, and it exits
as soon as its lifeline (stdin, held by rank 0's process) closes, so no rank outlives the engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch

from llmc.compiler.artifact import read_artifact
from llmc.compiler.ops import TORCH_DTYPES
from llmc.errors import LlmcError, RuntimeLlmcError
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.kernel_check import verified_plan
from llmc.runtime.kv_quant import is_quantized_kv
from llmc.runtime.paged_attention import PagedKVCache
from llmc.runtime.parallel.group import REPORT, STOP, gather_stats, join_group, leave_group, receive
from llmc.runtime.parallel.step_batch import StepBatch
from llmc.runtime.threads import apply_threads


def load_rank(path: str, rank: int, num_blocks: int, block_size: int):
    """(executor, cache, attention backend) of rank `rank`: its plan and weights only."""
    art = read_artifact(path, rank=rank)
    model = art.manifest["model"]
    dtype = TORCH_DTYPES[model["kv_cache"]["dtype"]]
    if is_quantized_kv(dtype):
        raise RuntimeLlmcError(f"artifact '{path}': a tensor-parallel rank cannot serve a quantised KV cache; "
                               f"recompile with --kv-cache none")
    executor = PlanExecutor(verified_plan(art), art.weights, "cpu")
    cache = PagedKVCache(model["num_layers"], num_blocks, block_size, model["num_kv_heads"], model["head_dim"], dtype)
    return executor, cache, executor.paged_backend(cache)


@torch.inference_mode()
def follow(control, executor, cache, attention) -> None:
    while True:
        kind, payload = receive(control)
        if kind == STOP:
            return
        if kind == REPORT:
            gather_stats(control)
            continue
        StepBatch.decode(payload).run(executor, cache, attention)


def watch_lifeline() -> None:
    """Exit when stdin closes: rank 0's process ended (or gave up on this rank)."""
    def wait():
        sys.stdin.buffer.read()
        os._exit(0)
    threading.Thread(target=wait, daemon=True).start()


def say(**message) -> None:
    print(json.dumps(message), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmc.runtime.parallel.worker")
    for name in ("rank", "world", "port", "blocks", "block-size", "threads"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("artifact")
    args = parser.parse_args(argv)
    watch_lifeline()
    apply_threads(args.threads)
    try:
        state = load_rank(args.artifact, args.rank, args.blocks, args.block_size)
    except LlmcError as e:
        say(error=str(e))
        return 2
    say(loaded=True)
    try:
        control = join_group(args.rank, args.world, args.port, args.timeout)
        follow(control, *state)
    except RuntimeError:  # rank 0 stopped, or a rank died: rank 0 reports it, this one just ends
        os._exit(1)
    leave_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: the lifeline thread blocks in a read that interpreter shutdown cannot end
