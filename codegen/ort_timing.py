"""`--kernels auto`: time each kind of plan segment on the compiling machine, as its torch kernels
and as its ONNX Runtime session, at the plan's shapes (a decode step of one token and a prefill of
PREFILL_TOKENS), and keep the faster of the two among those whose outputs match torch's
(AUTO_TOLERANCE). Segments of the same ops at the same shapes (a model's layers) are timed once.
The cost compared is one request's: a PREFILL_TOKENS prefill plus as many decode steps. Timings are
minima over interleaved repeats, so a busy machine biases neither side."""

from __future__ import annotations

import json
import re
import time

import torch

from llmc.codegen.cpu_kernels import RopeCache, resolve_kernel
from llmc.compiler.ir import Graph, eval_dim
from llmc.compiler.ops import TORCH_DTYPES

PREFILL_TOKENS = 128
REPEATS = {"decode": 15, "prefill": 3}
# auto never trades accuracy for speed: ORT is eligible only where its outputs equal torch's up to
# float reassociation (MatMulNBits' int8 activations, ~1e-2, are an explicit --kernels ort choice)
AUTO_TOLERANCE = 1e-4


def signature(graph: Graph, seg) -> str:
    """Equal for segments that run the same ops on values of the same types (a model's layers)."""
    types = graph.types()
    return json.dumps([[n.op, {k: v for k, v in n.attrs.items() if k != "layer"},
                        [str(types[i]) for i in n.inputs]] for n in seg.nodes], sort_keys=True, default=str)


def sample_inputs(graph: Graph, names: list[str], tokens: int) -> list[torch.Tensor]:
    """Random activations of the segment's inputs for a batch of `tokens` tokens of one sequence
    (one logits row); index inputs are zeros, a valid row of any table."""
    out = []
    for name in names:
        t = graph.type_of(name)
        binding = {s: tokens if s == "tokens" else 1 for d in t.shape if isinstance(d, str)
                   for s in re.findall(r"[A-Za-z_]\w*", d)}
        shape = [eval_dim(d, binding) for d in t.shape]
        dtype = TORCH_DTYPES[t.dtype]
        out.append(torch.randn(shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype))
    return out


class TorchSegment:
    """The segment's nodes run as the cpu plan runs them (kernels with their load-time packing)."""

    def __init__(self, graph: Graph, seg):
        self.seg = seg
        self.launches = []
        for node in seg.nodes:
            fn = resolve_kernel(f"cpu.{node.op}")
            attrs = dict(node.attrs)
            if getattr(fn, "prepare", None) is not None:
                params = [graph.weights.get(i) for i in node.inputs]
                attrs.update(fn.prepare(params, attrs))
            self.launches.append((node, fn, attrs))
        self.weights = graph.weights

    @torch.inference_mode()
    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        values = dict(zip(self.seg.inputs, inputs))
        context = {"rope_cache": RopeCache()}
        for node, fn, attrs in self.launches:
            args = [values[i] if i in values else self.weights[i] for i in node.inputs]
            extra = {c: context[c] for c in getattr(fn, "context", ())}
            for v, t in zip(node.outputs, fn(*args, **attrs, **extra)):
                values[v.name] = t
        return [values[o] for o in self.seg.outputs]


def _time(fn, inputs) -> float:
    start = time.perf_counter()
    fn(*inputs)
    return (time.perf_counter() - start) * 1e6


def measure(runners: dict, graph: Graph, seg) -> dict[str, dict[str, float]]:
    """Microseconds per call of each runner, at decode and prefill shapes."""
    us = {name: {} for name in runners}
    for shape, tokens in (("decode", 1), ("prefill", PREFILL_TOKENS)):
        inputs = sample_inputs(graph, seg.inputs, tokens)
        for run in runners.values():
            run(*inputs)        # warm: first calls allocate and pack
        best = {name: float("inf") for name in runners}
        for _ in range(REPEATS[shape]):
            for name, run in runners.items():
                best[name] = min(best[name], _time(run, inputs))
        for name in runners:
            us[name][shape] = round(best[name], 1)
    return us


def request_cost(us: dict[str, float]) -> float:
    return us["prefill"] + PREFILL_TOKENS * us["decode"]


def choose_segments(graph: Graph, segments: list, built: list, echo=None) -> tuple[list[bool], dict]:
    """Whether each segment runs in ORT, and the record of what was measured (plan.meta)."""
    from llmc.codegen.ort_lowering import segment_ops
    from llmc.runtime.ort_segment import cpu_kernel_ops
    from llmc.runtime.threads import resolve_threads

    threads = resolve_threads()
    have = cpu_kernel_ops()
    kinds: dict[str, dict] = {}
    chosen = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seg, (model, builder) in zip(segments, built):
            key = signature(graph, seg)
            if key not in kinds:
                kinds[key] = _measure_kind(graph, seg, model, builder, threads, have, segment_ops(model))
            kinds[key]["segments"] += 1
            chosen.append(kinds[key]["chosen"] == "ort")
    finally:
        torch.set_num_threads(previous)
    record = {"threads": threads, "tokens": {"decode": 1, "prefill": PREFILL_TOKENS},
              "cost": f"prefill + {PREFILL_TOKENS} x decode", "kinds": list(kinds.values())}
    return chosen, record


def _measure_kind(graph: Graph, seg, model: bytes, builder, threads: int, have: set, ops: set) -> dict:
    from llmc.runtime.ort_segment import OrtSegment

    entry = {"first": seg.span, "ops": _op_counts(seg), "segments": 0}
    missing = sorted(ops - have)
    if missing:
        return {**entry, "chosen": "cpu", "why": f"onnxruntime lacks {'.'.join(missing[0]).lstrip('.')}"}
    io = lambda names: [(n, graph.type_of(n)) for n in names]
    ort = OrtSegment(model, builder.values, io(seg.inputs), io(seg.outputs), threads, f"segment {seg.span}")
    torch_segment = TorchSegment(graph, seg)
    us = measure({"cpu": torch_segment, "ort": ort}, graph, seg)
    difference = output_difference(torch_segment, ort, graph, seg)
    entry.update(us=us, ort_vs_cpu=difference)
    if difference > AUTO_TOLERANCE:
        return {**entry, "chosen": "cpu", "why": f"ORT's outputs differ from torch's by {difference:.1e} of the "
                                                 f"largest (over {AUTO_TOLERANCE:.0e}): it would change the numbers"}
    return {**entry, "chosen": min(us, key=lambda name: request_cost(us[name]))}


def output_difference(cpu, ort, graph: Graph, seg) -> float:
    """The largest |ort - cpu| over the segment's outputs at prefill shapes, relative to the largest
    |cpu| output (MatMulNBits rounds activations to int8 per block where torch's kernels keep bf16)."""
    inputs = sample_inputs(graph, seg.inputs, PREFILL_TOKENS)
    pairs = [(a.float(), b.float()) for a, b in zip(ort(*inputs), cpu(*inputs)) if b.dtype.is_floating_point]
    scale = max((b.abs().max().item() for _, b in pairs), default=0.0) or 1.0
    return round(max(((a - b).abs().max().item() for a, b in pairs), default=0.0) / scale, 6)


def _op_counts(seg) -> str:
    counts: dict[str, int] = {}
    for n in seg.nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    return ", ".join(f"{op} {c}" if c > 1 else op for op, c in counts.items())


__all__ = ["choose_segments", "signature", "measure", "TorchSegment", "PREFILL_TOKENS", "request_cost"]
