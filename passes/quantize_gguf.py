"""`keep_gguf_quant` (`--quant gguf`, the cpu targets' default for GGUF sources): each linear and embedding
whose weight a GGUF file stores in a block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K) becomes a qlinear / qembedding over that format's own codes, scales and minimums, as the
grouped-affine schemes affine4 / affine8 (compiler/quant.py, docs/quantization.md): no second
rounding, and the stored weights dequantise to exactly the file's values.

For other kernel families: an affine4 qlinear's params are `<w>.qweight` uint8 [N, K/2] (codes
0..15, the low nibble holds the even k), `<w>.scales` float16/float32 [N, K/g] and, when
`has_zeros`, `<w>.zeros` [N, K/g] holding the float minimum m: w = q·s + m; without zeros
w = (q − 8)·s. affine8 stores int8 codes [N, K] with w = q·s (+ m). Attrs: scheme, group_size
(16 for Q6_K, else 32), in_features, out_features, has_zeros, has_bias. The qweight's QuantScheme
method names the source format ("gguf:Q4_1").

An ONNX model's MatMulNBits weights with zero points come as the int4 scheme (compiler/quant.py:
w = (q - z)·s, its `zeros` the integer zero points), kept by this pass the same way."""

from __future__ import annotations

from collections import Counter

import torch

from llmc.compiler.frontends.gguf_dequant import AffineWeight, LazyBlocks
from llmc.compiler.ir import Graph, Node
from llmc.compiler.quant import dequantize_affine, dequantize_int4, unpack_int4
from llmc.compiler.schemes import SCHEMES
from llmc.compiler.weight_store import LazyTensor
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.quantize import (
    FLOAT_DTYPES,
    WeightFormat,
    add_quant_params,
    param_bytes,
    quant_param_names,
    quantize_linear_weights,
)

METHOD_PREFIX = "gguf:"
CHANGED = "changed by an earlier pass (kept in float)"


def weight_format(stored) -> WeightFormat:
    """The format a source weight (a GGUF AffineWeight, or an ONNX int4 weight with zero points) is stored in."""
    if stored.scheme == "int4":
        return WeightFormat("int4", METHOD_PREFIX + stored.format, 4, stored.group_size, symmetric=False)
    return WeightFormat(stored.scheme, METHOD_PREFIX + stored.format, SCHEMES[stored.scheme].bits,
                        stored.group_size, symmetric=stored.symmetric)


def stored_parts(stored) -> tuple:
    """(codes, scales, minimums or zero points) as add_quant_params takes them (it packs int4 codes itself)."""
    if stored.scheme == "int4":
        return unpack_int4(stored.qweight), stored.scales, stored.zeros
    return stored.qweight, stored.scales, stored.mins


def stored_values(stored) -> torch.Tensor:
    if stored.scheme == "int4":
        return dequantize_int4(stored.qweight, stored.scales, stored.zeros)
    return dequantize_affine(stored.scheme, stored.qweight, stored.scales, stored.mins)


def keep_reason(graph: Graph, weight: str, stored) -> str | None:
    """Why `weight` cannot take its stored form (None when it can): an earlier pass (pruning, KV
    head conversion) changed its values, or it is no longer a float param."""
    param = graph.params.get(weight)
    if param is None or param.quant or weight not in graph.weights or param.type.dtype not in FLOAT_DTYPES:
        return "weight is not a float param"
    if isinstance(stored, LazyBlocks):
        if graph.weights.entry(weight) is stored.values:
            return None   # the source's own values, untouched by any pass
        stored = stored.load()
    values = graph.weights[weight]
    decoded = stored_values(stored)
    if tuple(values.shape) != tuple(decoded.shape) or not torch.equal(values.float(), decoded):
        return CHANGED
    return None


def keep_embedding(graph: Graph, node: Node, stored) -> tuple[int, int]:
    """Rewrite the embedding `node` into a qembedding over the stored params (added once).
    Returns (bytes of the float table, bytes of the params added); (0, 0) when already stored."""
    ids, weight = node.inputs
    names = quant_param_names(weight)
    before = after = 0
    if names["qweight"] not in graph.params:
        before = graph.params[weight].type.nbytes()
        after = add_quant_params(graph, weight, weight_format(stored), stored.qweight, stored.scales,
                                 stored.mins, None)
    has_mins = stored.mins is not None
    node.op = "qembedding"
    node.inputs = [ids, names["qweight"], names["scales"]] + ([names["zeros"]] if has_mins else [])
    node.attrs = {"scheme": stored.scheme, "group_size": stored.group_size,
                  "embedding_dim": graph.params[weight].type.shape[1], "has_zeros": has_mins}
    return before, after


def keep_stored(graph: Graph, node: Node, stored, ctx: PassContext) -> tuple[int, int]:
    """Rewrite the linear or embedding `node` over its stored form; (float bytes, stored bytes)."""
    if isinstance(stored, LazyBlocks):
        stored = lazy_parts(stored)
    if node.op == "embedding":
        return keep_embedding(graph, node, stored)
    return quantize_linear_weights(graph, node, None, ctx, weight_format(stored), parts=stored_parts(stored))


def lazy_parts(blocks: LazyBlocks) -> AffineWeight:
    """The weight's affine parts as lazy tensors, each decoded from the file when written. One
    decode now learns their dtypes (scales are float16 where that holds them exactly)."""
    probe = blocks.load()

    def part(key: str) -> LazyTensor | None:
        made = getattr(probe, key)
        return None if made is None else LazyTensor(tuple(made.shape), made.dtype,
                                                    lambda: getattr(blocks.load(), key))

    return probe._replace(qweight=part("qweight"), scales=part("scales"), mins=part("mins"))


@register_pass
class KeepGgufQuant(Pass):
    name = "keep_gguf_quant"
    description = ("keep a GGUF file's block-quantised weights as they are (affine4/affine8 codes, "
                   "scales and minimums; bit-identical to the file)")
    stage = Stage.QUANTIZE
    needs = ("source_weights",)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        stored = ctx.source_weights
        if not stored:
            raise PassError("keep_gguf_quant (--quant gguf) keeps the quantised weights of a GGUF file, but "
                            "this source stores none; compile a GGUF file with Q4/Q5/Q8/K-quant tensors, or "
                            "choose another --quant")
        total = param_bytes(graph)
        kept, skipped, before, after = Counter(), {}, 0, 0
        for node in [n for n in graph.nodes if n.op in ("linear", "embedding")]:
            weight = node.inputs[1]
            if weight not in stored:
                continue
            reason = keep_reason(graph, weight, stored[weight])
            if reason is not None:
                skipped.setdefault(reason, []).append(weight)
                continue
            kept[node.op] += 1
            b, a = keep_stored(graph, node, stored[weight], ctx)
            before, after = before + b, after + a
        graph.prune_params()
        self.note_skipped(ctx, skipped)
        figures = {"method": "gguf", "group_size": None, "linears": kept["linear"], "embeddings": kept["embedding"],
                   "kept_linears": sum(len(w) for w in skipped.values()), "bytes_before": before,
                   "bytes_after": after, "formats": source_formats(graph)}
        return PassResult(sum(kept.values()), bool(kept), {"quant": {"gguf": figures}, "skipped": skipped},
                          bytes_saved=total - param_bytes(graph))

    def note_skipped(self, ctx: PassContext, skipped: dict[str, list[str]]) -> None:
        for reason, weights in skipped.items():
            if not ctx.quiet:
                ctx.echo(f"{self.name}: {len(weights)} GGUF-quantised weight(s) {reason}: {', '.join(weights[:3])}"
                         + (f" and {len(weights) - 3} more" if len(weights) > 3 else ""))


def source_formats(graph: Graph) -> dict[str, str]:
    """Each stored param's source format, by weight name (from its QuantScheme's method)."""
    return {name.removesuffix(".qweight"): p.quant.method.removeprefix(METHOD_PREFIX)
            for name, p in sorted(graph.params.items())
            if p.quant is not None and p.quant.method.startswith(METHOD_PREFIX)}


__all__ = ["KeepGgufQuant", "METHOD_PREFIX", "weight_format", "source_formats"]
