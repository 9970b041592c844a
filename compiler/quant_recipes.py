"""What `--quant` names mean as passes, and where they go in a pipeline: before the cleanup
passes, replacing whatever quantisation a target's default pipeline carries; `--kv-cache`'s
pass goes last."""

from __future__ import annotations

from llmc.errors import PassError

DEFAULT_GROUP_SIZE = 128

# --quant name -> pass specs; "{g}" is the int4 group size.
QUANT_RECIPES: dict[str, list[str]] = {
    "int8": ["quantize_int8"],
    "int4-rtn": ["quantize_int4:method=rtn:group_size={g}"],
    "int4-gptq": ["quantize_int4:method=gptq:group_size={g}"],
    "int4-awq": ["quantize_int4:method=awq:group_size={g}"],
    "fp8": ["quantize_fp8"],
    "w8a8": ["smoothquant", "quantize_w8a8:all_linears=true"],   # o_proj/down_proj unsmoothed, still int8
}
QUANT_CHOICES = tuple(QUANT_RECIPES)
KV_CACHE_CHOICES = ("int8", "fp8")

# Passes a recipe replaces when they sit in a target's default pipeline.
QUANT_PASS_NAMES = {"quantize_int8", "quantize_int4", "quantize_fp8", "quantize_w8a8", "smoothquant",
                    "quantize_gptq", "quantize_awq"}
CLEANUP_PASS_NAMES = {"remove_noops", "fold_constants", "dce"}


def pass_name(spec: str) -> str:
    return spec.split(":", 1)[0].strip()


def quant_pass_specs(quant: str, group_size: int | None = None) -> list[str]:
    """The pass specs of the --quant recipe `quant`."""
    if quant not in QUANT_RECIPES:
        raise PassError(f"--quant {quant!r} is unknown; choose one of {', '.join(QUANT_CHOICES)}")
    if group_size is not None and not quant.startswith("int4"):
        raise PassError(f"--group-size applies to int4 quantisation, not --quant {quant}; "
                        f"drop --group-size or use --quant int4-rtn/int4-gptq/int4-awq")
    g = DEFAULT_GROUP_SIZE if group_size is None else group_size
    return [spec.format(g=g) for spec in QUANT_RECIPES[quant]]


def insert_quant_passes(entries: list[str], specs: list[str], explicit: bool) -> list[str]:
    """`entries` with `specs` before the first cleanup pass (or first, without one). A target's
    own quantisation passes make way; a user's explicit --passes list may not hold any."""
    present = [e for e in entries if pass_name(e) in QUANT_PASS_NAMES]
    if present and explicit:
        raise PassError(f"--passes already quantises ({', '.join(present)}) and --quant adds "
                        f"{', '.join(specs)}; give one or the other")
    rest = [e for e in entries if pass_name(e) not in QUANT_PASS_NAMES]
    at = next((i for i, e in enumerate(rest) if pass_name(e) in CLEANUP_PASS_NAMES), 0)
    return rest[:at] + specs + rest[at:]


def add_kv_cache_pass(entries: list[str], kv_cache: str | None) -> list[str]:
    """Last, so no cleanup pass after it prunes its scale params (no node reads them); "none"
    keeps the cache in the activation dtype where a target would quantise it."""
    if kv_cache is None or kv_cache == "none":
        return entries
    if kv_cache not in KV_CACHE_CHOICES:
        raise PassError(f"--kv-cache {kv_cache!r} is unknown; choose one of {', '.join(KV_CACHE_CHOICES)}")
    if any(pass_name(e) == "quantize_kv_cache" for e in entries):
        raise PassError("--passes already holds quantize_kv_cache and --kv-cache adds it again; "
                        "give one or the other")
    return entries + [f"quantize_kv_cache:dtype={kv_cache}"]


__all__ = ["QUANT_RECIPES", "QUANT_CHOICES", "KV_CACHE_CHOICES", "DEFAULT_GROUP_SIZE",
           "quant_pass_specs", "insert_quant_passes", "add_kv_cache_pass"]
