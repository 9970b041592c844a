"""What `llmc bench` says of a tensor-parallel run, per rank: the weights it loaded, its resident
memory, and the seconds it spent in all_reduce and all_gather, or a pipeline stage's in send and recv
(waiting for the others included)."""

from __future__ import annotations

from llmc.runtime.parallel.lead import LeadRunner


def rank_report(engine) -> list[dict] | None:
    """One entry per rank for an engine serving a sharded artifact; None otherwise."""
    if not isinstance(engine.runner, LeadRunner):
        return None
    ranks = engine.manifest["parallel"]["ranks"]
    return [{**stats, "weight_bytes": sum(ranks[stats["rank"]]["weight_bytes"].values()),
             **({"layers": ranks[stats["rank"]]["layers"]} if "layers" in ranks[stats["rank"]] else {})}
            for stats in engine.runner.rank_stats()]


def format_ranks(ranks: list[dict] | None) -> list[str]:
    return [f"rank {r['rank']:<12} weights {r['weight_bytes'] / 2**20:.1f} MiB, resident {r['rss_bytes'] / 2**20:.0f} "
            f"MiB, " + ", ".join(_waits(r)) for r in ranks or []]


def _waits(r: dict) -> list[str]:
    """A pipeline stage's send/recv, a tensor-parallel rank's collectives (both with --tp and --pp)."""
    stage = [f"in send/recv {r['send_recv_s']:.2f} s"] if "layers" in r else []
    tensor = [f"in all_reduce {r['all_reduce_s']:.2f} s", f"in all_gather {r['all_gather_s']:.2f} s"]
    return stage + (tensor if not stage or r["all_reduce_s"] or r["all_gather_s"] else [])
