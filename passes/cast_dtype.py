"""`cast_bf16`: run a float32 graph in a 16-bit activation dtype (bfloat16 or float16). float32
weights are stored in that dtype, every activation is retyped to it, and `cast` nodes go where
a value must change precision: into fp32-only inputs, around aten fallbacks, and on the logits.

What stays float32, and why:
- quantisation scales, zero points and activation scales (qlinear/qembedding inputs, and every
  param a QuantScheme names): the dequantising kernels read them as fp32;
- rotary inv_freq (rope / flash_attention input): angles position * inv_freq need fp32 to stay
  exact at long positions, as HF keeps inv_freq fp32 in bf16 models;
- KV-cache scales (an attention op's last input when it has a `kv_cache` dtype) and unused params;
- aten fallbacks keep their fp32 semantics: their float inputs are cast up, results cast down;
- the graph outputs (logits): cast back to fp32 for the sampler and log-probabilities;
- what a pipeline stage sends (hidden states, logits): the receiving rank's recv, typed when the
  model was cut into stages, takes float32.
RMSNorm weights are cast: HF Llama multiplies them in the activation dtype (`weight *
h.to(dtype)`, the rms_norm reference), so a bf16 weight keeps that op's result in bf16; the
normalisation itself still runs in fp32 inside the op."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.artifact import view_key
from llmc.compiler.ir import Graph, Node, TensorType, Value
from llmc.compiler.ops import TORCH_DTYPES, infer_types
from llmc.compiler.schemes import kv_format
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.options import PassOptions, option

CAST_DTYPES = ("bfloat16", "float16")
# The float dtypes activations move between; fp8 and integer values are never touched.
FLOAT_DTYPES = {"float32", "bfloat16", "float16"}
# Each op's inputs that must stay float32: these indices, and (FP32_INPUTS_FROM) every index from one on.
FP32_INPUTS = {"rope": {2}, "flash_attention": {4}, "send": {0}}
FP32_INPUTS_FROM = {"qlinear": 2, "qembedding": 1}


def quant_param_slot(node: Node, index: int) -> bool:
    """Whether input `index` of `node` is a quantisation param (scales, zero points, activation scales)."""
    start = FP32_INPUTS_FROM.get(node.op)
    return start is not None and index >= start


def fp32_slot(node: Node, index: int) -> bool:
    """Whether input `index` of `node` must be float32."""
    if node.op == "aten":
        return True
    if node.attrs.get("kv_cache") and kv_format(node.attrs["kv_cache"]).static and index == len(node.inputs) - 1:
        return True   # a calibrated KV cache's scales
    return index in FP32_INPUTS.get(node.op, ()) or quant_param_slot(node, index)


def kept_params(graph: Graph) -> set[str]:
    """Params that stay float32: read by an fp32 input, named as quantisation scales or zeros,
    KV-cache scales, or read by no node at all."""
    kept = {name for p in graph.params.values() if p.quant for name in (p.quant.scales, p.quant.zeros) if name}
    read = set()
    for node in graph.nodes:
        for k, name in enumerate(node.inputs):
            read.add(name)
            if fp32_slot(node, k):
                kept.add(name)
    return kept | (set(graph.params) - read)


def wanted_dtype(node: Node, index: int, current: str, dtype: str) -> str:
    """The float dtype input `index` of `node` should arrive in (`current` for non-floats and
    for `cast` nodes, which take anything)."""
    if current not in FLOAT_DTYPES or node.op == "cast":
        return current
    if quant_param_slot(node, index):
        return current   # kept as stored, never cast down (a GGUF's fp16 scales are read as fp16)
    return "float32" if fp32_slot(node, index) else dtype


@register_pass
class CastDtype(Pass):
    name = "cast_bf16"
    description = ("store float32 weights and run activations in bfloat16 (or float16), keeping "
                   "quant scales, rotary inv_freq, aten fallbacks and the logits in float32")
    # Not metered: bf16 storage costs ~0.2% calibration perplexity on SmolLM2, and measuring it
    # would make every bf16 compile generate calibration text (~90 s); `llmc eval --ref` measures it.
    stage = Stage.CAST
    needs = ("target",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        dtype: str | None = option(None, "16-bit dtype (default: the target's activation dtype when 16-bit, "
                                         "else bfloat16)", choices=CAST_DTYPES)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        dtype = self.resolve_dtype(ctx)
        cast, saved = cast_params(graph, dtype)
        inserted = retype_nodes(graph, dtype)
        inserted += restore_outputs(graph)
        kept = sum(p.type.dtype == "float32" for p in graph.params.values())
        details = {"dtype": dtype, "params_cast": cast, "params_kept_fp32": kept, "casts_inserted": inserted}
        return PassResult(cast + inserted, bool(cast or inserted), details, bytes_saved=saved)

    def resolve_dtype(self, ctx: PassContext) -> str:
        if self.options.dtype is not None:
            return self.options.dtype
        target_dtype = getattr(ctx.target, "activation_ir_dtype", None)
        return target_dtype if target_dtype in CAST_DTYPES else "bfloat16"


def cast_params(graph: Graph, dtype: str) -> tuple[int, int]:
    """Store every float32 param outside kept_params in `dtype`: (params cast, bytes saved).
    Params sharing one tensor (a tied embedding and LM head) keep sharing its cast copy."""
    kept = kept_params(graph)
    copies: dict[tuple, object] = {}
    count = saved = 0
    for name, p in graph.params.items():
        if p.type.dtype != "float32" or name in kept:
            continue
        new_type = TensorType(p.type.shape, dtype)
        key = view_key(name, graph.weights.entry(name)) if name in graph.weights else (name,)
        if key not in copies:
            copies[key] = cast_weight(graph, name, TORCH_DTYPES[dtype]) if name in graph.weights else None
            saved += p.type.nbytes() - new_type.nbytes()
        if name in graph.weights:
            graph.weights[name] = copies[key]
        p.type = new_type
        count += 1
    return count, saved


def cast_weight(graph: Graph, name: str, dtype):
    """The weight in `dtype`: a tensor now, or lazily cast when its values are not made yet."""
    return graph.weights.derive([name], lambda values: values[0].to(dtype), graph.params[name].type.shape, dtype)


def retype_nodes(graph: Graph, dtype: str) -> int:
    """Give each node inputs of the dtype it wants (inserting casts, one per value and dtype)
    and the output types its op's rule infers from them. Returns the casts inserted."""
    types = {v.name: v.type for v in graph.inputs} | {p.name: p.type for p in graph.params.values()}
    casts: dict[tuple[str, str], str] = {}
    nodes: list[Node] = []
    for node in graph.nodes:
        for k, name in enumerate(node.inputs):
            want = wanted_dtype(node, k, types[name].dtype, dtype)
            if want != types[name].dtype:
                if (name, want) not in casts:
                    cast = make_cast(graph, name, types[name], want)
                    nodes.append(cast)
                    types[cast.out.name] = cast.out.type
                    casts[(name, want)] = cast.out.name
                node.inputs[k] = casts[(name, want)]
        inferred = infer_types(node, [types[i] for i in node.inputs])
        for k, value in enumerate(node.outputs):
            if inferred is not None:
                value.type = inferred[k]
            types[value.name] = value.type
        nodes.append(node)
    graph.nodes = nodes
    return len(casts)


def make_cast(graph: Graph, source: str, source_type: TensorType, dtype: str, name: str | None = None) -> Node:
    """A cast node reading `source`; its output is called `name` (default: a fresh name)."""
    node_name = graph.fresh("cast")
    return Node(node_name, "cast", [source], [Value(name or node_name, TensorType(source_type.shape, dtype))],
                {"dtype": dtype})


def restore_outputs(graph: Graph) -> int:
    """Cast 16-bit graph outputs back to float32 under their own names, so the runtime still
    reads `logits` as fp32; the value feeding the cast gets a fresh name."""
    producers = graph.producers()
    count = 0
    for name in list(graph.outputs):
        node = producers.get(name)
        value = next((v for v in node.outputs if v.name == name), None) if node else None
        if value is None or value.type.dtype not in FLOAT_DTYPES - {"float32"}:
            continue
        value.name = graph.fresh(f"{name}_{value.type.dtype}")
        for user in graph.nodes:
            user.inputs = [value.name if i == name else i for i in user.inputs]
        graph.nodes.append(make_cast(graph, value.name, value.type, "float32", name=name))
        count += 1
    return count


__all__ = ["CastDtype", "CAST_DTYPES", "kept_params"]
