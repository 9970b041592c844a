"""Where one decode step's wall time goes: runs batch-B decode on an artifact and prints the
per-step split (scheduler / metadata / plan walk or decode graph / sample / rest; the native decode
program's share of the walk) and, with --by-kernel, the walk's time per kernel outside the program.
Usage: python bench/decode_step.py ART [-b 1] [--steps 64]."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

# isort: off
import llmc  # noqa: F401 (before torch, so that its tensors go on huge pages as under the CLI)
import torch
# isort: on

from llmc.codegen.native import cpu_native
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.native_decode import OP_KINDS, OP_NAMES
from llmc.runtime.sampling_params import SamplingParams


def _timed(obj, name: str, bucket: str, totals: dict) -> None:
    """Wrap obj.name so its wall time adds up in totals[bucket]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[bucket] += time.perf_counter() - t0
    setattr(obj, name, wrapper)


def _time_kernels(executor, totals: dict) -> None:
    """Replace each launch's kernel with a timed one (its attributes kept: context, prepare)."""
    def timed(fn, key):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            totals[key] += time.perf_counter() - t0
            return out
        run.context = getattr(fn, "context", ())
        return run
    executor._program = [launch._replace(fn=timed(launch.fn, executor.plan.steps[i].kernel))
                         for i, launch in enumerate(executor._program)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("artifact")
    ap.add_argument("-b", "--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    ap.add_argument("--by-kernel", action="store_true", help="also split the plan walk per kernel")
    ap.add_argument("--no-decode-graph", action="store_true",
                    help="walk the plan on decode steps too (the artifact's decode graph unused), for an A/B")
    ap.add_argument("--no-native-program", action="store_true",
                    help="walk every launch on decode steps (the native decode program unused), for an A/B")
    ap.add_argument("--fp32-activations", action="store_true",
                    help="native 4-bit / int8 GEMVs on fp32 activations instead of int16 codes, for an A/B")
    ap.add_argument("--q4-activations", choices=cpu_native.Q4_ACTIVATIONS, default=None,
                    help="how the 4-bit GEMVs round activations (default: the artifact's)")
    ap.add_argument("--kv-memory", default="1GiB", help="KV cache budget; every sequence must fit to its last step")
    args = ap.parse_args()
    engine = Engine(args.artifact, EngineConfig(kv_memory=args.kv_memory, seed=0, q4_activations=args.q4_activations))
    if args.no_decode_graph:
        engine.executor.decode_graph = None
    if args.no_native_program:
        engine.executor.native_decode = None
    if args.fp32_activations:
        cpu_native.set_int16_activations(False)
    if args.threads:   # after the engine, which applies its own thread count
        torch.set_num_threads(args.threads)
    vocab = engine.model["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, temperature=0.0)
    for _ in range(args.batch):
        ids = torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()
        engine.add_request(prompt_token_ids=ids, params=params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(
            engine.scheduler.waiting)):
        engine.step()  # prefill (untimed)
    totals: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    _timed(engine.scheduler, "schedule", "scheduler", totals)
    _timed(engine.scheduler, "postprocess", "scheduler", totals)
    _timed(engine.runner, "execute", "runner", totals)
    _timed(engine.executor, "run_values", "plan", totals)
    _timed(engine.sampler, "sample", "sample", totals)
    if engine.executor.decode_graph is not None:   # its ORT run (the cache write after it counts as metadata)
        _timed(engine.executor.decode_graph, "session", "graph", totals)
    if engine.executor.native_decode is not None:   # the layers it runs as one native call (within "plan")
        _timed(engine.executor.native_decode, "run", "program", totals)
    if args.by_kernel:
        _time_kernels(engine.executor, kernels)
    engine.step()  # warm-up decode
    if len(engine.scheduler.running) != args.batch:   # a tight cache would time a smaller batch unawares
        raise SystemExit(f"only {len(engine.scheduler.running)} of {args.batch} sequences run in "
                         f"--kv-memory {args.kv_memory}; give a larger one")
    totals.clear()
    kernels.clear()
    if args.by_kernel and engine.executor.native_decode is not None:   # each op's time, from here on
        engine.executor.native_decode.op_seconds = torch.zeros(OP_KINDS, dtype=torch.float64)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - t0
    split = {"scheduler": totals["scheduler"], "metadata": totals["runner"] - totals["plan"] - totals["graph"],
             "plan": totals["plan"], "graph": totals["graph"], "sample": totals["sample"]}
    split["rest"] = wall - sum(split.values())
    per = 1e3 / args.steps
    print(f"batch {args.batch}, {args.steps} decode steps, {torch.get_num_threads()} threads: "
          f"{wall * per:.2f} ms/step, {args.batch * args.steps / wall:.1f} tok/s")
    for name, s in split.items():
        print(f"  {name:<10} {s * per:8.3f} ms/step  {100 * s / wall:5.1f}%")
    if totals["program"]:
        print(f"  of the plan, the native decode program {totals['program'] * per:.3f} ms/step "
              f"(steps {engine.executor.native_decode.start}-{engine.executor.native_decode.end - 1} of "
              f"{len(engine.executor.plan.steps)})")
    if args.by_kernel and engine.executor.native_decode is not None:
        print("native decode program by op:")
        seconds = engine.executor.native_decode.op_seconds.tolist()
        for kind, name in sorted(OP_NAMES.items(), key=lambda kv: -seconds[kv[0]]):
            if seconds[kind]:
                print(f"  {name:<24} {seconds[kind] * per:8.3f} ms/step")
    if args.by_kernel:
        print("plan walk by kernel, outside the native decode program (timing wrappers add a little):")
        for name, s in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<24} {s * per:8.3f} ms/step")


if __name__ == "__main__":
    main()
