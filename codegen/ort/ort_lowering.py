"""The "ort" kernel family at compile time: a cpu plan's runs of steps that ONNX Runtime can run
(all but attention, which reads the paged KV cache in torch, and the split feeding it, a free view)
become ONNX graphs, one `ort.segment` step each, stored in the artifact as ort/segment_NNN.onnx.
This module offers the candidates (segments, their ONNX models, a plan with a chosen set of them
lowered); which are kept, as `--kernels` says and, under `auto`, by measurement on this machine, is
the compile driver's choice (compiler/driver/tuning/kernel_choice.py)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from llmc.codegen.memory_plan import MemoryPlan, assign_slots, value_lifetimes
from llmc.codegen.ort.onnx_ops import (
    AFFINE_BITS,
    INT8_COMPUTE,
    MS_DOMAIN,
    OPSET,
    TRANSLATIONS,
    OnnxBuilder,
    nbits_int8_block,
)
from llmc.codegen.plan import Plan, PlanStep
from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.ops import ATTENTION_OPS
from llmc.compiler.schemes import ORT, SCHEMES, schemes_where
from llmc.errors import TargetError

KERNEL_MODES = ("cpu", "ort", "auto")
DEFAULT_MODE = "auto"
SEGMENT_DIR = "ort"
ORT_SCHEMES = schemes_where(family=ORT)
EMBEDDING_SCHEMES = schemes_where(family=ORT, qembedding=True)
ACTIVATION_DTYPES = ("float32", "int64", "int32")
ATTENTION = "attention reads the paged KV cache in torch"
ATTENTION_SPLIT = "splits q, k, v as views for attention"
FIX = "compile with --kernels auto (keeps such ops in torch, recorded) or --kernels cpu"


@dataclass
class Segment:
    nodes: list[Node]
    first: int                      # the plan step index of its first node
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    @property
    def span(self) -> str:
        return f"{self.nodes[0].name} .. {self.nodes[-1].name}" if len(self.nodes) > 1 else self.nodes[0].name


def ort_refusal(node: Node, graph: Graph) -> str | None:
    """Why `node` cannot run in an ORT segment (None: it can)."""
    if node.op not in TRANSLATIONS:
        return f"op {node.op}{' ' + node.attrs.get('target', '') if node.op == 'aten' else ''} has no ONNX translation"
    if any(graph.type_of(i).dtype not in ACTIVATION_DTYPES for i in node.inputs if i not in graph.params) or any(
            v.type.dtype not in ACTIVATION_DTYPES for v in node.outputs):
        return "only float32 activations run in ONNX Runtime segments"
    if node.op == "linear" and graph.type_of(node.inputs[1]).dtype != "float32":
        return f"{graph.type_of(node.inputs[1]).dtype} linear weights have no ORT lowering"
    if node.op in ("qlinear", "qembedding"):
        return _quant_refusal(node, graph)
    return None


def _quant_refusal(node: Node, graph: Graph) -> str | None:
    scheme, k = node.attrs["scheme"], node.attrs.get("in_features", 0)
    schemes = ORT_SCHEMES if node.op == "qlinear" else EMBEDDING_SCHEMES
    if scheme not in schemes or node.attrs.get("has_act_scale"):
        return f"quantisation scheme {scheme} has no ORT lowering (it has: {', '.join(schemes)})"
    if node.op == "qlinear" and scheme == "int8" and nbits_int8_block(k) is None:
        return f"int8 weights with {k} inputs (not a multiple of 16) have no MatMulNBits layout"
    group = node.attrs.get("group_size", -1)
    if node.op == "qlinear" and SCHEMES[scheme].grouped and (group < 16 or group & (group - 1)):
        return f"{scheme} group size {group} is no MatMulNBits block size (a power of two >= 16)"
    if node.op == "qlinear" and scheme in AFFINE_BITS and len(graph.type_of(node.inputs[0]).shape) != 2:
        return f"{scheme} weights are lowered for [tokens, features] inputs only"
    return None


def kept_in_torch(graph: Graph) -> dict[str, str]:
    """Node -> why it runs in torch: attention, the split feeding it (views, no copy), and ops ORT
    segments cannot run."""
    users = graph.users()
    kept = {}
    for node in graph.nodes:
        if node.op in ATTENTION_OPS:
            kept[node.name] = ATTENTION
        elif node.op == "split" and any(u.op in ATTENTION_OPS for v in node.outputs for u in users.get(v.name, [])):
            kept[node.name] = ATTENTION_SPLIT
        else:
            why = ort_refusal(node, graph)
            if why:
                kept[node.name] = why
    return kept


def find_segments(graph: Graph, kept: dict[str, str], outputs: list[str]) -> list[Segment]:
    """Maximal runs of nodes not kept in torch, with the values each reads from and gives to the rest."""
    segments: list[Segment] = []
    for index, node in enumerate(graph.nodes):
        if node.name in kept:
            continue
        if segments and segments[-1].first + len(segments[-1].nodes) == index:
            segments[-1].nodes.append(node)
        else:
            segments.append(Segment([node], index))
    for seg in segments:
        _boundary(graph, seg, outputs)
    return segments


def _boundary(graph: Graph, seg: Segment, outputs: list[str]) -> None:
    inside = {v.name for n in seg.nodes for v in n.outputs}
    for n in seg.nodes:
        for i in n.inputs:
            if i not in inside and i not in graph.params and i not in seg.inputs:
                seg.inputs.append(i)
    end = seg.first + len(seg.nodes)
    read_later = {i for n in graph.nodes[end:] for i in n.inputs} | set(outputs)
    seg.outputs = [v.name for n in seg.nodes for v in n.outputs if v.name in read_later]


def build_segment(graph: Graph, seg: Segment, nbits_level: int = INT8_COMPUTE) -> tuple[bytes, OnnxBuilder]:
    """The segment as ONNX bytes (weights as external initializers, MatMulNBits at `nbits_level`)
    and the builder that made it (its `sources` and `values` say what the initializers hold)."""
    from onnx import helper  # onnx: `llmc --help` and the engine import this module

    b = OnnxBuilder(graph, graph.weights, segment=True, nbits_level=nbits_level)
    b.env = {i: i for i in seg.inputs}
    for node in seg.nodes:
        TRANSLATIONS[node.op](b, node)
    _name_outputs(b, seg)
    info = lambda name: helper.make_tensor_value_info(name, _elem_type(graph.type_of(name).dtype),
                                                      list(graph.type_of(name).shape))
    onnx_graph = helper.make_graph(b.nodes, seg.nodes[0].name, [info(i) for i in seg.inputs],
                                   [info(o) for o in seg.outputs], b.initializers)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if b.uses_ms else [])
    model = helper.make_model(onnx_graph, opset_imports=opsets, producer_name="llmc")
    model.ir_version = 8
    return model.SerializeToString(), b


class SegmentModels:
    """Each segment's build_segment (ONNX bytes, builder) at one MatMulNBits level, made when first
    asked for: auto times one segment of each kind and stores only the chosen ones, so a segment
    that stays in torch is never lowered (a SmolLM2 layer builds in 1-3 ms). Segments given
    `overrides` take those models instead."""

    def __init__(self, graph: Graph, segments: list[Segment], nbits_level: int,
                 overrides: dict | None = None, cache: dict | None = None):
        self._graph, self._segments, self.nbits_level = graph, segments, nbits_level
        self._overrides = dict(overrides or {})
        self._cache = {} if cache is None else cache   # shared with overlays: each segment built once

    def __len__(self) -> int:
        return len(self._segments)

    def __getitem__(self, i: int) -> tuple[bytes, OnnxBuilder]:
        if i in self._overrides:
            return self._overrides[i]
        if i not in self._cache:
            self._cache[i] = build_segment(self._graph, self._segments[i], self.nbits_level)
        return self._cache[i]

    def __setitem__(self, i: int, model: tuple[bytes, OnnxBuilder]) -> None:
        self._overrides[i] = model

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def overlay(self, models) -> "SegmentModels":
        """These models, with segment i taking models[i] instead for each i in `models`' keys."""
        return SegmentModels(self._graph, self._segments, self.nbits_level,
                             {**self._overrides, **{i: models[i] for i in models}}, self._cache)


def _elem_type(dtype: str) -> int:
    from onnx import TensorProto  # onnx: `llmc --help` and the engine import this module
    return {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "int32": TensorProto.INT32}[dtype]


def _name_outputs(b: OnnxBuilder, seg: Segment) -> None:
    """Give each segment output its plan value's name: rename the ONNX value that holds it, or
    (for a value that is an input or another output too) copy it with Identity."""
    renames: dict[str, str] = {}
    for out in seg.outputs:
        held = b.env[out]
        if held in seg.inputs or held in renames or held in b.sources:
            b.add("Identity", [held], [out])
        else:
            renames[held] = out
    for node in b.nodes:
        node.input[:] = [renames.get(i, i) for i in node.input]
        node.output[:] = [renames.get(o, o) for o in node.output]


def segment_ops(model: bytes) -> set[tuple[str, str]]:
    import onnx  # onnx: `llmc --help` and the engine import this module
    return {(n.domain if n.domain != "ai.onnx" else "", n.op_type) for n in onnx.load_from_string(model).graph.node}


def segment_step(seg: Segment, number: int, model: bytes, b: OnnxBuilder, plan: Plan) -> PlanStep:
    inner = [plan.steps[seg.first + i].to_dict() for i in range(len(seg.nodes))]
    attrs = {"file": f"{SEGMENT_DIR}/segment_{number:03d}.onnx", "sha256": hashlib.sha256(model).hexdigest(),
             "initializers": {name: list(source) for name, source in sorted(b.sources.items())}, "steps": inner}
    return PlanStep("ort.segment", list(seg.inputs), list(seg.outputs), attrs, f"segment_{number:03d}")


def restep(plan: Plan, steps: list[PlanStep]) -> Plan:
    """`plan` with `steps` instead of its own, its memory planned again over them."""
    lifetimes = value_lifetimes([(s.inputs, s.outputs) for s in steps], plan.outputs)
    symbols = {s for t in plan.types.values() for d in t["shape"] if isinstance(d, str)
               for s in re.findall(r"[A-Za-z_]\w*", d)}
    binding = {s: plan.max_tokens for s in symbols} | {"tokens": plan.max_tokens}
    sizes = {v: TensorType(tuple(plan.types[v]["shape"]), plan.types[v]["dtype"]).nbytes(binding) for v in lifetimes}
    slot_of, slot_bytes = assign_slots(lifetimes, sizes)
    return Plan(steps=steps, inputs=plan.inputs, outputs=plan.outputs, target=plan.target,
                memory=MemoryPlan(slot_of, slot_bytes, lifetimes, sizes), max_tokens=plan.max_tokens,
                params=plan.params, types=plan.types, meta=plan.meta)


def torch_plan(plan: Plan) -> Plan:
    """`plan` as its torch kernels run it: each segment's cpu steps, and no decode graph."""
    flat = restep(plan, [s for step in plan.steps for s in (step.inner_steps() or [step])])
    flat.meta = {k: v for k, v in plan.meta.items() if k != "decode_graph"}
    return flat


def check_kernels_option(mode: str | None, target: str, device: str) -> None:
    """Refuse a --kernels value the target cannot take (checked before any work)."""
    if mode is not None and mode not in KERNEL_MODES:
        raise TargetError(f"--kernels {mode!r} is unknown; choose one of {', '.join(KERNEL_MODES)}")
    if mode is not None and device != "cpu":
        raise TargetError(f"--kernels {mode} chooses among CPU kernel families; target {target} launches "
                          f"Triton kernels on a GPU: drop --kernels or compile for target cpu")


def trial_plan(plan: Plan, meta: dict, segments: list[Segment], built: SegmentModels, chosen: list[bool]):
    """(plan, files) as auto would lower it with segment models `built` where `chosen`, for
    compiler/driver/tuning/ort_accuracy.py to score; `meta` records the torch qlinears' dense switch (measured once
    over every step, whichever stay in torch)."""
    steps, files = lowered_steps(plan, segments, built, chosen)
    trial = restep(plan, steps)
    trial.meta = meta
    return trial, files


def lowered_steps(plan: Plan, segments: list[Segment], built: SegmentModels, chosen: list[bool]):
    """The plan's steps with each chosen segment's run replaced by its ort.segment step, and the
    ONNX files those steps read."""
    starts = {seg.first: (seg, *built[i]) for i, (seg, keep) in enumerate(zip(segments, chosen)) if keep}
    steps, files, index = [], {}, 0
    while index < len(plan.steps):
        if index not in starts:
            steps.append(plan.steps[index])
            index += 1
            continue
        seg, model, builder = starts[index]
        step = segment_step(seg, len(files), model, builder, plan)
        files[step.attrs["file"]] = model
        steps.append(step)
        index += len(seg.nodes)
    return steps, files


def unforced(kept: dict[str, str]) -> dict[str, str]:
    """The nodes kept in torch for want of an ORT lowering (attention and its split always are)."""
    return {name: why for name, why in kept.items() if why not in (ATTENTION, ATTENTION_SPLIT)}


def refuse_torch_ops(graph: Graph, kept: dict[str, str]) -> None:
    for name, why in unforced(kept).items():
        node = next(n for n in graph.nodes if n.name == name)
        raise TargetError(f"--kernels ort: node {name} ({node.op}) cannot run in ONNX Runtime: {why}; {FIX}")
