"""`--kernels auto` (the cpu target's default): time each kind of plan segment on the compiling
machine, as its torch kernels and as its ONNX Runtime session, at the plan's shapes (a decode step
of one token and a prefill of PREFILL_TOKENS), and keep the faster of those no further from the
reference semantics (compiler/ops.py) than the torch kernels are (or within AUTO_TOLERANCE).
Segments of the same ops at the same shapes (a model's layers) are timed once, and what was
measured is kept per machine (ort_timing_cache.py). The cost compared is one request's: a
PREFILL_TOKENS prefill plus as many decode steps. Timings are minima over interleaved repeats, so a
busy machine biases neither side."""

from __future__ import annotations

import ctypes
import hashlib
import json
import re
import sys
import time

import torch

from llmc.cache import pick, spread
from llmc.codegen.native.cpu_native import timing_key as native_key
from llmc.codegen.ort import ort_lowering  # through the module: tests fake build_segment
from llmc.codegen.ort.onnx_ops import INT8_COMPUTE, MS_DOMAIN
from llmc.codegen.ort.ort_lowering import segment_ops
from llmc.codegen.torch_cpu.cpu_kernels import RopeCache, resolve_kernel
from llmc.codegen.torch_cpu.cpu_qlinear_dense import DISPATCH_META
from llmc.compiler.driver.tuning.ort_timing_cache import Timings, recall_measured
from llmc.compiler.driver.tuning.qlinear_dispatch import dispatch_record
from llmc.compiler.ir import Graph, eval_dim
from llmc.compiler.ops import TORCH_DTYPES, run_reference
from llmc.runtime import ort_segment  # through the module: tests fake cpu_kernel_ops
from llmc.runtime.ort_segment import OrtSegment
from llmc.runtime.threads import resolve_threads

PREFILL_TOKENS = 128
REPEATS = {"decode": 15, "prefill": 3}
# (repeats, loss, slowest us): after that many interleaved repeats, a runner whose best is `loss`
# times a choosable rival's at that shape, and above `slowest` microseconds, is timed no more there:
# no noise brings it within reach, and a slow session (ORT dequantising an 8-bit head on every call,
# ~80 ms a call for SmolLM2's) would otherwise spend most of the compile losing. One repeat already
# tells an 8x loser whose calls take many milliseconds; a one-off stall can make a 70 us call look
# 15x slower, so faster calls get five.
CLEAR_CUTS = ((1, 8.0, 10_000.0), (5, 4.0, 0.0))
# auto never trades accuracy for speed: ORT is eligible for a segment only where its outputs are as
# close to the reference as the torch kernels' (which round activations to bf16 for packed int8/int4
# weights), or within float reassociation of it
AUTO_TOLERANCE = 1e-4
# A kind whose weights are larger than this is not timed on ONNX Runtime: timing holds its weights
# in every candidate's form at once (the torch runner's, each ORT session's initialisers and packed
# copy), which for an 8B model's LM head (Q8_0, 213 MB) was ~1 GB of the compile's 3.4 GiB peak.
# The torch kernels, the default, run it (a GEMV that reads it once a token either way).
KIND_TIMING_LIMIT = 128 * 2**20
# MatMulNBits on int8 activations is measured beside the fp32 level, but random inputs cannot say
# what it costs in accuracy (its error grows with the activations' outliers, which they do not
# have): where it is the fastest, it is a candidate that the whole model's logits on the compile's
# calibration text accept or refuse (ort_accuracy.py)
INT8_ACTIVATIONS = "ort-int8"
INT8_EXCLUDED = ("rounds activations to int8 per block; auto takes it only where it is fastest and passes the "
                 "calibration check")


def signature(graph: Graph, seg) -> str:
    """Equal for segments that run the same ops on values of the same types (a model's layers)."""
    types = graph.types()
    return json.dumps([[n.op, {k: v for k, v in n.attrs.items() if k != "layer"},
                        [str(types[i]) for i in n.inputs]] for n in seg.nodes], sort_keys=True, default=str)


def sample_inputs(graph: Graph, names: list[str], tokens: int) -> list[torch.Tensor]:
    """Activations of the segment's inputs for a batch of `tokens` tokens of one sequence (one
    logits row), random but the same on every call; index inputs are zeros, a valid row of any table."""
    generator = torch.Generator().manual_seed(tokens)
    out = []
    for name in names:
        t = graph.type_of(name)
        binding = {s: tokens if s == "tokens" else 1 for d in t.shape if isinstance(d, str)
                   for s in re.findall(r"[A-Za-z_]\w*", d)}
        shape = [eval_dim(d, binding) for d in t.shape]
        dtype = TORCH_DTYPES[t.dtype]
        out.append(torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point
                   else torch.zeros(shape, dtype=dtype))
    return out


class TorchSegment:
    """The segment's nodes run as the cpu plan runs them (kernels with their load-time packing, the
    quantised linears' switch to dense GEMMs: as `dispatch`, the plan's record of it, says, or probed
    at the two token counts timed here where none is given)."""

    def __init__(self, graph: Graph, seg, threads: int, dispatch: dict | None = None):
        self.seg = seg
        self.launches = []
        steps = [(f"cpu.{n.op}", n.inputs, n.attrs) for n in seg.nodes]
        weights = segment_weights(graph, seg)
        record = dispatch if dispatch is not None else dispatch_record(steps, weights, threads,
                                                                       rows=(1, PREFILL_TOKENS))
        meta = {"kernel_choice": {DISPATCH_META: record}}
        for node in seg.nodes:
            fn = resolve_kernel(f"cpu.{node.op}")
            attrs = dict(node.attrs)
            if getattr(fn, "prepare", None) is not None:
                params = [weights.get(i) for i in node.inputs]
                attrs.update(fn.prepare(params, attrs, meta))
            self.launches.append((node, fn, attrs))
        self.weights = weights

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


class ReferenceSegment:
    """The segment's nodes under their reference semantics, as the interpreter runs them."""

    def __init__(self, graph: Graph, seg):
        self.seg, self.weights = seg, segment_weights(graph, seg)

    @torch.inference_mode()
    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        values = dict(zip(self.seg.inputs, inputs))
        for node in self.seg.nodes:
            args = [values[i] if i in values else self.weights[i] for i in node.inputs]
            for v, t in zip(node.outputs, run_reference(node, args)):
                values[v.name] = t
        return [values[o] for o in self.seg.outputs]


def return_freed_memory() -> None:
    """Give the C heap's freed pages back to the system (glibc keeps them otherwise, and a large
    model's timings free a layer's worth at a time)."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def weight_bytes(graph: Graph, seg) -> int:
    """Bytes of the params the segment reads, as stored (no value is read)."""
    names = {i for node in seg.nodes for i in node.inputs if i in graph.params}
    return sum(graph.params[name].type.nbytes() for name in names)


def segment_weights(graph: Graph, seg) -> dict[str, torch.Tensor]:
    """The values of the weights the segment reads, made once: a lazy weight read on every call
    would be timed decoding from its source."""
    return {i: graph.weights[i] for node in seg.nodes for i in node.inputs if i in graph.weights}


def _time(fn, inputs) -> float:
    start = time.perf_counter()
    fn(*inputs)
    return (time.perf_counter() - start) * 1e6


def measure(runners: dict, graph: Graph, seg, outputs: dict | None = None) -> dict[str, dict[str, float]]:
    """Microseconds per call of each runner, at decode and prefill shapes (a Timings: with each
    runner's spread at each shape); each runner's first (warm) outputs at each token count go into
    `outputs`, for errors() to reuse."""
    us = Timings({name: {} for name in runners}, {name: {} for name in runners})
    rivals = [name for name in runners if name != INT8_ACTIVATIONS]
    for shape, tokens in (("decode", 1), ("prefill", PREFILL_TOKENS)):
        inputs = sample_inputs(graph, seg.inputs, tokens)
        for name, run in runners.items():
            first = run(*inputs)        # warm: first calls allocate and pack
            if outputs is not None:
                outputs[name, tokens] = [t.clone() for t in first]
        samples: dict[str, list[float]] = {name: [] for name in runners}
        timed = list(runners)
        for repeat in range(REPEATS[shape]):
            for name in timed:
                samples[name].append(_time(runners[name], inputs))
            for after, loss, slowest in CLEAR_CUTS:
                if repeat + 1 == after:
                    fastest = min(min(samples[name]) for name in rivals)
                    timed = [name for name in timed if min(samples[name]) <= max(loss * fastest, slowest)]
        for name in runners:
            us[name][shape] = round(min(samples[name]), 1)
            us.spread[name][shape] = spread(samples[name])
    return us


def errors(runners: dict, reference, graph: Graph, seg, outputs: dict | None = None) -> dict[str, float]:
    """Each runner's largest |out - reference| over the segment's float outputs, relative to the
    largest |reference| output, the worse of decode and prefill shapes (the torch kernels take
    another path from some row count on); two significant digits. A runner's outputs come from
    `outputs` (measure's warm calls on the same inputs) where they are there."""
    outputs = outputs or {}
    worst = dict.fromkeys(runners, 0.0)
    for tokens in (1, PREFILL_TOKENS):
        inputs = sample_inputs(graph, seg.inputs, tokens)
        want = [t.float() if t.is_floating_point() and t.numel() else None for t in reference(*inputs)]
        scale = max((t.abs().max().item() for t in want if t is not None), default=0.0) or 1.0
        for name, run in runners.items():
            got = outputs[name, tokens] if (name, tokens) in outputs else run(*inputs)
            pairs = [(a.float(), b) for a, b in zip(got, want) if b is not None]
            off = max(((a - b).abs().max().item() for a, b in pairs), default=0.0) / scale
            worst[name] = max(worst[name], off)
    return {name: float(f"{off:.2g}") for name, off in worst.items()}


def request_cost(us: dict[str, float]) -> float:
    return us["prefill"] + PREFILL_TOKENS * us["decode"]


def choose_segments(graph: Graph, segments: list, built: list, echo=None,
                    dispatch: dict | None = None) -> tuple[list[dict], dict]:
    """Each segment's kind (one dict shared by the segments of a kind: what was measured, the family
    `chosen` for it, `int8_candidate` where ORT on int8 activations would be faster still), and
    the record of what was measured (plan.meta). `dispatch`, the plan's qlinear dispatch record
    (qlinear_dispatch.py), is how the torch kernels are timed switching to dense GEMMs; without it
    each kind probes its own shapes at the two token counts timed."""
    threads = resolve_threads()
    kinds: dict[str, dict] = {}
    chosen = []
    for i, seg in enumerate(segments):
        key = signature(graph, seg)
        if key not in kinds:
            kinds[key] = _kind(graph, seg, *built[i], threads, key, dispatch)
        kinds[key]["segments"] += 1
        chosen.append(kinds[key])
    record = {"threads": threads, "tokens": {"decode": 1, "prefill": PREFILL_TOKENS},
              "cost": f"prefill + {PREFILL_TOKENS} x decode", "kinds": list(kinds.values())}
    return chosen, record


def _kind(graph: Graph, seg, model: bytes, builder, threads: int, key: str, dispatch: dict | None = None) -> dict:
    """One kind's record: what was measured (from the machine's cache when it was measured before)
    and the choice."""
    entry = {"first": seg.span, "ops": _op_counts(seg), "segments": 0}
    missing = sorted(segment_ops(model) - ort_segment.cpu_kernel_ops())
    if missing:
        return {**entry, "chosen": "cpu", "why": f"onnxruntime lacks {'.'.join(missing[0]).lstrip('.')}"}
    size = weight_bytes(graph, seg)
    if size > KIND_TIMING_LIMIT:
        return {**entry, "chosen": "cpu", "why": f"not timed: its weights ({size / 2**20:.0f} MiB) are over "
                                                 f"{KIND_TIMING_LIMIT >> 20} MiB, which every candidate would hold "
                                                 f"at once; the torch kernels, the default, run it"}
    measured, how = recall_measured({"what": "ort segment", "signature": key, "onnx": hashlib.sha256(model).hexdigest(),
                                     "threads": threads, "tokens": PREFILL_TOKENS, "repeats": REPEATS,
                                     "clear_cuts": CLEAR_CUTS, "native": native_key(),
                                     "dispatch": None if dispatch is None else _dispatch_key(dispatch)},
                                    lambda: _measure_kind(graph, seg, model, builder, threads, dispatch),
                                    lambda value: _verdict(value).get("close"))
    verdict = _verdict(measured)
    if how.get("busy") and verdict["chosen"] != "cpu":
        verdict = {**verdict, "chosen": "cpu", "why": f"measured on a busy machine ({how['busy']}): the torch "
                                                      f"kernels, the default, stay"}
    return {**entry, **measured, **verdict}


def _dispatch_key(dispatch: dict) -> dict:
    """What of a dispatch record the torch kernels' timings depend on: each shape's switch."""
    return {shape: entry.get("dense_from") for shape, entry in sorted(dispatch.get("shapes", {}).items())}


def _measure_kind(graph: Graph, seg, model: bytes, builder, threads: int, dispatch: dict | None = None) -> dict:
    io = lambda names: [(n, graph.type_of(n)) for n in names]
    session = lambda m, b: OrtSegment(m, b.values, io(seg.inputs), io(seg.outputs), threads, f"segment {seg.span}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runners = {"cpu": TorchSegment(graph, seg, threads, dispatch), "ort": session(model, builder)}
        if (MS_DOMAIN, "MatMulNBits") in segment_ops(model):
            runners[INT8_ACTIVATIONS] = session(*ort_lowering.build_segment(graph, seg, INT8_COMPUTE))
        outputs: dict = {}
        us = measure(runners, graph, seg, outputs)
        # measure kept every runner's outputs: the runners (each holding the segment's weights in its
        # own form) go before the reference dequantises them again, so a large model's layer is held once
        if all((name, tokens) in outputs for name in runners for tokens in (1, PREFILL_TOKENS)):
            runners = dict.fromkeys(runners)
            return_freed_memory()
        error = errors(runners, ReferenceSegment(graph, seg), graph, seg, outputs)
    finally:
        torch.set_num_threads(previous)
    spreads = getattr(us, "spread", None)
    return {"us": dict(us), "error": error, **({"spread": spreads} if spreads else {})}


def _verdict(measured: dict) -> dict:
    """The family auto runs a kind in: the cheaper request among the torch kernels and those ORT
    sessions no further from the reference (an excluded one is recorded with its reason)."""
    us, error = measured["us"], measured["error"]
    out = {"excluded": {INT8_ACTIVATIONS: INT8_EXCLUDED}} if INT8_ACTIVATIONS in us else {}
    if error["ort"] > max(AUTO_TOLERANCE, error["cpu"]):
        out.update(chosen="cpu", why=f"ORT's outputs are {error['ort']:.1e} of the largest off the reference, "
                                     f"the torch kernels' {error['cpu']:.1e}: it would change the numbers")
    else:
        out["chosen"], close = pick(cost_ranges(measured, ("cpu", "ort")), ("cpu", "ort"))
        if close:
            out.update(why=close, close=close)
    if (INT8_ACTIVATIONS in us and "close" not in out
            and pick(cost_ranges(measured, (out["chosen"], INT8_ACTIVATIONS)), (out["chosen"], INT8_ACTIVATIONS))[0]
            == INT8_ACTIVATIONS):
        out["int8_candidate"] = True
    return out


def cost_ranges(measured: dict, names) -> dict[str, tuple[float, float]]:
    """Each family's request cost at its best timings and at its median ones (best x (1 + spread))."""
    us, spreads = measured["us"], measured.get("spread") or {}
    typical = lambda name: {shape: t * (1 + (spreads.get(name) or {}).get(shape, 0.0)) for shape, t in us[name].items()}
    return {name: (request_cost(us[name]), request_cost(typical(name))) for name in names}


def _op_counts(seg) -> str:
    counts: dict[str, int] = {}
    for n in seg.nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    return ", ".join(f"{op} {c}" if c > 1 else op for op, c in counts.items())


__all__ = ["choose_segments", "signature", "measure", "errors", "TorchSegment", "ReferenceSegment", "PREFILL_TOKENS",
           "request_cost", "AUTO_TOLERANCE", "INT8_ACTIVATIONS", "INT8_EXCLUDED"]
