"""`prune_heads`: structured attention-head pruning. A set of heads S is scored by what it
writes into the residual stream on calibration text, Σ_t ‖W_o[:, S] a_t[S]‖² (a_t the attention
output, W_o the output projection), and the lowest-scoring units of every layer are cut from the
q/k/v rows, the o_proj columns and the attention's head counts.

With GQA (several query heads per KV head) the default unit is a whole KV group (the KV head and
its query heads): it is the only cut that also shrinks the KV cache and the k/v projections, and
it leaves every remaining group whole, so query head h still reads KV head h // group_size. In
an MHA model it is plain head pruning. `unit=query` instead removes the same number of query
heads from every group, keeping the KV layout as it was."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.calibration_stats import gram_matrices
from llmc.passes.decoder_structure import AttentionBlock, attention_blocks, retype, set_weight, size_report, sizes
from llmc.passes.options import PassOptions, option

UNITS = ("group", "query")


def head_columns(heads: list[int], head_dim: int) -> torch.Tensor:
    """Feature indices of `heads` in a [.., num_heads * head_dim] layout."""
    return torch.tensor([h * head_dim + d for h in heads for d in range(head_dim)], dtype=torch.long)


def head_set_score(o_weight: torch.Tensor, gram: torch.Tensor, heads: list[int], head_dim: int) -> float:
    """Σ_t ‖W_o[:, S] a_t[S]‖² over calibration tokens, for S the columns of `heads`:
    sum((W_Sᵀ W_S) ⊙ (A_Sᵀ A_S)) with the Gram matrix AᵀA of the attention outputs."""
    cols = head_columns(heads, head_dim)
    w = o_weight.double()[:, cols]
    return float(((w.T @ w) * gram[cols][:, cols]).sum())


def units_to_remove(fraction: float, units: int, what: str) -> int:
    """round(fraction * units), refused when that is none or all of them."""
    count = round(fraction * units)
    if count < 1:
        raise PassError(f"prune_heads: fraction {fraction:g} of {units} {what} rounds to none removed; "
                        f"raise fraction to at least {0.5 / units:.3g}")
    if count >= units:
        raise PassError(f"prune_heads: fraction {fraction:g} of {units} {what} would remove all of them; "
                        f"lower fraction below {(units - 0.5) / units:.3g}")
    return count


def lowest(scores: list[float], count: int) -> list[int]:
    """Indices of the `count` lowest scores (ties to the lower index)."""
    return sorted(sorted(range(len(scores)), key=lambda i: (scores[i], i))[:count])


def choose_heads(block: AttentionBlock, o_weight: torch.Tensor, gram: torch.Tensor, fraction: float,
                 unit: str) -> tuple[list[int], list[int]]:
    """(query heads kept, KV heads kept) in ascending order, every KV group equally sized."""
    g, hd = block.group_size, block.head_dim
    if unit == "group":
        groups = [list(range(u * g, (u + 1) * g)) for u in range(block.num_kv_heads)]
        scores = [head_set_score(o_weight, gram, heads, hd) for heads in groups]
        cut = set(lowest(scores, units_to_remove(fraction, block.num_kv_heads, "KV groups per layer")))
        keep_kv = [u for u in range(block.num_kv_heads) if u not in cut]
        return [h for u in keep_kv for h in groups[u]], keep_kv
    if g == 1:
        raise PassError("prune_heads: unit=query removes query heads within GQA groups, and this model "
                        "has one query head per KV head (MHA); use unit=group")
    count = units_to_remove(fraction, g, "query heads per KV group")
    keep_q = []
    for u in range(block.num_kv_heads):
        heads = list(range(u * g, (u + 1) * g))
        cut = set(lowest([head_set_score(o_weight, gram, [h], hd) for h in heads], count))
        keep_q += [h for h in heads if h - u * g not in cut]
    return keep_q, list(range(block.num_kv_heads))


def keep_rows(graph: Graph, linear, rows: torch.Tensor) -> None:
    """Keep output features `rows` of a linear (its weight rows and bias entries)."""
    for name in linear.inputs[1:]:
        set_weight(graph, name, graph.weights[name].index_select(0, rows))


def cut_heads(graph: Graph, block: AttentionBlock, keep_q: list[int], keep_kv: list[int]) -> None:
    hd = block.head_dim
    q_rows, kv_rows = head_columns(keep_q, hd), head_columns(keep_kv, hd)
    keep_rows(graph, block.q, q_rows)
    keep_rows(graph, block.k, kv_rows)
    keep_rows(graph, block.v, kv_rows)
    o_name = block.o.inputs[1]
    set_weight(graph, o_name, graph.weights[o_name].index_select(1, q_rows))
    block.attention.attrs.update(num_heads=len(keep_q), num_kv_heads=len(keep_kv))


@register_pass
class PruneHeads(Pass):
    name = "prune_heads"
    description = ("remove the attention heads (whole KV groups, or query heads evenly within groups) "
                   "that write least into the residual stream through o_proj on calibration text")
    stage = Stage.PRUNE
    lossy = True
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        fraction: float = option(0.25, "fraction of attention heads to remove", low=0.0, high=1.0, strict=True)
        unit: str = option("group", "remove whole KV groups, or query heads evenly within groups", choices=UNITS)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        fraction, unit = self.options.fraction, self.options.unit
        blocks = attention_blocks(graph, self.name)
        if not blocks:
            raise PassError("prune_heads: the graph has no attention nodes to prune")
        before = sizes(graph)
        shape_before = [(b.num_heads, b.num_kv_heads) for b in blocks]
        grams = gram_matrices(graph, ctx, {b.attention.out.name for b in blocks}, self.name)
        removed = []
        for b in blocks:
            keep_q, keep_kv = choose_heads(b, graph.weights[b.o.inputs[1]], grams[b.attention.out.name],
                                           fraction, unit)
            removed.append([h for h in range(b.num_heads) if h not in keep_q])
            cut_heads(graph, b, keep_q, keep_kv)
        retype(graph, self.name)
        details = {"unit": unit, "heads_before": [h for h, _ in shape_before],
                   "heads_after": [b.num_heads for b in blocks],
                   "kv_heads_before": [k for _, k in shape_before], "kv_heads_after": [b.num_kv_heads for b in blocks],
                   "removed_heads": removed, **size_report(before, graph)}
        return PassResult(sum(map(len, removed)), True, details, bytes_saved=details["bytes_removed"])


__all__ = ["PruneHeads", "head_columns", "head_set_score", "choose_heads", "units_to_remove", "UNITS"]
