"""The schema of an artifact's manifest.json: the type of every field llmc reads from it, and the
check that its `model` section says what graph.json and plan.json say. The manifest itself is not
hashed, so it is read as untrusted input: a field of the wrong type or value is refused by name.
Also the schema of what `llmc inspect --kernels` reads: kernels.json and plan.json's kernel record."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)

from llmc.compiler.ir import DTYPE_BYTES
from llmc.compiler.ops import ATTENTION_OPS
from llmc.compiler.schemes import KV_CACHE_FORMATS, kv_cache_head_bytes
from llmc.errors import ArtifactError

RECOMPILE = "the artifact was edited or damaged after compiling; recompile it"


def _known_dtype(name: str) -> str:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}")
    return name


def _layer_template(template: str) -> str:
    # str.format on untrusted text could reach attributes ("{layer.__class__}"): allow one {layer}
    if not re.fullmatch(r"[\w.\-]*\{layer\}[\w.\-]*", template):
        raise ValueError(f"{template!r} is not a parameter name with one {{layer}} in it")
    return template


PosInt = Annotated[StrictInt, Field(gt=0)]
Count = Annotated[StrictInt, Field(ge=0)]
Number = StrictInt | StrictFloat
DType = Annotated[StrictStr, AfterValidator(_known_dtype)]
Sha256 = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


class Record(BaseModel):
    """A JSON object whose listed fields must have their types; other fields pass unread."""
    model_config = ConfigDict(strict=True, extra="allow", protected_namespaces=())


# the KV formats a manifest names in model.kv_cache.format (those whose scales live in the cache's rows)
GROUPED_KV_FORMATS = tuple(name for name, f in KV_CACHE_FORMATS.items() if f.grouped)


class KVCache(Record):
    dtype: DType
    scales: Literal["static", "dynamic"] | None = None
    scale_params: Annotated[StrictStr, AfterValidator(_layer_template)] | None = None
    # a grouped format (int4): its codes and per-group scales share `dtype`'s bytes
    format: Literal[GROUPED_KV_FORMATS] | None = None
    group_size: PosInt | None = None


class HFConfig(Record):
    model_type: StrictStr  # what the HF baseline rebuilds the model from (llmc/tools/bench.py)


class Model(Record):
    name: StrictStr
    source_kind: StrictStr
    source_sha256: StrictStr
    architecture: StrictStr
    num_layers: PosInt
    num_heads: PosInt
    num_kv_heads: PosInt
    head_dim: PosInt
    hidden_size: PosInt
    vocab_size: PosInt
    max_position_embeddings: PosInt
    eos_token_ids: list[Count]
    bos_token_id: Count | None
    kv_dtype: DType
    kv_cache: KVCache
    kv_bytes_per_token: PosInt
    hf_config: HFConfig


class Target(Record):
    name: StrictStr
    device: Literal["cpu", "cuda"]


class Accuracy(Record):
    ppl_before: Annotated[Number, Field(gt=0)]
    ppl_after: Number
    kl: Number
    top1_agreement: Number
    tokens: Count


class QuantFigures(Record):
    method: StrictStr | None = None
    group_size: StrictInt | None = None
    linears: Count = 0
    kept_linears: Count = 0
    bytes_before: Count = 0
    bytes_after: Count = 0


class PassDetails(Record):
    """What `llmc inspect` reads from a pass's free-form details."""
    quant: dict[str, QuantFigures] = {}
    params_removed: Count | None = None
    bytes_removed: Count | None = None
    kv_bytes_per_token_before: Count | None = None
    kv_bytes_per_token_after: Count | None = None
    zeros_after: Count | None = None
    weights: Count | None = None
    storage: StrictStr | None = None


class PassEntry(Record):
    name: StrictStr
    options: dict[str, Any]
    matches: Count
    bytes_saved: StrictInt
    details: PassDetails | None
    accuracy: Accuracy | None


class Report(Record):
    op_counts: dict[str, Count]
    weight_bytes: dict[str, Count]
    kv_bytes_per_token: Count
    kv_bytes_full_context: Count
    activation_peak_bytes: Count
    activation_naive_bytes: Count
    max_num_batched_tokens: PosInt


class KVPolicyEntry(Record):
    """The compile's --kv-policy (runtime/kv_policy.py), also in plan.json's meta, which the runtime reads."""
    kind: StrictStr
    budget: PosInt
    recent: Count
    sinks: Count


class DraftOf(Record):
    model: StrictStr
    manifest_sha256: Sha256
    num_layers: PosInt
    vocab_size: PosInt


class RankEntry(Record):
    """One tensor-parallel rank: its folder, its own attention heads and KV bytes per token."""
    dir: Annotated[StrictStr, Field(pattern=r"^rank[0-9]{1,4}$")]
    num_heads: PosInt
    num_kv_heads: PosInt
    kv_bytes_per_token: PosInt
    weight_bytes: dict[str, Count]
    weight_aliases: dict[str, StrictStr] = {}
    collectives: dict[str, Count]
    activation_peak_bytes: Count
    num_layers: PosInt | None = None        # a pipeline stage: its decoder layers [first, stop)
    layers: list[Count] | None = None
    stage: Count | None = None              # --tp with --pp: rank = stage * tp + tp_rank
    tp_rank: Count | None = None


class LogitsShape(Record):
    width: PosInt
    dtype: StrictStr
    rank: Count | None = None               # the rank that sends them (--tp with --pp; else the last)


class Parallel(Record):
    tp: Annotated[StrictInt, Field(ge=1, le=4096)]
    pp: Annotated[StrictInt, Field(ge=1, le=4096)] = 1
    split: list[PosInt] | None = None       # layers per pipeline stage
    logits: LogitsShape | None = None       # what the last stage sends rank 0
    ranks: list[RankEntry]


class Manifest(Record):
    format_version: StrictInt
    llmc_version: StrictStr
    torch_version: StrictStr
    files: dict[str, Sha256]
    weight_aliases: dict[str, StrictStr] = {}
    target: Target
    model: Model
    pipeline: list[PassEntry]
    report: Report
    draft_of: DraftOf | None = None
    parallel: Parallel | None = None
    kv_policy: KVPolicyEntry | None = None


class KernelEntry(Record):
    """One kernel of kernels.json."""
    name: StrictStr
    file: StrictStr
    template: StrictStr
    sha256: Sha256
    steps: list[StrictStr]
    constants: dict[str, Any]
    grid: StrictStr


class Autotune(Record):
    tuned: bool
    device: StrictStr | None = None
    reason: StrictStr | None = None


class KernelOps(Record):
    triton_ops: list[StrictStr] = []
    torch_ops: list[StrictStr] = []


class PlanKernels(Record):
    """What inspect reads from plan.json's meta."""
    kernels: KernelOps = KernelOps()
    autotune: Autotune | None = None


def check_manifest(manifest: Any, where: str) -> None:
    """Raise ArtifactError naming the first field of `manifest` whose type or value is wrong."""
    check_json(Manifest, manifest, "manifest.json", where)


def check_kernel_records(index: Any, plan_meta: Any, where: str) -> None:
    """Raise ArtifactError naming the first wrong field of kernels.json or of plan.json's kernel
    record (both hashed, but whoever edits them can re-hash them)."""
    check_json(list[KernelEntry], index, "kernels.json", where)
    check_json(PlanKernels, plan_meta, "plan.json meta", where)


def check_json(schema: Any, value: Any, name: str, where: str) -> None:
    try:
        TypeAdapter(schema).validate_python(value)
    except ValidationError as e:
        error = e.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        got = "missing" if error["type"] == "missing" else f"{json.dumps(error['input'], default=str)[:60]}"
        why = error["msg"].removeprefix("Value error, ")
        raise ArtifactError(f"{where}: {name} field {field} is {got}: {why[0].lower() + why[1:]}; "
                            f"{RECOMPILE}") from None


SOURCE_ONLY = {"name", "source_kind", "source_sha256"}  # what the graph does not record


def check_model_agrees(manifest: dict, graph: Any, plan: Any, where: str) -> None:
    """Raise ArtifactError naming the first `model` field of a schema-checked manifest that differs
    from graph.json's or plan.json's meta, or from the shapes of the plan's attention steps."""
    model = manifest["model"]
    for other, name in ((graph, "graph.json"), (plan, "plan.json")):
        meta = other.get("meta") if isinstance(other, dict) else None
        if not isinstance(meta, dict):
            raise ArtifactError(f"{where}: {name} has no meta table; {RECOMPILE}")
        for key in sorted(set(model) - SOURCE_ONLY):
            _agree(f"model.{key}", model[key], meta.get(key, "missing"), name, where)
    _agree("target.name", manifest["target"]["name"], plan.get("target", "missing"), "plan.json", where)
    shapes = plan_shapes(plan, where)
    if (manifest.get("parallel") or {}).get("pp", 1) > 1 and plan.get("outputs") != ["logits"]:
        del shapes["vocab_size"]  # a pipeline stage before the last sends hidden states on, not logits
    for field, value in shapes.items():
        _agree(f"model.{field}", model[field], value, "plan.json's steps", where)
    kv = model["kv_cache"]["dtype"]
    _agree("model.kv_dtype", model["kv_dtype"], kv, "model.kv_cache.dtype", where)
    per_head = kv_cache_head_bytes(model["kv_cache"], model["head_dim"])
    _agree("model.kv_bytes_per_token", model["kv_bytes_per_token"], 2 * model["num_layers"] * model["num_kv_heads"]
           * per_head, "2 x num_layers x num_kv_heads x one head's bytes", where)
    _agree("report.kv_bytes_per_token", manifest["report"]["kv_bytes_per_token"], model["kv_bytes_per_token"],
           "model.kv_bytes_per_token", where)
    ids = model["eos_token_ids"] + ([model["bos_token_id"]] if model["bos_token_id"] is not None else [])
    if any(i >= model["vocab_size"] for i in ids):
        raise ArtifactError(f"{where}: manifest.json model.eos_token_ids/bos_token_id {ids} lie outside the "
                            f"vocabulary of {model['vocab_size']}; {RECOMPILE}")


def plan_shapes(plan: dict, where: str) -> dict[str, Any]:
    """num_layers, num_heads, num_kv_heads and head_dim as the plan's attention steps have them,
    and vocab_size as its logits output has it."""
    steps = plan.get("steps")
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise ArtifactError(f"{where}: plan.json has no list of steps; {RECOMPILE}")
    attention = [s for s in steps if str(s.get("kernel", "")).rpartition(".")[2] in ATTENTION_OPS]
    shapes: dict[str, Any] = {"num_layers": len(attention)}
    for key in ("num_heads", "num_kv_heads", "head_dim"):
        values = {json.dumps((s.get("attrs") or {}).get(key)) for s in attention if isinstance(s.get("attrs"), dict)}
        if len(values) == 1:
            shapes[key] = json.loads(values.pop())
        elif values:
            raise ArtifactError(f"{where}: plan.json's attention steps differ in {key} ({sorted(values)}); "
                                f"{RECOMPILE}")
    try:
        shapes["vocab_size"] = plan["types"][plan["outputs"][0]]["shape"][-1]
    except (KeyError, IndexError, TypeError):
        raise ArtifactError(f"{where}: plan.json does not give its output's type; {RECOMPILE}") from None
    return shapes


def _agree(field: str, ours: Any, theirs: Any, source: str, where: str) -> None:
    # JSON-exact: 2 and 2.0 and true differ
    if json.dumps(ours, sort_keys=True) != json.dumps(theirs, sort_keys=True):
        raise ArtifactError(f"{where}: manifest.json {field} is {_short(ours)} but {source} says "
                            f"{_short(theirs)}; {RECOMPILE}")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."
