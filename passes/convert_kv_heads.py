"""`convert_kv_heads`: MHA or GQA to GQA/MQA with fewer KV heads, each new key and value
projection head the mean of the heads in its group (the checkpoint conversion of Ainslie et al.
2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints",
§2.1, without their uptraining). The KV cache shrinks by the same factor.

A new group is a union of whole existing groups, so N must divide the current KV head count:
every query head then keeps attending through the pooled image of its own KV head, and the pooled
head is a plain mean of whole groups (for an MHA source, exactly the paper's mean over the group's
heads). Query heads serve KV heads in contiguous runs (head i uses KV head i // (H / N)), so
pooling non-adjacent KV heads (grouping=similarity) also reorders the query heads: the q rows and
the o-projection's columns move together, which leaves the function unchanged apart from pooling."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llmc.compiler.ir import DTYPE_BYTES, Graph, Node, TensorType
from llmc.compiler.ops import ATTENTION_OPS
from llmc.errors import PassError
from llmc.passes.accuracy import graph_logits, mean_kl, perplexity, significant, top1_agreement
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.decoder_structure import HEAD_PRESERVING
from llmc.passes.kv_head_grouping import HeadSimilarity, index_groups, similarity_groups
from llmc.passes.options import PassOptions, option
from llmc.passes.quantize_kv import run_logits

GROUPINGS = ("auto", "index", "similarity")
# What an earlier pass made of a projection this pass cannot see through.
UNSEEN_HINTS = {"qlinear": "its weights are quantised; ", "split": "it is a slice of a fused projection; "}
FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}


# -- weight arithmetic ------------------------------------------------------------------------
def pool_head_rows(w: torch.Tensor, groups: list[list[int]], head_dim: int) -> torch.Tensor:
    """w [heads * head_dim, ...] (a projection's weight rows or its bias) -> [len(groups) *
    head_dim, ...]: new head j is the mean of the heads in groups[j], summed in float64."""
    heads = w.reshape(-1, head_dim, *w.shape[1:]).double()
    pooled = torch.stack([heads[g].mean(dim=0) for g in groups])
    return pooled.reshape(len(groups) * head_dim, *w.shape[1:]).to(w.dtype)


def permute_head_rows(w: torch.Tensor, order: list[int], head_dim: int) -> torch.Tensor:
    """Rows of w [heads * head_dim, ...] regrouped so head i of the result is head order[i]."""
    return w.reshape(-1, head_dim, *w.shape[1:])[order].reshape(w.shape).contiguous()


def permute_head_cols(w: torch.Tensor, order: list[int], head_dim: int) -> torch.Tensor:
    """Columns of w [out, heads * head_dim] regrouped the same way (an o-projection's inputs)."""
    return w.reshape(w.shape[0], -1, head_dim)[:, order].reshape(w.shape).contiguous()


def query_order(groups: list[list[int]], queries_per_kv: int) -> list[int]:
    """Old query heads in their new order: the query heads of group 0's KV heads first, and so on."""
    return [h * queries_per_kv + i for g in groups for h in g for i in range(queries_per_kv)]


# -- where the projections are ----------------------------------------------------------------
@dataclass
class AttentionSite:
    """One attention node and the linears around it: k and v (pooled), q and o (reordered when
    the grouping is not by index; None when the graph does not show them plainly)."""
    attn: Node
    k: Node
    k_path: list[Node]          # rope nodes between k's linear and the attention, retyped with it
    v: Node
    q: Node | None
    o: Node | None

    @property
    def heads(self) -> int:
        return self.attn.attrs["num_heads"]

    @property
    def kv_heads(self) -> int:
        return self.attn.attrs["num_kv_heads"]

    @property
    def head_dim(self) -> int:
        return self.attn.attrs["head_dim"]


def find_sites(graph: Graph) -> list[AttentionSite]:
    producers, users = graph.producers(), graph.users()
    sites = []
    for attn in (n for n in graph.nodes if n.op in ATTENTION_OPS):
        k, k_path = projection(graph, attn, 1, "key", producers, users)
        v, _ = projection(graph, attn, 2, "value", producers, users)
        q = plain_projection(graph, attn.inputs[0], producers, users)
        sites.append(AttentionSite(attn, k, k_path, v, q, output_projection(graph, attn, users)))
    if not sites:
        raise PassError(f"convert_kv_heads: graph {graph.name} has no attention node; there are no KV "
                        f"heads to convert")
    return sites


def walk_to_linear(value: str, producers: dict) -> tuple[Node | None, list[Node]]:
    """The node that makes `value`, looking through rope (and the other per-head ops between a
    projection and attention); and the nodes passed."""
    path, node = [], producers.get(value)
    while node is not None and node.op in HEAD_PRESERVING:
        path.append(node)
        node = producers.get(node.inputs[0])
    return node, path


def projection(graph: Graph, attn: Node, index: int, role: str, producers: dict,
               users: dict) -> tuple[Node, list[Node]]:
    """The linear (with its rope path) that feeds input `index` of `attn`; refused unless its
    weights are float and its output reaches nothing but this attention."""
    node, path = walk_to_linear(attn.inputs[index], producers)
    if node is None or node.op != "linear":
        found = "a graph input" if node is None else f"node {node.name} ({node.op})"
        raise PassError(f"convert_kv_heads: the {role} input of {attn.name} comes from {found}, not a float "
                        f"linear projection (through rope); {UNSEEN_HINTS.get(getattr(node, 'op', None), '')}"
                        f"run convert_kv_heads before quantisation and fusion passes (--kv-heads puts it there)")
    why = unconvertible(graph, node, path, users)
    if why:
        raise PassError(f"convert_kv_heads: the {role} projection {node.name} of {attn.name} {why}")
    return node, path


def plain_projection(graph: Graph, value: str, producers: dict, users: dict) -> Node | None:
    node, path = walk_to_linear(value, producers)
    ok = node is not None and node.op == "linear" and not unconvertible(graph, node, path, users)
    return node if ok else None


def unconvertible(graph: Graph, linear: Node, path: list[Node], users: dict) -> str:
    """Why the rows of `linear` cannot be rewritten, or '' when they can."""
    for name in linear.inputs[1:]:
        p = graph.params.get(name)
        if p is None or name not in graph.weights:
            return f"reads {name}, which is not a weight"
        if p.quant is not None or p.type.dtype not in FLOAT_DTYPES:
            return (f"has {p.type.dtype} weight {name} (quantised); run convert_kv_heads before "
                    f"quantisation (--kv-heads inserts it there)")
        if len(users.get(name, [])) != 1:
            return f"shares weight {name} with other nodes"
    for node in [linear] + path:
        if len(users.get(node.out.name, [])) != 1 or node.out.name in graph.outputs:
            return f"output {node.out.name} is read by more than the attention"
    return ""


def output_projection(graph: Graph, attn: Node, users: dict) -> Node | None:
    readers = users.get(attn.out.name, [])
    if len(readers) != 1 or readers[0].op != "linear" or readers[0].inputs[0] != attn.out.name:
        return None
    o = readers[0]
    w = graph.params.get(o.inputs[1])
    ok = (w is not None and w.quant is None and o.inputs[1] in graph.weights
          and len(users.get(o.inputs[1], [])) == 1)
    return o if ok else None


# -- the rewrite ------------------------------------------------------------------------------
def set_weight(graph: Graph, name: str, tensor: torch.Tensor) -> None:
    p = graph.params[name]
    graph.params[name] = replace(p, type=TensorType(tuple(tensor.shape), p.type.dtype))
    graph.weights[name] = tensor


def retype_last_dim(node: Node, features: int) -> None:
    t = node.out.type
    node.out.type = TensorType(t.shape[:-1] + (features,), t.dtype)


def reorder_queries(graph: Graph, site: AttentionSite, order: list[int]) -> None:
    if site.q is None or site.o is None:
        raise PassError(f"convert_kv_heads: grouping KV heads by similarity reorders the query heads of "
                        f"{site.attn.name}, but its q or output projection is not a plain float linear; "
                        f"use --kv-grouping index")
    for name in site.q.inputs[1:]:
        set_weight(graph, name, permute_head_rows(graph.weights[name], order, site.head_dim))
    o_weight = site.o.inputs[1]
    set_weight(graph, o_weight, permute_head_cols(graph.weights[o_weight], order, site.head_dim))


def convert_site(graph: Graph, site: AttentionSite, groups: list[list[int]]) -> None:
    """Pool site's KV heads into `groups` (each a list of old KV heads), in place."""
    if groups != index_groups(site.kv_heads, len(groups)):
        reorder_queries(graph, site, query_order(groups, site.heads // site.kv_heads))
    for linear in (site.k, site.v):
        for name in linear.inputs[1:]:
            set_weight(graph, name, pool_head_rows(graph.weights[name], groups, site.head_dim))
    for node in [site.k, site.v] + site.k_path:
        retype_last_dim(node, len(groups) * site.head_dim)
    site.attn.attrs["num_kv_heads"] = len(groups)


def convert_graph(graph: Graph, plan: dict[str, list[list[int]]]) -> None:
    """Apply `plan` (attention node name -> groups) to every site of `graph`."""
    for site in find_sites(graph):
        convert_site(graph, site, plan[site.attn.name])


# -- choosing the groups ----------------------------------------------------------------------
def check_kv_heads(sites: list[AttentionSite], n: int) -> None:
    for site in sites:
        if site.kv_heads % n:
            divisors = [d for d in range(1, site.kv_heads + 1) if site.kv_heads % d == 0]
            raise PassError(f"convert_kv_heads: kv_heads={n} does not divide the {site.kv_heads} KV heads "
                            f"of {site.attn.name} ({site.heads} query heads); choose one of "
                            f"{', '.join(map(str, divisors))} (1 = multi-query attention)")


def calibration_of(ctx: PassContext, grouping: str) -> list[torch.Tensor]:
    if ctx.calibration is None or len(ctx.calibration) == 0:
        raise PassError(f"convert_kv_heads grouping={grouping} compares heads on calibration text, and the "
                        f"pipeline gave none; compile through `llmc compile` (--calib FILE, else text the "
                        f"model generates itself) or use grouping=index")
    return [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in ctx.calibration]


def observe(graph: Graph, seqs: list[torch.Tensor], sites: list[AttentionSite]):
    """(each site's KV head similarity, the graph's logits [T - 1, vocab] per sequence)."""
    sims = {s.attn.name: HeadSimilarity(s.kv_heads, s.head_dim) for s in sites}

    def hook(node, args, outs):
        if node.name in sims:
            sims[node.name].add(args[1], args[2])
    logits = [lg[:-1] for lg in run_logits(graph, seqs, hook)]
    return {name: s.matrix() for name, s in sims.items()}, logits


def score(graph: Graph, plan: dict, seqs: list[torch.Tensor], ref_logits: list[torch.Tensor]) -> dict:
    """Calibration perplexity, KL(unconverted || converted) and top-1 agreement of `plan`."""
    candidate = graph.copy()
    convert_graph(candidate, plan)
    logits = [lg[:-1] for lg in graph_logits(candidate, seqs)]
    return {"ppl": significant(perplexity(logits, seqs)), "kl": significant(mean_kl(ref_logits, logits)),
            "top1_agreement": significant(top1_agreement(ref_logits, logits))}


def kv_bytes_per_token(graph: Graph, sites: list[AttentionSite]) -> int:
    """Keys and values of every layer at the dtype the attention reads them in."""
    return sum(2 * s.kv_heads * s.head_dim * DTYPE_BYTES[graph.type_of(s.attn.inputs[1]).dtype] for s in sites)


@register_pass
class ConvertKVHeads(Pass):
    name = "convert_kv_heads"
    description = ("MHA/GQA -> GQA/MQA: mean-pool key and value projection heads into kv_heads groups, "
                   "grouped by index, by similarity on calibration text, or by whichever scores better")
    stage = Stage.CONVERT_HEADS
    lossy = True
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        kv_heads: int = option(1, "KV heads to keep, dividing the model's (1 = multi-query attention)", low=1)
        grouping: str = option("auto", "which KV heads pool together: by index, by similarity on calibration "
                                       "text, or auto (both scored, the better kept)", choices=GROUPINGS)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        sites, n = find_sites(graph), self.options.kv_heads
        check_kv_heads(sites, n)
        details = {"kv_heads_before": sorted({s.kv_heads for s in sites}), "kv_heads_after": n,
                   "requested_grouping": self.options.grouping,
                   "kv_bytes_per_token_before": kv_bytes_per_token(graph, sites)}
        if all(s.kv_heads == n for s in sites):
            return PassResult(0, False, {**details, "kv_bytes_per_token_after": details[
                "kv_bytes_per_token_before"], "grouping": "none (already at kv_heads)"})
        chosen, plan, candidates = self.choose(graph, ctx, sites, n)
        before = projection_size(graph, sites)
        for site in sites:
            convert_site(graph, site, plan[site.attn.name])
        after = projection_size(graph, sites)
        details.update(grouping=chosen, kv_bytes_per_token_after=kv_bytes_per_token(graph, sites),
                       params_removed=before[0] - after[0], groups=[plan[s.attn.name] for s in sites])
        if candidates:
            details["candidates"] = candidates
        return PassResult(len(sites), True, details, bytes_saved=before[1] - after[1])

    def choose(self, graph: Graph, ctx: PassContext, sites: list[AttentionSite], n: int):
        """(grouping used, its plan, {grouping: score} when `auto` compared them)."""
        grouping = self.options.grouping
        by_index = {s.attn.name: index_groups(s.kv_heads, n) for s in sites}
        if grouping == "index":
            return "index", by_index, None
        seqs = calibration_of(ctx, grouping)
        sims, ref_logits = observe(graph, seqs, sites)
        by_similarity = {s.attn.name: similarity_groups(sims[s.attn.name], n) for s in sites}
        if grouping == "similarity":
            return "similarity", by_similarity, None
        index_score = score(graph, by_index, seqs, ref_logits)
        if by_similarity == by_index:  # e.g. MQA: one group holds every head, however chosen
            return "index", by_index, {"index": index_score, "similarity": index_score}
        similarity_score = score(graph, by_similarity, seqs, ref_logits)
        better = "similarity" if similarity_score["kl"] < index_score["kl"] else "index"
        return better, by_similarity if better == "similarity" else by_index, {
            "index": index_score, "similarity": similarity_score}


def projection_size(graph: Graph, sites: list[AttentionSite]) -> tuple[int, int]:
    """(elements, bytes) of the k and v projections' weights and biases."""
    types = [graph.params[name].type for s in sites for lin in (s.k, s.v) for name in lin.inputs[1:]]
    return sum(t.numel() for t in types), sum(t.nbytes() for t in types)


__all__ = ["ConvertKVHeads", "pool_head_rows", "permute_head_rows", "permute_head_cols", "query_order",
           "find_sites", "convert_graph", "GROUPINGS"]
