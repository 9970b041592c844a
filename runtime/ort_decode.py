"""Runs a plan's decode graph (codegen/ort/ort_decode.py): a decode-only step's whole forward as one
ONNX Runtime run over the paged KV cache, whose per-layer tensors are bound as inputs without a
copy; the step's new keys and values come back stacked over layers and are written into the cache
with one copy each."""

from __future__ import annotations

import torch

from llmc.codegen.ort.onnx_weights import TRANSFORMS
from llmc.codegen.ort.ort_decode import BLOCK_TABLES, NEW_KEYS, NEW_VALUES, cache_inputs
from llmc.codegen.plan import RECOMPILE
from llmc.compiler.ir import TensorType
from llmc.errors import ArtifactError
from llmc.runtime.ort_segment import load_session
from llmc.runtime.paged_attention import PagedKVCache, StepMetadata

RECORD_FIELDS = {"file": str, "sha256": str, "initializers": dict, "inputs": list, "outputs": list,
                 "num_layers": int, "num_kv_heads": int, "head_dim": int}


class DecodeGraph:
    """Callable on a decode-only step: (inputs by plan input name, its metadata, the cache) -> the
    plan's logits, the cache holding the step's keys and values afterwards."""

    def __init__(self, record: dict, plan, data: dict[str, bytes], weights: dict[str, torch.Tensor],
                 made: dict | None = None):
        where = "plan.json meta.decode_graph"
        check_record(record, plan, where)
        self.num_layers = layers = record["num_layers"]
        kv, hd = record["num_kv_heads"], record["head_dim"]
        self.plan_inputs = list(record["inputs"])
        inputs = [(name, plan.type_of(name)) for name in self.plan_inputs]
        inputs.append((BLOCK_TABLES, TensorType(("tokens", "blocks"), "int64")))
        inputs += [(name, TensorType(("cache_blocks", "block_size", kv, hd), "float32"))
                   for name in cache_inputs(layers)]
        outputs = [(name, plan.type_of(name)) for name in record["outputs"]]
        outputs += [(name, TensorType((layers, "tokens", kv, hd), "float32")) for name in (NEW_KEYS, NEW_VALUES)]
        self.session = load_session(record, inputs, outputs, data, weights, where, spin=True, made=made)
        outs = record["outputs"]
        self._logits = outs.index("logits") if "logits" in outs else 0   # the output the runner samples
        # decode steps the native decode program takes run it instead (codegen/ort/ort_decode.py)
        self.native_first = record.get("native_first", False)

    def serves(self, meta: StepMetadata, cache: PagedKVCache) -> bool:
        """Whether this step is one the graph computes: decodes only, over an unquantised fp32
        cache with a layer tensor each."""
        return (not meta.prefills and meta.decode_rows is not None and not cache.quantized
                and cache.dtype == torch.float32 and len(cache.k_cache) == self.num_layers)

    def __call__(self, inputs: dict[str, torch.Tensor], meta: StepMetadata,
                 cache: PagedKVCache) -> torch.Tensor:
        values = [inputs[name] for name in self.plan_inputs]
        values.append(meta.decode_blocks)
        *outs, new_keys, new_values = self.session(*values, *cache.k_cache, *cache.v_cache)
        cache.write_layers(meta.slot_mapping, new_keys, new_values)
        return outs[self._logits]


def check_record(record, plan, where: str) -> None:
    """plan.meta["decode_graph"] is untrusted data: its fields must have their types, read the plan's
    own inputs and give its outputs, and make initializers from plan params by transforms of this llmc."""
    bad = [k for k, t in RECORD_FIELDS.items() if not isinstance(record.get(k), t)]
    bad += [] if isinstance(record.get("native_first", False), bool) else ["native_first"]
    if bad:
        raise ArtifactError(f"{where}: field {bad[0]!r} is missing or not a "
                            f"{RECORD_FIELDS.get(bad[0], bool).__name__}; {RECOMPILE}")
    if record["inputs"] != plan.inputs or record["outputs"] != plan.outputs:
        raise ArtifactError(f"{where}: reads {record['inputs']} and gives {record['outputs']}, not the plan's "
                            f"inputs {plan.inputs} and outputs {plan.outputs}; {RECOMPILE}")
    layout = plan.kv_layout()
    if (record["num_layers"], record["num_kv_heads"], record["head_dim"]) != (
            layout["num_layers"], layout["num_kv_heads"], layout["head_dim"]):
        raise ArtifactError(f"{where}: its KV layout differs from the plan's attention layers ({layout}); {RECOMPILE}")
    for name, source in record["initializers"].items():
        if (not isinstance(source, list) or len(source) != 2 or source[0] not in plan.params
                or source[1] not in TRANSFORMS):
            raise ArtifactError(f"{where}: initializer {name!r} is made from {source!r:.80}: not a plan param "
                                f"and a transform of this llmc ({', '.join(TRANSFORMS)}); {RECOMPILE}")


def load_decode_graph(plan, data: dict[str, bytes], weights: dict[str, torch.Tensor],
                      made: dict | None = None) -> DecodeGraph | None:
    """The plan's decode graph, or None when its compile chose none (`made`: see load_session)."""
    record = plan.meta.get("decode_graph")
    if record is None or (isinstance(record, dict) and record.get("chosen") is False):
        return None
    if not isinstance(record, dict) or record.get("chosen") is not True:
        raise ArtifactError(f"plan.json meta.decode_graph: {record!r:.80} is no decode-graph record; {RECOMPILE}")
    return DecodeGraph(record, plan, data, weights, made)


__all__ = ["DecodeGraph", "load_decode_graph", "check_record"]
