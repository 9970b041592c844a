"""`--kernels auto`'s whole decode steps. For the decode graph (codegen/ort/ort_decode.py): on a close call
(its segments alone cost a little more in ORT than the plan walk runs them, and what the graph saves
besides decides), and wherever the walk runs the native decode program (runtime/native_decode.py),
whose saving the per-segment timings cannot see. And the unlowered cpu plan, walked with that program,
against the lowered one (ort_plan_choice.py). One decode step over a paged cache of CONTEXT
tokens is timed each way, interleaved, minimum of REPEATS (with each way's spread, best to median);
what was measured is kept per machine (ort_timing_cache.py), unless the machine was busy or
the ways' ranges overlap: those timings decide nothing (doubt())."""

from __future__ import annotations

import hashlib
import time

import torch

from llmc.cache import pick, spread
from llmc.codegen.native.cpu_native import timing_key as native_key
from llmc.codegen.ort.ort_decode import DECODE_FILE
from llmc.compiler.driver.tuning.ort_timing_cache import Timings, recall_measured
from llmc.compiler.ir import Graph
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.ort_decode import DecodeGraph
from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata
from llmc.runtime.threads import resolve_threads

CONTEXT = 128         # cached tokens the timed decode step attends to
BLOCK = 16
REPEATS = 7


def _plan_hash(plan) -> str:
    return hashlib.sha256(repr([(s.kernel, s.inputs, s.outputs) for s in plan.steps]).encode()).hexdigest()


def measure_decode_step(graph: Graph, plan, files: dict[str, bytes], model: bytes, record: dict) -> dict:
    """{"plan": us, "graph": us, "launches": us} for one decode step of `plan` (its ORT segments in
    `files`) walked (with the native decode program where it runs), through the decode graph `model`,
    and walked launch by launch (as steps the program does not take run)."""
    key = {"what": "decode step: walk, graph, launches", "onnx": hashlib.sha256(model).hexdigest(),
           "segments": sorted(hashlib.sha256(b).hexdigest() for b in files.values()), "plan": _plan_hash(plan)}
    return _recalled(key, graph, {"plan": (plan, files, None), "graph": (plan, files, (model, record)),
                                  "launches": (plan, files, None, False)})


def measure_plans(graph: Graph, candidates: dict[str, tuple]) -> dict:
    """{name: us} for one decode step of each candidate (plan, files, (decode model, record) or None: walked,
    and optionally False: walked launch by launch, without the native decode program)."""
    key = {"what": "decode steps", "plans": {name: [_plan_hash(c[0]), sorted(hashlib.sha256(b).hexdigest()
                                                                         for b in c[1].values()),
                                                    None if c[2] is None else hashlib.sha256(c[2][0]).hexdigest(),
                                                    *c[3:]]
                                             for name, c in candidates.items()}}
    return _recalled(key, graph, candidates)


# the order a close call falls back in: the default first
DEFAULTS = ("cpu", "plan", "walk", "graph")


def _recalled(key: dict, graph: Graph, candidates: dict[str, tuple]) -> dict:
    threads = resolve_threads()
    key = {**key, "threads": threads, "context": CONTEXT, "repeats": REPEATS, "native": native_key()}
    value, measured = recall_measured(key, lambda: _measure(graph, candidates, threads), _close_call)
    return Timings(value["us"], value["spread"], measured)


def step_ranges(timings, names) -> dict[str, tuple[float, float]]:
    """{name: (best us, median us)} of a decode step each way, from a Timings (a bare dict: no spread)."""
    spreads = getattr(timings, "spread", {})
    return {name: (timings[name], timings[name] * (1 + spreads.get(name, 0.0))) for name in names}


def _close_call(value: dict) -> str | None:
    names = [name for name in value["us"] if name != "launches"]
    return pick(step_ranges(Timings(value["us"], value["spread"]), names), DEFAULTS)[1]


def doubt(timings, *names: str) -> str | None:
    """Why `timings` (measure_decode_step's or measure_plans') may not choose among `names` (the
    default first), or None: measured on a busy machine, or the fastest's range overlaps an earlier one's."""
    measured = getattr(timings, "measured", {})
    if measured.get("busy"):
        return f"measured on a busy machine ({measured['busy']})"
    return pick(step_ranges(timings, names), names)[1]


class _Primed:
    """An executor of `plan` whose own paged cache holds CONTEXT tokens of a prefill, and one decode step's
    inputs and metadata (each run writes the same cache slot with the same key and value)."""

    def __init__(self, graph: Graph, plan, data: dict[str, bytes]):
        self.executor = executor = PlanExecutor(plan, graph.weights, data=data)
        layout, context = plan.kv_layout(), _context(graph)
        blocks = context // BLOCK + 1
        self.cache = PagedKVCache(layout["num_layers"], blocks, BLOCK, layout["num_kv_heads"], layout["head_dim"])
        table = list(range(blocks))
        ids = torch.randint(0, _vocab(graph), (context + 1,), generator=torch.Generator().manual_seed(context))
        feed = lambda **values: {k: t for k, t in values.items() if k in plan.inputs}
        self.backend = PagedAttention(self.cache)
        for start in range(0, context, plan.max_tokens):   # the prefill in chunks the plan takes
            end = min(start + plan.max_tokens, context)
            self.backend.metadata = StepMetadata.build([(table, start, end - start)], BLOCK)
            executor.run_values(feed(input_ids=ids[start:end], positions=torch.arange(start, end),
                                     logits_indices=torch.tensor([end - start - 1])), self.backend)
        self.meta = StepMetadata.build([(table, context, 1)], BLOCK)
        self.inputs = feed(input_ids=ids[context:], positions=torch.tensor([context]),
                           logits_indices=torch.tensor([0]))
        self.program = executor.native_decode

    def walk(self, native: bool):
        def run():
            self.backend.metadata = self.meta   # reused: a fresh StepMetadata would cache nothing across steps
            self.executor.native_decode = self.program if native else None
            return self.executor.run_values(self.inputs, self.backend)
        return run


def _runner(graph: Graph, primed: dict, plan, files: dict[str, bytes], decode: tuple | None, native: bool = True):
    """A function running one decode step of `plan`: through the decode graph `decode` when given, else
    walked (with the native decode program unless `native` is False); `primed` shares one executor and
    cache among the candidates of a plan."""
    key = (id(plan), id(files))
    if key not in primed:
        primed[key] = _Primed(graph, plan, files)
    p = primed[key]
    if decode is None:
        return p.walk(native)
    decode_graph = DecodeGraph({**decode[1], "chosen": True}, plan, {**files, DECODE_FILE: decode[0]}, graph.weights)
    return lambda: decode_graph(p.inputs, p.meta, p.cache)


def _context(graph: Graph) -> int:
    """CONTEXT, or fewer where a learned position table is short (an embedding not of the input ids: a
    tiny OPT's 130 rows, read at position + 2)."""
    tables = [graph.weights[node.inputs[1]].shape[0] for node in graph.nodes
              if node.op in ("embedding", "qembedding") and node.inputs[0] != "input_ids"]
    return min([CONTEXT] + [rows // 2 for rows in tables])


def _vocab(graph: Graph) -> int:
    """Token ids below this index every embedding table (an output's width need not: OPT's is the model's):
    the rows of the tables input_ids index, or where no node takes them directly (an imported ONNX
    graph's gather behind a cast) of the smallest matrix."""
    sizes = [graph.weights[i].shape[0] for node in graph.nodes if "input_ids" in node.inputs
             for i in node.inputs if i in graph.weights]
    return min(sizes or [p.type.shape[0] for name, p in graph.params.items()
                         if name in graph.weights and p.type.rank == 2])


def _measure(graph: Graph, candidates: dict[str, tuple], threads: int) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        primed: dict = {}
        runners = {name: _runner(graph, primed, *candidate) for name, candidate in candidates.items()}
        for run in runners.values():
            run()    # warm: first runs allocate and pack
        samples: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(REPEATS):
            for name, run in runners.items():
                start = time.perf_counter()
                run()
                samples[name].append((time.perf_counter() - start) * 1e6)
    finally:
        torch.set_num_threads(previous)
    return {"us": {name: round(min(s), 1) for name, s in samples.items()},
            "spread": {name: spread(s) for name, s in samples.items()}}


__all__ = ["measure_decode_step", "measure_plans", "doubt", "step_ranges", "CONTEXT", "DEFAULTS"]
