"""`shard_tensor_parallel`: Megatron-style tensor parallelism as an IR rewrite, giving rank `rank`
of `tp` its part of the model. Column-parallel projections keep a slice of their output features:
q/k/v keep whole KV groups (a KV head with its query heads), gate/up a slice of the MLP channels;
the row-parallel projection after them (o_proj, down_proj) keeps the matching input features, and
an `all_reduce` sums the ranks' partial outputs. The LM head keeps a slice of the vocabulary and an
`all_gather` joins the logits; the (float) embedding keeps the same slice of its table, looks up
only the ids in it (`vocab_embedding`, zeros for the others) and an all_reduce adds the ranks'
rows: one more collective a step, for the often largest weight (a tied head shares the slice).

An attention whose KV heads do not divide by tp (SmolLM2's 3 at --tp 2) is replicated: every rank
computes it whole, with every KV head in its cache, and only the MLP is split. MLP channels that do
not divide are refused, naming the sizes that work. The compile driver runs this pass once per
rank on copies of the graph and writes one plan and weights file per rank."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import COLLECTIVE_OPS
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.decoder_structure import param_count, retype
from llmc.passes.options import PassOptions, option
from llmc.passes.quantize import param_bytes
from llmc.passes.shard_structure import ParallelPair, attention_pairs, lm_head, mlp_pairs, token_embedding
from llmc.passes.shard_weights import cut_column, cut_row, cut_table, in_features, out_features


def rank_slice(size: int, rank: int, tp: int) -> tuple[int, int]:
    """[start, stop) of rank's equal part of `size` units."""
    part = size // tp
    return rank * part, (rank + 1) * part


def working_sizes(counts: list[int], most: int = 16) -> list[int]:
    """The tensor-parallel sizes from 2 to `most` that divide every count."""
    return [n for n in range(2, most + 1) if all(c % n == 0 for c in counts)]


@register_pass
class ShardTensorParallel(Pass):
    name = "shard_tensor_parallel"
    description = ("tensor parallelism: split attention heads (whole KV groups), MLP channels and the vocabulary "
                   "(float embedding, LM head) over tp ranks, with all_reduce / all_gather between them (one "
                   "rank's graph)")
    stage = Stage.SHARD

    @dataclass(frozen=True)
    class Options(PassOptions):
        tp: int = option(2, "tensor-parallel ranks (world size)", low=1)
        rank: int = option(0, "which rank's part this run keeps (the compile driver runs one per rank)", low=0)

        def validate(self) -> None:
            if self.rank >= self.tp:
                raise self.invalid(f"rank {self.rank} is not below tp {self.tp}")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        tp, rank = self.options.tp, self.options.rank
        attentions, mlps, head = attention_pairs(graph, self.name), mlp_pairs(graph), lm_head(graph)
        self._check_divides(graph, attentions, mlps)
        whole = attentions[0].attention.attrs if attentions else {}
        heads = {"num_heads": whole.get("num_heads"), "num_kv_heads": whole.get("num_kv_heads")}
        if tp == 1:
            return PassResult(0, False, {"tp": 1, "rank": 0, **heads})
        before = {"params": param_count(graph), "bytes": param_bytes(graph)}
        sharded = [p for p in attentions if p.attention.attrs["num_kv_heads"] % tp == 0]
        for pair in sharded:
            self._shard_attention(graph, pair)
        for pair in mlps:
            self._shard_mlp(graph, pair)
        head_split, embedding_split = self._shard_vocab(graph, head, token_embedding(graph))
        graph.prune_params()
        retype(graph, self.name)
        details = {"tp": tp, "rank": rank, **heads, "attention_sharded": len(sharded),
                   "attention_replicated": len(attentions) - len(sharded), "mlp_sharded": len(mlps),
                   "lm_head": "vocab" if head_split else "replicated",
                   "embedding": "vocab" if embedding_split else "replicated",
                   "collectives": {op: sum(n.op == op for n in graph.nodes) for op in COLLECTIVE_OPS},
                   "params_before": before["params"], "params_after": param_count(graph),
                   "bytes_before": before["bytes"], "bytes_after": param_bytes(graph)}
        return PassResult(len(sharded) + len(mlps) + head_split + embedding_split, tp > 1, details)

    def _shard_vocab(self, graph: Graph, head: Node | None, embedding: Node | None) -> tuple[bool, bool]:
        """Split the LM head's rows and the embedding's table on the vocabulary where it divides;
        a head tied to the embedding shares its slice. Returns (head split, embedding split)."""
        tp, rank = self.options.tp, self.options.rank
        table = embedding.inputs[1] if embedding is not None else None
        vocab = graph.type_of(table).shape[0] if embedding is not None else 0
        head_split = head is not None and out_features(graph, head) % tp == 0
        if head_split:
            tied = head.inputs[1] == table
            cut_column(graph, head, *rank_slice(out_features(graph, head), rank, tp))
            self._follow(graph, head, "all_gather")
            if tied:
                embedding.inputs[1] = head.inputs[1]
        if embedding is None or vocab % tp:
            return head_split, False
        start, stop = rank_slice(vocab, rank, tp)
        if embedding.inputs[1] == table:  # not tied to the head: cut its own table
            cut_table(graph, embedding, start, stop)
        embedding.op, embedding.attrs = "vocab_embedding", {"vocab_start": start}
        self._follow(graph, embedding, "all_reduce")
        return head_split, True

    def _check_divides(self, graph: Graph, attentions: list[ParallelPair], mlps: list[ParallelPair]) -> None:
        tp = self.options.tp
        channels = sorted({in_features(graph, p.row) for p in mlps})
        if any(a.attention.attrs.get("kv_cache") for a in attentions):
            raise PassError(f"{self.name}: the KV cache is quantised before sharding; quantise it after (the "
                            f"kv-cache stage follows the shard stage)")
        if not attentions and not mlps:
            raise PassError(f"{self.name}: found no attention or MLP blocks to split; this model cannot be "
                            f"tensor-parallel")
        if any(c % tp for c in channels):
            kv = sorted({a.attention.attrs["num_kv_heads"] for a in attentions})
            raise PassError(f"--tp {tp}: the MLP's {', '.join(map(str, channels))} channels do not split into {tp} "
                            f"equal parts; sizes that work for this model: "
                            f"{', '.join(map(str, working_sizes(channels))) or 'none'} (attention heads split too "
                            f"for: {', '.join(map(str, working_sizes(channels + kv))) or 'none'})")

    def _shard_attention(self, graph: Graph, pair: ParallelPair) -> None:
        """Rank r keeps KV heads [r*kv/tp, (r+1)*kv/tp) and the query heads that read them."""
        tp, rank, attrs = self.options.tp, self.options.rank, pair.attention.attrs
        heads, kv_heads, head_dim = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
        q, k, v = pair.columns
        q_start, q_stop = (head_dim * h for h in rank_slice(heads, rank, tp))
        cut_column(graph, q, q_start, q_stop)
        for projection in (k, v):
            cut_column(graph, projection, *(head_dim * h for h in rank_slice(kv_heads, rank, tp)))
        attrs.update(num_heads=heads // tp, num_kv_heads=kv_heads // tp)
        cut_row(graph, pair.row, q_start, q_stop, rank, self.name)
        self._follow(graph, pair.row, "all_reduce")

    def _shard_mlp(self, graph: Graph, pair: ParallelPair) -> None:
        tp, rank = self.options.tp, self.options.rank
        start, stop = rank_slice(in_features(graph, pair.row), rank, tp)
        for projection in pair.columns:
            cut_column(graph, projection, start, stop)
        cut_row(graph, pair.row, start, stop, rank, self.name)
        self._follow(graph, pair.row, "all_reduce")

    def _follow(self, graph: Graph, node: Node, collective: str) -> Node:
        """Insert `collective` after `node`; its readers (and the graph outputs) read the result.
        The collective takes over the node's value name, so the graph's output stays `logits`."""
        partial = graph.fresh(f"{node.name}.partial")
        old, node.outputs[0].name = node.out.name, partial
        after = graph.make_node(collective, [partial], [node.out.type], {"world_size": self.options.tp})
        after.outputs[0].name = old
        graph.nodes.insert(graph.nodes.index(node) + 1, after)
        return after


__all__ = ["ShardTensorParallel", "rank_slice", "working_sizes"]
