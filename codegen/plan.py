"""The static execution plan: the ordered kernel launches of a model for one target, with
the memory plan and every name and type the runtime needs to run it without the Graph."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from llmc.codegen.memory_plan import MemoryPlan, plan_memory
from llmc.compiler.ir import DTYPE_BYTES, Graph, Node, TensorType
from llmc.compiler.ops import ATTENTION_OPS
from llmc.compiler.targets import TARGETS
from llmc.errors import ArtifactError, TargetError

PLAN_FORMAT = 1
MAX_TOKENS = 1 << 20     # batched tokens a plan may be sized for; beyond any real batch
RECOMPILE = "the artifact is corrupt or was not made by this llmc; recompile the model with this llmc"

# Which kernel family a target's plan launches: torch ops on the CPU, Triton kernels (and torch
# calls for ops without one) on GPU targets.
KERNEL_NAMESPACES = {name: "triton" if t.device == "cuda" else "cpu" for name, t in TARGETS.items()}
ORT_SEGMENT = "ort.segment"   # a run of cpu steps as one ONNX Runtime session (codegen/ort/ort_lowering.py)


@dataclass
class PlanStep:
    kernel: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    node: str

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "attrs": self.attrs, "node": self.node}

    @classmethod
    def from_dict(cls, d: dict) -> "PlanStep":
        return cls(d["kernel"], list(d["inputs"]), list(d["outputs"]), dict(d["attrs"]), d["node"])

    def where(self, index: int) -> str:
        """How an error names this step: `plan.json step 12 (node 'l0.attn', kernel cpu.attention)`."""
        return f"plan.json step {index} (node {self.node!r}, kernel {self.kernel})"

    def inner_steps(self) -> list["PlanStep"]:
        """The cpu steps an ONNX Runtime segment stands for (codegen/ort/ort_lowering.py); [] for others."""
        return [PlanStep.from_dict(d) for d in self.attrs["steps"]] if self.kernel == ORT_SEGMENT else []


@dataclass
class Plan:
    steps: list[PlanStep]
    inputs: list[str]
    outputs: list[str]
    memory: MemoryPlan
    target: str
    max_tokens: int
    params: list[str] = field(default_factory=list)
    # name -> {"shape": [...], "dtype": ...} for graph inputs, params and activations
    types: dict[str, dict] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def type_of(self, name: str) -> TensorType:
        t = self.types[name]
        return TensorType(tuple(t["shape"]), t["dtype"])

    def attention_steps(self) -> list[PlanStep]:
        """Attention launches (plain or fused) in layer order (what a KV cache is sized from)."""
        steps = [s for s in self.steps if s.kernel.rpartition(".")[2] in ATTENTION_OPS]
        return sorted(steps, key=lambda s: s.attrs.get("layer", 0))

    def kv_layout(self) -> dict[str, int]:
        """num_layers, num_kv_heads and head_dim shared by every attention layer."""
        steps = self.attention_steps()
        shapes = {(s.attrs["num_kv_heads"], s.attrs["head_dim"]) for s in steps}
        if len(shapes) > 1:
            raise ArtifactError(f"plan for {self.target}: attention layers differ in "
                                f"(num_kv_heads, head_dim): {sorted(shapes)}; a uniform KV cache "
                                f"cannot hold them")
        kv_heads, head_dim = shapes.pop() if shapes else (0, 0)
        return {"num_layers": len(steps), "num_kv_heads": kv_heads, "head_dim": head_dim}

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "target": self.target, "max_tokens": self.max_tokens,
                "inputs": list(self.inputs), "outputs": list(self.outputs),
                "params": list(self.params), "types": self.types, "meta": self.meta,
                "steps": [s.to_dict() for s in self.steps], "memory": self.memory.to_dict()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan `d` describes, after checking that every field has its JSON form (the
        semantic checks of an untrusted plan run at load: runtime/plan_check.py)."""
        check_plan_json(d)
        return cls(steps=[PlanStep.from_dict(s) for s in d["steps"]], inputs=list(d["inputs"]),
                   outputs=list(d["outputs"]), memory=MemoryPlan.from_dict(d["memory"]),
                   target=d["target"], max_tokens=int(d["max_tokens"]), params=list(d["params"]),
                   types=dict(d["types"]), meta=dict(d["meta"]))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"plan.json is not valid JSON ({e}); the artifact is corrupt, "
                                f"recompile it") from e
        return cls.from_dict(d)


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _expect(ok: bool, where: str, value: Any, want: str) -> None:
    if not ok:
        raise ArtifactError(f"plan.json {where} is {_show(value)}, expected {want}; {RECOMPILE}")


def _is_int(v: Any, lo: int = 0, hi: int = 1 << 40) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _fields(d: Any, where: str, fields: dict[str, tuple[Any, str]]) -> None:
    """`d` is an object holding each of `fields` (name -> (test, what it must be))."""
    _expect(isinstance(d, dict), where, d, "a JSON object")
    for name, (test, want) in fields.items():
        _expect(name in d and test(d[name]), f"{where}.{name}".lstrip("."), d.get(name), want)


_NAMES = (_is_names, "a list of value names")
_OBJECT = (lambda v: isinstance(v, dict), "an object")
_PLAN_FIELDS = {"target": (lambda v: isinstance(v, str), "a target name"),
                "max_tokens": (lambda v: _is_int(v, 1, MAX_TOKENS), f"an int in 1..{MAX_TOKENS}"),
                "inputs": _NAMES, "outputs": _NAMES, "params": _NAMES, "types": _OBJECT, "meta": _OBJECT,
                "steps": (lambda v: isinstance(v, list), "a list of steps"), "memory": _OBJECT}
_STEP_FIELDS = {"kernel": (lambda v: isinstance(v, str), "a kernel name"), "inputs": _NAMES, "outputs": _NAMES,
                "attrs": _OBJECT, "node": (lambda v: isinstance(v, str), "a node name")}
_DIM = (lambda d: _is_int(d) or isinstance(d, str) and 0 < len(d) <= 64)
_TYPE_FIELDS = {"shape": (lambda v: isinstance(v, list) and len(v) <= 16 and all(map(_DIM, v)),
                          "a list of at most 16 dims (ints in 0..2^40 or symbolic names)"),
                "dtype": (lambda v: isinstance(v, str) and v in DTYPE_BYTES, f"one of {', '.join(DTYPE_BYTES)}")}
_MEMORY_FIELDS = {"slot_of": (lambda v: isinstance(v, dict) and all(_is_int(s, 0, 1 << 31) for s in v.values()),
                              "an object of slot numbers"),
                  "slot_bytes": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of byte counts"),
                  "lifetimes": (lambda v: isinstance(v, dict) and all(
                      isinstance(s, list) and len(s) == 2 and all(_is_int(x, 0, 1 << 31) for x in s)
                      for s in v.values()), "an object of [first step, last step] pairs"),
                  "value_bytes": (lambda v: isinstance(v, dict) and all(map(_is_int, v.values())),
                                  "an object of byte counts")}
_CONSTANT = (lambda c: type(c) is bool or _is_int(c, -(1 << 31), 1 << 31)
             or isinstance(c, str) and len(c) <= 64 and all(ch.isalnum() or ch in " _.,/[]" for ch in c))
_KERNEL_FIELDS = {"name": (lambda v: isinstance(v, str) and v.isidentifier(), "an identifier"),
                  "template": (lambda v: isinstance(v, str) and v.endswith(".py.j2") and "/" not in v,
                               "a template file name"),
                  "sha256": (lambda v: isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v),
                             "a sha256 hex digest"),
                  "constants": (lambda v: isinstance(v, dict) and all(k.isidentifier() and _CONSTANT(c)
                                                                      for k, c in v.items()),
                                "an object of identifier: bool, int or short string"),
                  "grid": (lambda v: isinstance(v, str), "a string")}

_SEGMENT_FIELDS = {"file": (lambda v: isinstance(v, str) and re.fullmatch(r"ort/segment_\d{3,6}\.onnx", v) is not None,
                            "a file name ort/segment_NNN.onnx"),
                   "sha256": _KERNEL_FIELDS["sha256"],
                   "initializers": (lambda v: isinstance(v, dict) and all(
                       isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x) for x in v.values()),
                                    "an object of [param, transform] pairs"),
                   "steps": (lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list of steps")}


def _check_segment_json(step: dict, where: str) -> None:
    """An ort.segment step's attrs: its ONNX file and the cpu steps it stands for."""
    _fields(step["attrs"], f"{where}.attrs", _SEGMENT_FIELDS)
    for j, inner in enumerate(step["attrs"]["steps"]):
        _fields(inner, f"{where}.attrs.steps[{j}]", _STEP_FIELDS)
        _expect(inner["kernel"].startswith("cpu."), f"{where}.attrs.steps[{j}].kernel", inner["kernel"],
                "a cpu kernel")


def check_plan_json(d: Any) -> None:
    """Raise ArtifactError naming the first field of plan.json that lacks its JSON form."""
    _expect(isinstance(d, dict), "(the whole file)", d, "a JSON object")
    if d.get("format") != PLAN_FORMAT:
        raise ArtifactError(f"plan.json has format {d.get('format')!r}, this llmc reads "
                            f"format {PLAN_FORMAT}; recompile the model with this llmc")
    _fields(d, "", _PLAN_FIELDS)
    for i, step in enumerate(d["steps"]):
        _fields(step, f"steps[{i}]", _STEP_FIELDS)
        if step["kernel"] == ORT_SEGMENT:
            _check_segment_json(step, f"steps[{i}]")
        records = step["attrs"].get("kernels", [])
        _expect(isinstance(records, list), f"steps[{i}].attrs.kernels", records, "a list of kernel records")
        for j, record in enumerate(records):
            _fields(record, f"steps[{i}].attrs.kernels[{j}]", _KERNEL_FIELDS)
    for name, t in d["types"].items():
        _fields(t, f"types[{name!r}]", _TYPE_FIELDS)
    _fields(d["memory"], "memory", _MEMORY_FIELDS)


def kernel_namespace(target_name: str) -> str:
    try:
        return KERNEL_NAMESPACES[target_name]
    except KeyError:
        raise TargetError(f"no execution plan can be built for target {target_name!r} yet; "
                          f"plans exist for {sorted(KERNEL_NAMESPACES)}") from None


def _type_dict(t: TensorType) -> dict:
    return {"shape": list(t.shape), "dtype": t.dtype}


def build_plan(graph: Graph, target_name: str, max_tokens: int, configs: dict | None = None) -> Plan:
    """Verify the graph, then lay its nodes out as kernel launches with a memory plan. On a Triton
    target each step records the kernels it launches (attrs["kernels"]); `configs` overrides the
    target's launch configs by kernel family (see codegen/kernel_select.py)."""
    graph.verify(for_runtime=True)
    if max_tokens > MAX_TOKENS:
        raise TargetError(f"max_tokens {max_tokens} is over the {MAX_TOKENS} batched tokens a plan may be sized "
                          f"for; pick a smaller --max-num-batched-tokens")
    ns = kernel_namespace(target_name)
    steps = [PlanStep(f"{ns}.{n.op}", list(n.inputs), [v.name for v in n.outputs], dict(n.attrs), n.name)
             for n in graph.nodes]
    meta = dict(graph.meta)
    if ns == "triton":
        meta["kernels"] = record_kernels(graph, steps, target_name, configs)
    used = {i for n in graph.nodes for i in n.inputs} | set(graph.outputs)
    params = [p for p in graph.params if p in used]
    types = {name: _type_dict(t) for name, t in graph.types().items()
             if name in used or name not in graph.params}
    return Plan(steps=steps, inputs=[v.name for v in graph.inputs], outputs=list(graph.outputs),
                memory=plan_memory(graph, max_tokens), target=target_name, max_tokens=max_tokens,
                params=params, types=types, meta=meta)


def record_kernels(graph: Graph, steps: list[PlanStep], target_name: str, configs: dict | None) -> dict:
    """Put each step's Triton kernels in its attrs; returns the plan meta saying which ops launch
    Triton kernels and which run as torch calls."""
    # jinja2 and the Triton templates (~0.1 s): `llmc --help` and the engine import this module
    from llmc.codegen.kernel_select import KV_BLOCK_SIZE, kernel_record

    types = graph.types()
    # the dtype a quantised KV cache stores, as its attention nodes say (quantize_kv_cache)
    kv_dtype = next((n.attrs.get("kv_cache") for n in graph.nodes if n.op in ATTENTION_OPS), None)
    triton_ops, torch_ops = set(), set()
    for node, step in zip(graph.nodes, steps):
        kernels = step_kernels(node, types, target_name, configs, kv_dtype)
        if kernels:
            step.attrs["kernels"] = [kernel_record(k) for k in kernels]
        (triton_ops if kernels else torch_ops).add(node.op)
    return {"namespace": "triton", "triton_ops": sorted(triton_ops), "torch_ops": sorted(torch_ops),
            "kv_block_size": KV_BLOCK_SIZE}


def step_kernels(node: Node, types: dict, target_name: str, configs: dict | None, kv_dtype: str | None) -> list:
    # jinja2 and the Triton templates (~0.1 s): `llmc --help` and the engine import this module
    from llmc.codegen.kernel_select import kernels_for_step

    try:
        return kernels_for_step(node.op, node.attrs, [types[i] for i in node.inputs],
                                [v.type for v in node.outputs], target_name, configs=configs, kv_cache_dtype=kv_dtype)
    except TargetError as e:
        raise TargetError(f"node {node.name}: {e}") from e


__all__ = ["PLAN_FORMAT", "MAX_TOKENS", "KERNEL_NAMESPACES", "ORT_SEGMENT", "PlanStep", "Plan", "check_plan_json",
           "kernel_namespace", "build_plan"]
