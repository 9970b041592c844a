"""What `--kv-heads N [--kv-grouping G]` means as a pass, and where it goes in a pipeline: after
any pruning and before quantisation and the cleanup and fusion passes, since it pools float
k/v projection weights that fuse_qkv would merge and quantisation would turn into codes."""

from __future__ import annotations

from llmc.compiler.quant_recipes import CLEANUP_PASS_NAMES, QUANT_PASS_NAMES, pass_name
from llmc.errors import PassError

KV_GROUPING_CHOICES = ("auto", "index", "similarity")
PASS_NAME = "convert_kv_heads"
# Passes that must see the pooled heads rather than the original ones.
LATER_PASS_NAMES = QUANT_PASS_NAMES | CLEANUP_PASS_NAMES | {"cast_bf16", "fuse_qkv", "fuse_attention"}


def kv_heads_pass_spec(kv_heads: int, grouping: str | None) -> str:
    grouping = grouping or "auto"
    if grouping not in KV_GROUPING_CHOICES:
        raise PassError(f"--kv-grouping {grouping!r} is unknown; choose one of {', '.join(KV_GROUPING_CHOICES)}")
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise PassError(f"--kv-heads {kv_heads!r} must be a positive number of KV heads dividing the "
                        f"model's (1 = multi-query attention)")
    return f"{PASS_NAME}:kv_heads={kv_heads}:grouping={grouping}"


def insert_kv_heads_pass(entries: list[str], kv_heads: int | None, grouping: str | None) -> list[str]:
    """`entries` with the conversion before the first pass of LATER_PASS_NAMES (or last)."""
    if kv_heads is None:
        if grouping is not None:
            raise PassError(f"--kv-grouping {grouping} needs --kv-heads N, the number of KV heads to keep")
        return entries
    spec = kv_heads_pass_spec(kv_heads, grouping)
    if any(pass_name(e) == PASS_NAME for e in entries):
        raise PassError(f"--passes already holds {PASS_NAME} and --kv-heads adds it again; give one or the other")
    at = next((i for i, e in enumerate(entries) if pass_name(e) in LATER_PASS_NAMES), len(entries))
    return entries[:at] + [spec] + entries[at:]


__all__ = ["KV_GROUPING_CHOICES", "kv_heads_pass_spec", "insert_kv_heads_pass"]
