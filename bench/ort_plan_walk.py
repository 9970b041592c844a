"""One forward of an artifact whose plan has ONNX Runtime segments, against the same plan with each
segment's recorded torch steps (same weights, same process, interleaved): ms per forward for a decode
step (1 token) and a prefill (--prefill tokens, logits of the last), and the largest logit difference.
Usage: python bench/ort_plan_walk.py ART [--prefill 512] [--rounds 5]."""

from __future__ import annotations

import argparse
import time

import torch

from llmc.codegen.ort.ort_lowering import torch_plan
from llmc.codegen.plan import Plan
from llmc.compiler.artifact import read_artifact
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.threads import apply_threads, resolve_threads


def inputs(tokens: int, vocab: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, vocab, (tokens,)), "positions": torch.arange(tokens),
            "logits_indices": torch.tensor([tokens - 1])}


def best_ms(executor: PlanExecutor, values: dict, best: float) -> float:
    start = time.perf_counter()
    executor.run_values(values)
    return min(best, (time.perf_counter() - start) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    apply_threads(resolve_threads())
    a = read_artifact(args.artifact)
    plan = Plan.from_json(a.plan_json)
    flat = torch_plan(plan)
    executors = {"ort segments": PlanExecutor(plan, a.weights, data=a.data), "torch": PlanExecutor(flat, a.weights)}
    vocab = a.manifest["model"]["vocab_size"]
    shapes = {"decode": inputs(1, vocab), "prefill": inputs(args.prefill, vocab)}
    times = {(name, shape): float("inf") for name in executors for shape in shapes}
    for _ in range(args.rounds):
        for shape, values in shapes.items():
            for name, executor in executors.items():
                times[name, shape] = best_ms(executor, values, times[name, shape])
    diff = max((executors["ort segments"].run_values(v)["logits"] - executors["torch"].run_values(v)["logits"])
               .abs().max().item() for v in shapes.values())
    segments = sum(s.kernel == "ort.segment" for s in plan.steps)
    print(f"{args.artifact}: {segments} ORT segments, {torch.get_num_threads()} threads, max |logit diff| {diff:.3g}")
    for name in executors:
        print(f"  {name:<13} decode {times[name, 'decode']:8.2f} ms   prefill {args.prefill} "
              f"{times[name, 'prefill']:8.1f} ms")


if __name__ == "__main__":
    main()
