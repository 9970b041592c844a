"""`--kernels auto`'s whole decode steps. For the decode graph (codegen/ort_decode.py): on a close call
(its segments alone cost a little more in ORT than the plan walk runs them, and what the graph saves
besides decides), and wherever the walk runs the native decode program (runtime/native_decode.py),
whose saving the per-segment timings cannot see. And the unlowered cpu plan, walked with that program,
against the lowered one (codegen/ort_plan_choice.py). One decode step over a paged cache of CONTEXT
tokens is timed each way, interleaved, minimum of REPEATS; what was measured is kept per machine
(codegen/ort_timing_cache.py)."""

from __future__ import annotations

import hashlib
import time

import torch

from llmc.compiler.ir import Graph

CONTEXT = 128         # cached tokens the timed decode step attends to
BLOCK = 16
REPEATS = 7


def _plan_hash(plan) -> str:
    return hashlib.sha256(repr([(s.kernel, s.inputs, s.outputs) for s in plan.steps]).encode()).hexdigest()


def measure_decode_step(graph: Graph, plan, files: dict[str, bytes], model: bytes, record: dict) -> dict:
    """{"plan": us, "graph": us} for one decode step of `plan` (its ORT segments in `files`) walked
    and through the decode graph `model`."""
    key = {"what": "decode step", "onnx": hashlib.sha256(model).hexdigest(),
           "segments": sorted(hashlib.sha256(b).hexdigest() for b in files.values()), "plan": _plan_hash(plan)}
    return _recalled(key, graph, {"plan": (plan, files, None), "graph": (plan, files, (model, record))})


def measure_plans(graph: Graph, candidates: dict[str, tuple]) -> dict:
    """{name: us} for one decode step of each candidate (plan, files, (decode model, record) or None: walked)."""
    key = {"what": "decode steps", "plans": {name: [_plan_hash(plan), sorted(hashlib.sha256(b).hexdigest()
                                                                          for b in files.values()),
                                                    None if decode is None else hashlib.sha256(decode[0]).hexdigest()]
                                             for name, (plan, files, decode) in candidates.items()}}
    return _recalled(key, graph, candidates)


def _recalled(key: dict, graph: Graph, candidates: dict[str, tuple]) -> dict:
    from llmc.codegen.cpu_native import timing_key as native_key
    from llmc.codegen.ort_timing_cache import recall
    from llmc.runtime.threads import resolve_threads

    threads = resolve_threads()
    key = {**key, "threads": threads, "context": CONTEXT, "repeats": REPEATS, "native": native_key()}
    return recall(key, lambda: _measure(graph, candidates, threads))


def _stepper(graph: Graph, plan, files: dict[str, bytes], decode: tuple | None):
    """A function running one decode step of `plan` (through the decode graph `decode`, when given) over
    its own paged cache, which holds CONTEXT tokens of a prefill already."""
    from llmc.codegen.ort_decode import DECODE_FILE
    from llmc.runtime.executor import PlanExecutor
    from llmc.runtime.ort_decode import DecodeGraph
    from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata

    data = {**files, **({} if decode is None else {DECODE_FILE: decode[0]})}
    executor = PlanExecutor(plan, graph.weights, data=data)
    layout, context = plan.kv_layout(), _context(graph)
    blocks = context // BLOCK + 1
    cache = PagedKVCache(layout["num_layers"], blocks, BLOCK, layout["num_kv_heads"], layout["head_dim"])
    table = list(range(blocks))
    ids = torch.randint(0, _vocab(graph), (context + 1,), generator=torch.Generator().manual_seed(context))
    feed = lambda **values: {k: t for k, t in values.items() if k in plan.inputs}
    backend = PagedAttention(cache)
    backend.metadata = StepMetadata.build([(table, 0, context)], BLOCK)
    executor.run_values(feed(input_ids=ids[:context], positions=torch.arange(context),
                             logits_indices=torch.tensor([context - 1])), backend)
    meta = StepMetadata.build([(table, context, 1)], BLOCK)
    inputs = feed(input_ids=ids[context:], positions=torch.tensor([context]), logits_indices=torch.tensor([0]))
    if decode is not None:
        decode_graph = DecodeGraph({**decode[1], "chosen": True}, plan, data, graph.weights)
        return lambda: decode_graph(inputs, meta, cache)

    def walk():
        backend.metadata = meta   # a fresh StepMetadata caches nothing across steps; this one is reused
        return executor.run_values(inputs, backend)
    return walk


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
    return min(sizes or [w.shape[0] for w in graph.weights.values() if w.dim() == 2])


def _measure(graph: Graph, candidates: dict[str, tuple], threads: int) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # each run writes the same cache slot with the same key and value
        runners = {name: _stepper(graph, *candidate) for name, candidate in candidates.items()}
        for run in runners.values():
            run()    # warm: first runs allocate and pack
        best = dict.fromkeys(runners, float("inf"))
        for _ in range(REPEATS):
            for name, run in runners.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e6)
    finally:
        torch.set_num_threads(previous)
    return {name: round(us, 1) for name, us in best.items()}


__all__ = ["measure_decode_step", "measure_plans", "CONTEXT"]
