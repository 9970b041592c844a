"""The pass run of a compile, forked per rank (tensor-parallel rank or pipeline stage): the passes
before the shard stage run once on the whole model; then, for each rank, a copy of that graph runs
the shard pass (with its rank or stage) and every later pass, giving one graph (and later one plan
and weights file) per rank. Also the manifest's `parallel` section: each rank's heads, layers, KV
bytes, weight bytes and collectives; and what it shares with the `model` section (weight bytes by
dtype, the HF config as data)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from llmc.compiler.ir import Graph
from llmc.compiler.ops import COLLECTIVE_OPS, POINT_TO_POINT_OPS
from llmc.errors import PassError
from llmc.passes.base import PassContext, PassManager, PassRecord, Stage
from llmc.passes.registry import PassConfig, pass_class

SHARD_PASS = "shard_tensor_parallel"
PIPELINE_PASS = "shard_pipeline"


def tensor_parallel_size(configs: list[PassConfig]) -> int:
    """The tp of the pipeline's shard pass (1 without one); a pipeline shards once."""
    shards = [c for c in configs if c.name == SHARD_PASS]
    if len(shards) > 1:
        raise PassError(f"the pipeline holds {SHARD_PASS} {len(shards)} times; shard once (--tp N)")
    return shards[0].options.tp if shards else 1


def pipeline_size(configs: list[PassConfig]) -> int:
    """The pp of the pipeline's shard_pipeline pass (1 without one)."""
    stages = [c for c in configs if c.name == PIPELINE_PASS]
    if len(stages) > 1:
        raise PassError(f"the pipeline holds {PIPELINE_PASS} {len(stages)} times; split once (--pp N)")
    return stages[0].options.pp if stages else 1


def run_passes(graph: Graph, configs: list[PassConfig], ctx: PassContext) -> tuple[list[Graph], list[PassRecord]]:
    """(one graph per rank, rank 0's pass records); the graph itself is rank 0's. With both --tp and
    --pp, rank = stage * tp + tp_rank: each rank's graph is tensor-sharded first (so the last stage
    keeps its vocabulary-split LM head), then cut to its stage, its send/recv peers the ranks of the
    same tp_rank in the neighbouring stages."""
    tp, pp = tensor_parallel_size(configs), pipeline_size(configs)
    world = tp * pp
    if world == 1:
        return [graph], _manager(configs, ctx).run(graph)
    before = [c for c in configs if c.stage < Stage.SHARD]
    after = configs[len(before):]
    _refuse_calibrated_after_shard(after)
    records = _manager(before, ctx).run(graph)
    graphs, rank_records = [], []
    for rank in range(world):
        stage, tp_rank = divmod(rank, tp)
        g = graph if rank == world - 1 else graph.copy()
        rank_ctx = ctx if ctx.dump_ir is None else _with_dump(ctx, Path(ctx.dump_ir) / f"rank{rank}")
        configured = [c.configure(rank=tp_rank) if c.name == SHARD_PASS else
                      c.configure(stage=stage, tp=tp, tp_rank=tp_rank) if c.name == PIPELINE_PASS else c
                      for c in after]
        rank_records.append(_manager(configured, rank_ctx).run(g))
        graphs.append(g)
    return graphs, records + rank_records[0]


def _manager(configs: list[PassConfig], ctx: PassContext) -> PassManager:
    return PassManager([c.instantiate() for c in configs], ctx, [c.stage for c in configs])


def _with_dump(ctx: PassContext, folder: Path) -> PassContext:
    return replace(ctx, dump_ir=folder)


def _refuse_calibrated_after_shard(after: list[PassConfig]) -> None:
    """A pass that measures the model on calibration text cannot run on one rank's part of it."""
    for c in after:
        if "calibration" in pass_class(c.name).needs:
            raise PassError(f"{c.name} ({c.stage.label}) runs after the shard stage (--tp, --pp) and measures the "
                            f"model on calibration text, which one rank's shard cannot do; compile without it (e.g. "
                            f"--kv-cache none) or without --tp/--pp")


def shard_record(records: list[PassRecord]) -> dict:
    """The shard passes' details (both passes' with --tp and --pp: the pipeline's split, the whole heads)."""
    details = {}
    for r in records:
        if r.name in (SHARD_PASS, PIPELINE_PASS):
            details = {**r.details, **details} if r.name == PIPELINE_PASS else {**details, **r.details}
    return details


def rank_entry(rank: int, graph: Graph, plan) -> dict:
    """What the manifest says of one rank: its heads and KV bytes (the rank's own cache), its
    weight bytes by dtype, its collectives per step and its planned activation peak."""
    meta = graph.meta
    return {"dir": f"rank{rank}", "num_heads": meta["num_heads"], "num_kv_heads": meta["num_kv_heads"],
            "kv_bytes_per_token": meta["kv_bytes_per_token"], "weight_bytes": weight_bytes_by_dtype(graph),
            "collectives": _count(graph, COLLECTIVE_OPS) | {op: n for op, n in _count(graph, POINT_TO_POINT_OPS).items()
                                                             if n},
            "activation_peak_bytes": plan.memory.peak_bytes}


def hf_config_dict(config, kv_heads: int) -> dict:
    """The config as JSON data, less `_name_or_path`: it holds the path the model was loaded
    from, which would make the artifact's bytes depend on where the checkpoint sits. It says
    how many KV heads the compiled weights have (convert_kv_heads changes that)."""
    data = json.loads(config.to_json_string(use_diff=False))
    data.pop("_name_or_path", None)
    if data.get("num_key_value_heads", kv_heads) != kv_heads:
        data["num_key_value_heads"] = kv_heads
    return data


def weight_bytes_by_dtype(graph: Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in graph.params.values():
        out[p.type.dtype] = out.get(p.type.dtype, 0) + p.type.nbytes()
    return dict(sorted(out.items()))


def _count(graph: Graph, ops: tuple[str, ...]) -> dict[str, int]:
    return {op: sum(n.op == op for n in graph.nodes) for op in ops}


def whole_model_meta(rank_meta: dict, details: dict, config) -> dict:
    """The model as a whole (the manifest's `model`): rank 0's facts with the heads, KV bytes and HF
    config of the unsharded model. Each rank's graph says the same but for its own heads and KV bytes."""
    if "pp" in details and "tp" in details:  # both: every stage's layers, every tp rank's heads
        layers, heads, kv_heads = sum(details["split"]), details["num_heads"], details["num_kv_heads"]
        per_head_layer = rank_meta["kv_bytes_per_token"] // (rank_meta["num_layers"] * rank_meta["num_kv_heads"])
        return {**rank_meta, "num_layers": layers, "num_heads": heads, "num_kv_heads": kv_heads,
                "kv_bytes_per_token": per_head_layer * layers * kv_heads, "hf_config": hf_config_dict(config, kv_heads)}
    if "pp" in details:  # pipeline stages: every layer's heads, the layers of all stages
        layers = sum(details["split"])
        kv = rank_meta["kv_bytes_per_token"] // rank_meta["num_layers"] * layers
        return {**rank_meta, "num_layers": layers, "kv_bytes_per_token": kv,
                "hf_config": hf_config_dict(config, rank_meta["num_kv_heads"])}
    heads, kv_heads = details["num_heads"], details["num_kv_heads"]
    per_head = rank_meta["kv_bytes_per_token"] // rank_meta["num_kv_heads"]
    return {**rank_meta, "num_heads": heads, "num_kv_heads": kv_heads, "kv_bytes_per_token": per_head * kv_heads,
            "hf_config": hf_config_dict(config, kv_heads)}


def parallel_section(graphs: list[Graph], plans: list) -> dict:
    """With pipeline stages, rank = stage * tp + tp_rank (stage 0's tp ranks are those that receive nothing)."""
    ranks = [rank_entry(r, g, p) for r, (g, p) in enumerate(zip(graphs, plans))]
    if not any(n.op == "recv" for n in graphs[-1].nodes):
        return {"tp": len(graphs), "ranks": ranks}
    # pipeline stages: each rank's layers [first, stop); rank 0 receives the last stage's logits
    tp = sum(not any(n.op == "recv" for n in g.nodes) for g in graphs)
    pp, first = len(graphs) // tp, 0
    for rank, (entry, g) in enumerate(zip(ranks, graphs)):
        entry["layers"] = [first, first + g.meta["num_layers"]]
        entry["num_layers"] = g.meta["num_layers"]
        if tp > 1:
            entry["stage"], entry["tp_rank"] = divmod(rank, tp)
        if rank % tp == tp - 1:
            first += g.meta["num_layers"]
    last = (pp - 1) * tp
    logits = graphs[last].type_of(graphs[last].outputs[0])
    return {"tp": tp, "pp": pp, "split": [g.meta["num_layers"] for g in graphs[::tp]],
            "logits": {"width": logits.shape[-1], "dtype": logits.dtype, **({"rank": last} if tp > 1 else {})},
            "ranks": ranks}


__all__ = ["SHARD_PASS", "PIPELINE_PASS", "pipeline_size", "tensor_parallel_size", "run_passes", "shard_record",
           "whole_model_meta", "parallel_section", "rank_entry"]
