"""Weight-only quantisation passes: `quantize_int8` (per output channel, symmetric) and
`quantize_int4` (groups along K, asymmetric, by RTN, GPTQ or AWQ) rewrite each linear over a
float weight into a qlinear over stored codes, scales and zero points, and each embedding into a
qembedding over the same storage (docs/quantization.md); a mixture of experts' expert weights are
stored the same way, per expert (passes/quantize_moe.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatch
from typing import Callable

import torch

from llmc.compiler.ir import Graph, Node, QuantScheme, TensorType
from llmc.compiler.ops import DTYPE_NAMES
from llmc.compiler.quant import pack_int4, quantize_int4, quantize_int8
from llmc.compiler.schemes import SCHEMES
from llmc.compiler.weight_store import as_dtype, as_lazy, contiguous
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.options import PassOptions, option
from llmc.passes.quantize_calibrated import awq_method, gptq_method
from llmc.passes.quantize_moe import quantize_experts

# method_fn(weight fp32 [N, K], ctx, node) -> (codes, scales, zeros or None); int4 codes are
# unpacked uint8 [N, K] in 0..15, int8 codes int8 [N, K]. A method whose `reads_weight` is False
# made its codes ahead and is handed None (the source weight is not read again for it).
WeightQuantizer = Callable[[torch.Tensor, PassContext, Node], tuple]

FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
# What the CPU int4 kernel (torch._weight_int4pack_mm_for_cpu) accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_METHODS = ("rtn", "gptq", "awq")


@dataclass(frozen=True)
class WeightFormat:
    """How a pass stores its weights: the qlinear scheme and the QuantScheme recorded on them."""
    scheme: str             # a row of compiler/schemes.py
    method: str             # "rtn", "gptq", "awq", "fp8", "smoothquant"
    bits: int
    group_size: int = -1    # -1: one scale per output channel
    symmetric: bool = True


def lm_head_weights(graph: Graph) -> set[str]:
    """Weights of linears that produce a graph output (the logits), and weights an embedding
    also reads (tied heads)."""
    outputs = set(graph.outputs)
    heads = {n.inputs[1] for n in graph.nodes if n.op == "linear" and n.out.name in outputs}
    return heads | {n.inputs[1] for n in graph.nodes if n.op == "embedding"}


def skip_reason(graph: Graph, node: Node, include_lm_head: bool, skip: list[str],
                heads: set[str]) -> str | None:
    """Why `node` (a linear) keeps its float weight, or None when it can be quantised."""
    weight = node.inputs[1]
    param = graph.params.get(weight)
    if param is None or param.quant or weight not in graph.weights:
        return "weight is not a stored param"
    t = param.type
    if t.rank != 2 or t.dtype not in FLOAT_DTYPES or not all(isinstance(d, int) for d in t.shape):
        return "weight is not a 2-D float tensor"
    if weight in heads and not include_lm_head:
        return "lm_head (kept in full precision; include_lm_head=true quantises it)"
    if any(fnmatch(weight, pattern) for pattern in skip):
        return "matches a skip pattern"
    return None


def select_linears(graph: Graph, include_lm_head: bool, skip: list[str],
                   check: Callable[[Node], str | None] = lambda node: None
                   ) -> tuple[list[Node], dict[str, list[str]]]:
    """(linears to quantise, {reason: weight names} of those left alone); `check` adds a
    format's own reasons (a group size that does not divide K)."""
    refuse_expert_weights(graph)
    heads = lm_head_weights(graph)
    chosen, skipped = [], {}
    for node in graph.nodes:
        if node.op != "linear":
            continue
        reason = skip_reason(graph, node, include_lm_head, skip, heads) or check(node)
        if reason is None:
            chosen.append(node)
        else:
            skipped.setdefault(reason, []).append(node.inputs[1])
    return chosen, skipped


def refuse_expert_weights(graph: Graph) -> None:
    """Only int8 and int4 store expert weights (quantize_int8/int4 turn each moe into a qmoe first):
    under any other format a `moe` op's experts would silently stay float."""
    moe = next((n for n in graph.nodes if n.op == "moe"), None)
    if moe is not None:
        raise PassError(f"node {moe.name} (moe): this weight format covers linears, not a mixture of experts' "
                        f"expert weights, which would stay in float; use --quant int8 or int4, or none")


def quant_param_names(weight: str) -> dict[str, str]:
    return {k: f"{weight}.{k}" for k in ("qweight", "scales", "zeros", "act_scale")}


def quantize_linear_weights(graph: Graph, node: Node, method_fn: WeightQuantizer | None, ctx: PassContext,
                            fmt: WeightFormat, act_scale: torch.Tensor | None = None,
                            parts: tuple | None = None) -> tuple[int, int]:
    """Rewrite the linear `node` into a qlinear in place, storing its weight as `fmt` through
    `method_fn` or as the given (codes, scales, zeros) `parts` (once per weight: linears sharing a
    weight share the stored params). Returns (bytes of the float weight, bytes of the params
    added); (0, 0) when already stored."""
    x, weight, *bias = node.inputs
    names = quant_param_names(weight)
    before = after = 0
    if names["qweight"] not in graph.params:
        before = graph.params[weight].type.nbytes()
        if parts is None:   # a method that made its codes ahead (GPTQ, AWQ) is not handed the float weight
            values = graph.weights[weight].float() if getattr(method_fn, "reads_weight", True) else None
            parts = method_fn(values, ctx, node)
        codes, scales, zeros = parts
        after = add_quant_params(graph, weight, fmt, codes, scales, zeros, act_scale)
    k, n = graph.params[weight].type.shape[1], graph.params[weight].type.shape[0]
    has_zeros, has_act = names["zeros"] in graph.params, names["act_scale"] in graph.params
    node.op = "qlinear"
    node.inputs = ([x, names["qweight"], names["scales"]] + ([names["zeros"]] if has_zeros else [])
                   + ([names["act_scale"]] if has_act else []) + bias)
    node.attrs = {"scheme": fmt.scheme, "group_size": fmt.group_size, "in_features": k,
                  "out_features": n, "has_zeros": has_zeros, "has_act_scale": has_act,
                  "has_bias": bool(bias)}
    return before, after


def add_quant_params(graph: Graph, weight: str, fmt: WeightFormat, codes: torch.Tensor,
                     scales: torch.Tensor, zeros: torch.Tensor | None,
                     act_scale: torch.Tensor | None) -> int:
    """Add `<weight>.qweight/.scales[/.zeros][/.act_scale]`; returns their bytes."""
    names = quant_param_names(weight)
    row = SCHEMES[fmt.scheme]
    stored = pack_int4(codes) if row.packed and not row.gguf else codes   # a GGUF's blocks come packed
    want = SCHEMES[fmt.scheme].code_dtype
    if DTYPE_NAMES[stored.dtype] != want:
        raise PassError(f"quantising {weight}: the {fmt.method} method gave {stored.dtype} codes, "
                        f"the {fmt.scheme} format stores {want}")
    # float16 scales stay so (GGUF's own, kept exactly), K-quant packed ones too (compiler/quant.py's
    # pack_k_params); every other scale is stored as float32
    scales = scales if scales.dtype in (torch.float16, torch.uint8) else as_dtype(scales, torch.float32)
    tensors = {"qweight": stored, "scales": scales, "zeros": zeros, "act_scale": act_scale}
    tensors = {k: contiguous(t) for k, t in tensors.items() if t is not None}
    scheme = QuantScheme(fmt.method, fmt.bits, fmt.group_size, fmt.symmetric, names["scales"],
                         names["zeros"] if zeros is not None else "", graph.params[weight].type.dtype)
    for key, tensor in tensors.items():
        t = TensorType(tuple(tensor.shape), DTYPE_NAMES[tensor.dtype])
        graph.add_param(names[key], t, tensor, quant=scheme if key == "qweight" else None)
    return sum(as_lazy(t).nbytes for t in tensors.values())


# -- embeddings: the token table, and the LM head when it is tied to it ----------------------
@dataclass
class EmbeddingPlan:
    """The embeddings a pass quantises, each table's group size (-1: per row), the linears that
    read one of those tables (tied LM heads, which share its params), and tables kept in float."""
    nodes: list[Node]
    group_sizes: dict[str, int]
    heads: list[Node]
    skipped: dict[str, list[str]]


def plan_embeddings(graph: Graph, options: dict,
                    group_of: Callable[[int], int | None] | None = None) -> EmbeddingPlan:
    """Embeddings to quantise when options.include_embedding; group_of(embedding_dim) is the
    int4 group size (None: none divides), absent for per-row int8."""
    plan = EmbeddingPlan([], {}, [], {})
    if not options.include_embedding:
        return plan
    for node in (n for n in graph.nodes if n.op == "embedding"):
        weight = node.inputs[1]
        reason = (skip_reason(graph, node, True, options.skip, set())
                  or (None if node.out.type.dtype == "float32" else "output is not float32"))
        group = -1
        if reason is None and group_of is not None:
            dim = graph.params[weight].type.shape[1]
            group = group_of(dim)
            reason = None if group else f"embedding_dim {dim} is not a multiple of a usable int4 group size"
        if reason is None:
            plan.nodes.append(node)
            plan.group_sizes[weight] = group
        else:
            plan.skipped.setdefault(reason, []).append(weight)
    if options.include_lm_head is not False:
        plan.heads = [n for n in graph.nodes if n.op == "linear" and n.inputs[1] in plan.group_sizes]
    return plan


def select_weights(p: Pass, graph: Graph, check: Callable[[Node], str | None] = lambda node: None,
                   group_of: Callable[[int], int | None] | None = None
                   ) -> tuple[list[Node], dict[str, list[str]], EmbeddingPlan]:
    """The linears and embeddings an int8/int4 pass quantises. include_lm_head=None (the
    default) quantises the LM head only when it is tied to a quantised embedding: it then reads
    the embedding's params, so it leaves the linears quantised on their own."""
    plan = plan_embeddings(graph, p.options, group_of)
    nodes, skipped = select_linears(graph, p.options.include_lm_head is True, p.options.skip, check)
    tied = {n.inputs[1] for n in plan.heads}
    nodes = [n for n in nodes if n.inputs[1] not in tied]
    skipped = {reason: kept for reason, weights in skipped.items()
               if (kept := [w for w in weights if w not in tied])}
    return nodes, skipped, plan


def rtn_table(weight: torch.Tensor, fmt: WeightFormat) -> tuple:
    """Round-to-nearest codes of an embedding table [vocab, dim], rows as output channels."""
    if SCHEMES[fmt.scheme].grouped:
        return quantize_int4(weight, fmt.group_size)
    q, scales = quantize_int8(weight)
    return q, scales, None


def quantize_embedding(graph: Graph, node: Node, fmt: WeightFormat) -> tuple[int, int]:
    """Rewrite the embedding `node` into a qembedding over RTN codes of its table (GPTQ and AWQ
    model a product with activations, which a row lookup does not have). Returns (bytes of the
    float table, bytes of the params added); (0, 0) when already stored."""
    ids, weight = node.inputs
    names = quant_param_names(weight)
    before = after = 0
    if names["qweight"] not in graph.params:
        before = graph.params[weight].type.nbytes()
        codes, scales, zeros = rtn_table(graph.weights[weight].float(), fmt)
        after = add_quant_params(graph, weight, fmt, codes, scales, zeros, None)
    node.op = "qembedding"
    zeros = [names["zeros"]] if SCHEMES[fmt.scheme].zeros_required else []
    node.inputs = [ids, names["qweight"], names["scales"]] + zeros
    node.attrs = {"scheme": fmt.scheme, "group_size": fmt.group_size,
                  "embedding_dim": graph.params[weight].type.shape[1]}
    return before, after


def quantize_embeddings(graph: Graph, ctx: PassContext, fmt: WeightFormat, plan: EmbeddingPlan) -> tuple[int, int]:
    """Quantise the planned tables, then point each tied head's qlinear at the same params (so
    they are stored once). Returns (float bytes, quantised bytes)."""
    before = after = 0
    for node in plan.nodes:
        b, a = quantize_embedding(graph, node, replace(fmt, method="rtn", group_size=plan.group_sizes[node.inputs[1]]))
        before, after = before + b, after + a
    for head in plan.heads:
        head_fmt = replace(fmt, method="rtn", group_size=plan.group_sizes[head.inputs[1]])
        # the params exist already, so no quantiser is called
        quantize_linear_weights(graph, head, None, ctx, head_fmt)
    return before, after


def param_bytes(graph: Graph) -> int:
    return sum(p.type.nbytes() for p in graph.params.values()
               if all(isinstance(d, int) for d in p.type.shape))


def quantize_linears(p: Pass, graph: Graph, ctx: PassContext, fmt: WeightFormat,
                     nodes: list[Node], skipped: dict[str, list[str]], method_fn: WeightQuantizer,
                     group_sizes: dict[str, int] | None = None,
                     embeddings: EmbeddingPlan | None = None) -> PassResult:
    """Quantise `embeddings` (with their tied heads) by RTN and `nodes` with `method_fn`, prune
    the float weights, and report the bytes; `group_sizes` overrides fmt's group size per node name."""
    total_before = param_bytes(graph)
    before, after = quantize_embeddings(graph, ctx, fmt, embeddings) if embeddings else (0, 0)
    used: dict[str, int] = {}
    for node in nodes:
        node_fmt = replace(fmt, group_size=(group_sizes or {}).get(node.name, fmt.group_size))
        b, a = quantize_linear_weights(graph, node, method_fn, ctx, node_fmt)
        before, after = before + b, after + a
        used[str(node_fmt.group_size)] = used.get(str(node_fmt.group_size), 0) + 1
    graph.prune_params()
    report_skipped(p, ctx, skipped)
    figures = {"method": fmt.method, "bits": fmt.bits, "group_size": fmt.group_size,
               "linears": len(nodes), "bytes_before": before, "bytes_after": after,
               "kept_linears": sum(len(v) for v in skipped.values()),
               "linears_by_group_size": dict(sorted(used.items(), key=lambda kv: int(kv[0])))}
    details = {"quant": {fmt.scheme: figures}, "skipped": skipped}
    if embeddings is not None:
        figures.update(embeddings=len(embeddings.nodes), tied_heads=len(embeddings.heads))
        if embeddings.skipped:
            details["kept_embeddings"] = embeddings.skipped
    return PassResult(len(nodes), bool(nodes), details, bytes_saved=total_before - param_bytes(graph))


def report_skipped(p: Pass, ctx: PassContext, skipped: dict[str, list[str]]) -> None:
    """Say which linears stay in float for a reason the user may not expect."""
    for reason, weights in skipped.items():
        if reason.startswith(("lm_head", "matches a skip")) or ctx.quiet:
            continue
        shown = ", ".join(weights[:3]) + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")
        hint = ("; a smaller --group-size, or quantize_int4.shrink_groups=true, quantises them"
                if "group_size" in reason else "")
        ctx.echo(f"{p.name}: {len(weights)} linear(s) kept in float, {reason}: {shown}{hint}")


# -- the passes -----------------------------------------------------------------------------
@register_pass
class QuantizeInt8(Pass):
    name = "quantize_int8"
    description = "weight-only int8: per-output-channel symmetric scales, round to nearest"
    stage = Stage.QUANTIZE
    lossy = True
    needs = ("calibration",)

    # include_embedding: the token table becomes a qembedding (as llama.cpp's Q8_0/Q4 files
    # store token_embd); include_lm_head=None quantises the LM head only when it is tied to
    # that table, sharing its params, since a float head would keep the table's bytes anyway.
    @dataclass(frozen=True)
    class Options(PassOptions):
        include_lm_head: bool | None = option(None, "quantise the LM head (default: only when tied to the "
                                                    "embedding table)")
        include_embedding: bool = option(True, "quantise the token embedding table")
        skip: list[str] = option([], "names of linears (or their weights) to keep in float")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        fmt = WeightFormat("int8", "rtn", 8)
        total_before = param_bytes(graph)
        experts = quantize_experts(graph, "int8", lambda k: -1)
        nodes, skipped, tables = select_weights(self, graph)
        result = quantize_linears(self, graph, ctx, fmt, nodes, skipped, rtn_int8, embeddings=tables)
        return with_experts(result, graph, fmt, experts, total_before)


def rtn_int8(weight: torch.Tensor, ctx: PassContext, node: Node) -> tuple:
    q, scales = quantize_int8(weight)
    return q, scales, None


@register_pass
class QuantizeInt4(Pass):
    name = "quantize_int4"
    description = ("weight-only int4: groups of group_size along K with scales and zero points, "
                   "by rtn (round to nearest), gptq or awq (both from calibration activations)")
    stage = Stage.QUANTIZE
    lossy = True
    needs = ("calibration",)
    # shrink_groups: a linear whose K group_size does not divide takes the largest supported
    # group size below it that does (SmolLM2's K=576 at 128 -> 64) instead of staying float;
    # on by default because such models would otherwise be mostly unquantised. The report
    # lists the group size each shrunk linear got.
    # include_embedding / include_lm_head as in quantize_int8. The table is always RTN, in
    # groups of embedding_group_size (shrunk like the linears'): 32 by default because a tied
    # table is also the LM head, the most sensitive weight (llama.cpp keeps it at 6 bits in its
    # Q4 files); on SmolLM2-135M, 32 instead of 64 took int4-rtn's top-1 agreement with fp32
    # from 0.585 to 0.645 for 0.7% more weight bytes (16.0% of fp32).
    # act_order (GPTQ only): on, since on SmolLM2-135M it took int4-gptq's eval perplexity from
    # 30.04 (worse than RTN's 29.74) to 28.25 and KL against fp32 from 0.32 to 0.27.
    # clip (GPTQ only): on, since on SmolLM2-135M (held-out scipy LICENSE.txt, group 128) it took
    # int4-gptq's perplexity from 19.80 (RTN: 19.43) to 15.87, KL against fp32 from 0.67 to 0.54.

    @dataclass(frozen=True)
    class Options(PassOptions):
        group_size: int = option(128, "int4 group size along K", choices=INT4_GROUP_SIZES)
        method: str = option("rtn", "round to nearest, or GPTQ/AWQ from calibration activations",
                             choices=INT4_METHODS)
        include_lm_head: bool | None = option(None, "quantise the LM head (default: only when tied to the "
                                                    "embedding table)")
        include_embedding: bool = option(True, "quantise the token embedding table (RTN)")
        embedding_group_size: int = option(32, "group size of the embedding table", choices=INT4_GROUP_SIZES)
        skip: list[str] = option([], "names of linears (or their weights) to keep in float")
        shrink_groups: bool = option(True, "give a linear whose K group_size does not divide the largest "
                                           "smaller group size that does")
        act_order: bool = option(True, "GPTQ: quantise columns in order of decreasing activation energy")
        damp: float = option(0.01, "GPTQ: Hessian dampening, a fraction of its mean diagonal (K / calibration "
                                   "tokens is added to it)", low=0.0)
        clip: bool = option(True, "GPTQ: shrink each group's range to the clip with the least rounding error, "
                                  "weighted by input energy")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g, method = self.options.group_size, self.options.method
        fmt = WeightFormat("int4", method, 4, g, symmetric=False)
        groups: dict[str, int] = {}

        def check(node: Node) -> str | None:
            k = graph.params[node.inputs[1]].type.shape[1]
            size = group_size_for(k, g, self.options.shrink_groups)
            if size is None:
                return f"in_features {k} is not a multiple of group_size {g}"
            groups[node.name] = size
            return None
        table_g = self.options.embedding_group_size
        total_before = param_bytes(graph)
        experts = quantize_experts(graph, "int4", lambda k: group_size_for(k, g, self.options.shrink_groups))
        nodes, skipped, tables = select_weights(
            self, graph, check, lambda dim: group_size_for(dim, table_g, self.options.shrink_groups))
        method_fn = int4_method(method, graph, ctx, nodes, self.options, lambda node: groups[node.name])
        return with_experts(quantize_linears(self, graph, ctx, fmt, nodes, skipped, method_fn, groups, tables),
                            graph, fmt, experts, total_before)


def with_experts(result: PassResult, graph: Graph, fmt: WeightFormat, experts: tuple[int, int, int],
                 total_before: int) -> PassResult:
    """`result` of the linears, with the moe ops whose experts the pass stored (always by RTN)."""
    count, before, after = experts
    if not count:
        return result
    figures = result.details["quant"][fmt.scheme]
    figures.update(moe_ops=count, expert_method="rtn", bytes_before=figures["bytes_before"] + before,
                   bytes_after=figures["bytes_after"] + after)
    return replace(result, matches=result.matches + count, changed=True,
                   bytes_saved=total_before - param_bytes(graph))


def group_size_for(k: int, g: int, shrink: bool) -> int | None:
    """g when it divides K; with `shrink`, else the largest supported size below g that does."""
    fits = [size for size in INT4_GROUP_SIZES if size <= g and k % size == 0 and (size == g or shrink)]
    return max(fits) if fits else None


def int4_method(method: str, graph: Graph, ctx: PassContext, nodes: list[Node], options: PassOptions,
                group_of: Callable[[Node], int]) -> WeightQuantizer:
    """The weight quantiser of `method` (group_of(node): that linear's group size); GPTQ and
    AWQ first observe calibration activations (and AWQ rescales the graph), which is why they
    see the graph and the chosen linears."""
    if method == "rtn":
        return lambda weight, ctx, node: quantize_int4(weight, group_of(node))
    if method == "gptq":
        return gptq_method(graph, ctx, nodes, group_of, act_order=options.act_order, damp=options.damp,
                           clip=options.clip)
    return awq_method(graph, ctx, nodes, group_of)


__all__ = ["WeightFormat", "WeightQuantizer", "QuantizeInt8", "QuantizeInt4", "select_linears",
           "EmbeddingPlan", "plan_embeddings", "select_weights", "quantize_embedding", "quantize_embeddings",
           "lm_head_weights", "quantize_linear_weights", "quantize_linears", "add_quant_params",
           "int4_method", "group_size_for", "INT4_GROUP_SIZES", "INT4_METHODS"]
