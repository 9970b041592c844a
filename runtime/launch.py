"""Serve a sharded artifact (--tp, --pp or both) on ranks that torchrun (or any launcher setting
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) started, on one machine or several:

    torchrun --nnodes 1 --nproc-per-node 3 -m llmc.runtime.launch smol-tp3.llmc --prompt "Hello"

    # two machines, four ranks each (a --tp 4 --pp 2 artifact, at the same path on both):
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        -m llmc.runtime.launch m.llmc --prompt "Hello"          # on HOST0; --node-rank 1 on the other

Every rank joins the process group by env rendezvous (with pipeline stages, also its stage's group):
gloo on the CPU, NCCL when the ranks run on GPUs (a GPU target's artifact; one GPU a rank, LOCAL_RANK).
Rank 0 loads the engine, schedules, samples and prints each prompt's completion; the others load
their own plan and weights and run their part of each step (steps.follow_step: their plan, or their
pipeline stage) that rank 0 broadcasts on a second gloo group (its messages: setup, step, report,
stop). The groups' collectives time out after LLMC_COLLECTIVE_TIMEOUT seconds; a rank that dies
fails its peers' next collective or send/recv, and each rank then exits with one error line (torchrun
stops the rest). `llmc run` starts the ranks of one machine itself; this entry is for rendezvous
across machines."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import llmc
from llmc.compiler.artifact import read_manifest
from llmc.errors import LlmcError, RuntimeLlmcError
from llmc.runtime.device import resolve_device
from llmc.runtime.parallel import launch as parallel_launch
from llmc.runtime.parallel import worker
from llmc.runtime.parallel.group import STOP, collective_timeout, process_group_backend, rank_device
from llmc.runtime.parallel.lead import LeadRunner
from llmc.runtime.parallel.ring_attention import ring_backend, ring_threshold
from llmc.runtime.parallel.stage_groups import join_stage_groups
from llmc.runtime.parallel.steps import follow_step, lead_step
from llmc.runtime.parallel.worker import load_rank
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.threads import apply_threads

SETUP = 3                   # rank 0's first message: the KV cache's blocks and block size, the ring threshold
WAIT_TIMEOUT_S = 3600.0     # a follower waits this long for rank 0's next message (rank 0 may be loading)
RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def broadcast_message(control, kind: int, payload: torch.Tensor | None = None) -> None:
    """Rank 0: tell every follower what comes next (kind and an int64 payload)."""
    size = 0 if payload is None else payload.numel()
    dist.broadcast(torch.tensor([kind, size], dtype=torch.int64), 0, group=control)
    if size:
        dist.broadcast(payload.to(torch.int64), 0, group=control)


def receive_message(control) -> tuple[int, torch.Tensor | None]:
    header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, 0, group=control)
    kind, size = header.tolist()
    if not size:
        return kind, None
    payload = torch.zeros(size, dtype=torch.int64)
    dist.broadcast(payload, 0, group=control)
    return kind, payload


class TorchrunRunner(LeadRunner):
    """Rank 0's runner when torchrun started every rank (see launch.ShardedModelRunner)."""

    def __init__(self, control, manifest: dict, executor, cache, threshold: int):
        self.control, self.world, self.stopped = control, dist.get_world_size(), False
        self.timeout = collective_timeout()
        attention = ring_backend(executor.paged_backend(cache), manifest, threshold, self.timeout)
        self.step = lead_step(manifest["parallel"], executor, cache, attention)
        setup = torch.tensor([cache.k_cache[0].shape[0], cache.block_size, threshold])
        self._collective(lambda: (broadcast_message(control, SETUP, setup), dist.barrier(group=control)))

    def tell(self, kind: int, payload: torch.Tensor | None = None) -> None:
        broadcast_message(self.control, kind, payload)

    def _collective(self, work):
        if self.stopped:
            raise RuntimeLlmcError(f"the {self.world} torchrun ranks stopped after a failed collective")
        try:
            return work()
        except RuntimeError as e:  # a collective failed (a rank exited) or timed out (a rank hung)
            self.stopped = True
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RuntimeLlmcError(f"a collective across the {self.world} torchrun ranks failed or timed out "
                                   f"(limit {self.timeout:g} s, {first[:160]}); a rank exited or hung, the run "
                                   f"stopped") from None

    def close(self) -> None:
        if not self.stopped:
            self.stopped = True
            try:
                broadcast_message(self.control, STOP)
            except RuntimeError:  # a follower already gone: nothing to stop
                pass


def follow(control, path: str, rank: int, parallel: dict, timeout: float, device: torch.device) -> None:
    """A follower: load this rank's part once rank 0 says the cache size, then run its steps."""
    kind, setup = receive_message(control)
    if kind != SETUP:
        return
    blocks, block_size, threshold = setup.tolist()
    executor, cache, attention = load_rank(path, rank, blocks, block_size, threshold, timeout, device.type,
                                           device.index or 0)
    dist.barrier(group=control)
    worker.follow(lambda: receive_message(control), follow_step(parallel, executor, cache, attention))


def lead(control, args, device: torch.device) -> None:
    """Rank 0: the engine, whose runner drives the followers; each completion printed."""
    threshold = ring_threshold(args.ring_attention_threshold)

    def runner(manifest, executor, cache):
        return TorchrunRunner(control, manifest, executor, cache, threshold)

    parallel_launch.joined_runner = runner
    model = llmc.load(args.artifact, device=device.type, threads=args.threads, kv_memory=args.kv_memory)
    print(f"llmc.runtime.launch: {dist.get_world_size()} ranks ready", file=sys.stderr, flush=True)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
        for prompt, out in zip(args.prompt, model.generate(args.prompt, params)):
            completion = out.outputs[0]
            if args.json:
                print(json.dumps({"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids}))
            else:
                print(completion.text)
            sys.stdout.flush()
    finally:
        model.close()


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="torchrun ... -m llmc.runtime.launch",
                                     description="serve a sharded (--tp/--pp) llmc artifact on torchrun's ranks")
    parser.add_argument("artifact")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each rank")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="where the ranks run (default: where the "
                        "artifact's target runs): over NCCL on CUDA, one GPU a rank (LOCAL_RANK), else over gloo")
    parser.add_argument("--kv-memory", default="256MiB", help="rank 0's KV cache budget (the followers match it)")
    parser.add_argument("--ring-attention-threshold", type=int, metavar="TOKENS",
                        help="prefills of this many tokens or more run ring attention across the ranks (0: never; "
                             "default LLMC_RING_ATTENTION_THRESHOLD, else 4096); rank 0's value holds for all")
    parser.add_argument("--json", action="store_true", help="one JSON line per prompt: prompt, text, token_ids")
    return parser.parse_args(argv)


def rendezvous_env() -> tuple[int, int]:
    """(rank, world size) that torchrun set."""
    missing = [name for name in RENDEZVOUS_ENV if not os.environ.get(name)]
    if missing:
        raise RuntimeLlmcError(f"llmc.runtime.launch: {', '.join(missing)} not set; start it with torchrun "
                               f"(torchrun --nproc-per-node N -m llmc.runtime.launch ART ...) or set them")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def artifact_layout(path: str, manifest: dict, world: int) -> dict:
    """The artifact's manifest["parallel"], its ranks (tp x pp) exactly `world`."""
    parallel = manifest.get("parallel")
    if not parallel:
        raise RuntimeLlmcError(f"artifact '{path}' is not sharded; this entry serves --tp/--pp artifacts; use "
                               f"`llmc run` for it")
    ranks = parallel.get("tp", 1) * parallel.get("pp", 1)
    if ranks != world:
        raise RuntimeLlmcError(f"artifact '{path}' has {ranks} ranks but torchrun started {world}; "
                               f"make --nnodes x --nproc-per-node = {ranks}")
    return parallel


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_threads(args.threads)
    rank = os.environ.get("RANK", "?")
    try:
        rank, world = rendezvous_env()
        manifest = read_manifest(Path(args.artifact))
        parallel = artifact_layout(args.artifact, manifest, world)
        device = rank_device(resolve_device(manifest, args.device, args.artifact),
                             int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(process_group_backend(device), init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout()))
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=WAIT_TIMEOUT_S))
        if parallel.get("pp", 1) > 1:  # each stage's tp ranks run their collectives in a group of their own
            join_stage_groups(parallel.get("tp", 1), parallel["pp"], collective_timeout())
        if rank == 0:
            lead(control, args, device)
        else:
            follow(control, args.artifact, rank, parallel, collective_timeout(), device)
    except LlmcError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:  # a follower's collective failed: a rank exited or hung
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"error: rank {rank}: a collective failed or timed out ({first[:160]}); a rank exited or hung, "
              f"this rank stopped", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # at once: no goodbye collective with ranks that may be gone
