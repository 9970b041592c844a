"""`--kernels auto` on a close call for the decode graph (codegen/ort_decode.py): when its segments
alone cost a little more in ORT than the plan walk runs them, what the graph saves besides (a launch
per segment and attention, and the small torch attentions) decides. So one decode step over a paged
cache of CONTEXT tokens is timed both ways, the lowered plan's walk and the decode graph,
interleaved, minimum of REPEATS; what was measured is kept per machine (codegen/ort_timing_cache.py)."""

from __future__ import annotations

import hashlib
import time

import torch

from llmc.compiler.ir import Graph

CONTEXT = 128         # cached tokens the timed decode step attends to
BLOCK = 16
REPEATS = 7


def measure_decode_step(graph: Graph, plan, files: dict[str, bytes], model: bytes, record: dict) -> dict:
    """{"plan": us, "graph": us} for one decode step of `plan` (its ORT segments in `files`) walked
    and through the decode graph `model`."""
    from llmc.codegen.cpu_native import timing_key as native_key
    from llmc.codegen.ort_timing_cache import recall
    from llmc.runtime.threads import resolve_threads

    threads = resolve_threads()
    key = {"what": "decode step", "onnx": hashlib.sha256(model).hexdigest(), "threads": threads,
           "segments": sorted(hashlib.sha256(b).hexdigest() for b in files.values()),
           "plan": hashlib.sha256(repr([(s.kernel, s.inputs, s.outputs) for s in plan.steps]).encode()).hexdigest(),
           "context": CONTEXT, "repeats": REPEATS, "native": native_key()}   # the walk's kernels
    return recall(key, lambda: _measure(graph, plan, files, model, record, threads))


def _measure(graph: Graph, plan, files: dict[str, bytes], model: bytes, record: dict, threads: int) -> dict:
    from llmc.codegen.ort_decode import DECODE_FILE
    from llmc.runtime.executor import PlanExecutor
    from llmc.runtime.ort_decode import DecodeGraph
    from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = {**files, DECODE_FILE: model}
        executor = PlanExecutor(plan, graph.weights, data=data)
        decode_graph = DecodeGraph({**record, "chosen": True}, plan, data, graph.weights)
        blocks = CONTEXT // BLOCK + 1
        cache = PagedKVCache(record["num_layers"], blocks, BLOCK, record["num_kv_heads"], record["head_dim"])
        table = list(range(blocks))
        vocab = graph.type_of(plan.outputs[0]).shape[-1]
        ids = torch.randint(0, vocab, (CONTEXT + 1,), generator=torch.Generator().manual_seed(CONTEXT))
        feed = lambda **values: {k: t for k, t in values.items() if k in plan.inputs}
        backend = PagedAttention(cache)
        backend.metadata = StepMetadata.build([(table, 0, CONTEXT)], BLOCK)
        executor.run_values(feed(input_ids=ids[:CONTEXT], positions=torch.arange(CONTEXT),
                                 logits_indices=torch.tensor([CONTEXT - 1])), backend)
        backend.metadata = meta = StepMetadata.build([(table, CONTEXT, 1)], BLOCK)
        inputs = feed(input_ids=ids[CONTEXT:], positions=torch.tensor([CONTEXT]), logits_indices=torch.tensor([0]))
        # each run writes the same cache slot with the same key and value
        runners = {"plan": lambda: executor.run_values(inputs, backend),
                   "graph": lambda: decode_graph(inputs, meta, cache)}
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


__all__ = ["measure_decode_step", "CONTEXT"]
