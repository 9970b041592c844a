"""What the compile flags mean as passes: `--quant`, `--prune`/`--sparsity`, `--kv-heads` and
`--kv-cache` each become typed pass configurations, which the pipeline places by their stage.
Flag syntax is checked here; option values are checked by the passes' own option classes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from llmc.compiler.schemes import KV_CACHE_FORMATS, TORCH, TRITON, schemes_where
from llmc.errors import PassError
from llmc.passes.registry import PassConfig, parse_pass_list

DEFAULT_GROUP_SIZE = 128

# --quant name -> (pass, options) in order; int4 recipes take --group-size.
QUANT_RECIPES: dict[str, list[tuple[str, dict]]] = {
    "int8": [("quantize_int8", {})],
    "int4-rtn": [("quantize_int4", {"method": "rtn"})],
    "int4-gptq": [("quantize_int4", {"method": "gptq"})],
    "int4-awq": [("quantize_int4", {"method": "awq"})],
    "fp8": [("quantize_fp8", {})],
    "w8a8": [("smoothquant", {}), ("quantize_w8a8", {"all_linears": True})],  # o_proj/down_proj unsmoothed
    # a GGUF file's own block formats, kept (the cpu targets' default for GGUF sources); none: float weights
    "gguf": [("keep_gguf_quant", {})],
    "none": [],
}
QUANT_CHOICES = tuple(QUANT_RECIPES)
SOURCE_QUANT = "gguf"
KV_CACHE_CHOICES = tuple(KV_CACHE_FORMATS)
KV_GROUPING_CHOICES = ("auto", "index", "similarity")
SPARSITY_METHODS = ("wanda", "magnitude")
# --prune kind -> (pass, its amount option); whole layers first, so heads and FFN channels are
# scored on the layers that stay.
PRUNE_KINDS = {"layers": ("prune_layers", "count"), "heads": ("prune_heads", "fraction"),
               "ffn": ("prune_ffn", "fraction")}
PRUNE_EXAMPLE = "heads:0.25,ffn:0.3,layers:4"


def configs(origin: str, entries: list[tuple[str, dict]]) -> list[PassConfig]:
    """PassConfigs of `entries`; an option a pass refuses is reported against the flag."""
    try:
        return [PassConfig.of(name, origin=origin, **options) for name, options in entries]
    except PassError as e:
        raise PassError(f"{origin}: {e}") from None


def quant_passes(quant: str | None, group_size: int | None = None) -> list[PassConfig]:
    """The passes of the --quant recipe `quant` (none without one)."""
    if quant is None:
        if group_size is not None:
            raise PassError("--group-size needs --quant int4-rtn, int4-gptq or int4-awq")
        return []
    if quant not in QUANT_RECIPES:
        raise PassError(f"--quant {quant!r} is unknown; choose one of {', '.join(QUANT_CHOICES)}")
    if group_size is not None and not quant.startswith("int4"):
        raise PassError(f"--group-size applies to int4 quantisation, not --quant {quant}; "
                        f"drop --group-size or use --quant int4-rtn/int4-gptq/int4-awq")
    g = DEFAULT_GROUP_SIZE if group_size is None else group_size
    entries = [(name, {**opts, "group_size": g} if name == "quantize_int4" else opts)
               for name, opts in QUANT_RECIPES[quant]]
    return configs("--quant", entries)


def default_quant(explicit_passes: bool, source_quantised: bool, target_quant: str | None) -> str | None:
    """The --quant recipe a compile without one gets: none under --passes, else the target's
    recipe whatever the source; a target without one (None: the cpu targets) keeps the source's
    own quantisation where it stores quantised weights (a GGUF file), else none."""
    if explicit_passes:
        return None
    if target_quant is not None:
        return target_quant
    return SOURCE_QUANT if source_quantised else None


# What each --quant recipe makes of the linears' weights (and their activations), for `llmc targets`
# and the notes a compile prints.
RECIPE_FORMATS = {
    "int8": "int8 weights per output channel",
    "int4-rtn": f"int4 weights in groups of {DEFAULT_GROUP_SIZE} (round to nearest)",
    "int4-gptq": f"GPTQ int4 weights in groups of {DEFAULT_GROUP_SIZE}",
    "int4-awq": f"AWQ int4 weights in groups of {DEFAULT_GROUP_SIZE}",
    "fp8": "fp8 e4m3 weights per output channel, activations fp8 (static scales) into each GEMM",
    "w8a8": "SmoothQuant int8 weights per channel, activations int8 per token into each GEMM",
    "gguf": "a GGUF file's own block formats, kept",
    "none": "float weights",
}

# Why a compile's linears hold the format they do (the manifest's "weights" record, `llmc inspect`).
TARGET_DEFAULT, USER_FLAG, KEPT_FROM_SOURCE, USER_PASSES = (
    "target default", "user flag", "kept from source", "user pipeline")


@dataclass(frozen=True)
class WeightChoice:
    """The --quant recipe a compile applies (None: none; the weights stay float in the target's
    dtype) and why: the target's recipe, the user's flag, the source's own quantisation kept, or
    the user's --passes."""
    quant: str | None
    reason: str
    origin: str          # what said so: "target h100-fp8", "--quant int8", "--passes"

    def record(self) -> dict:
        return {"quant": self.quant, "reason": self.reason, "origin": self.origin}

    def describe(self) -> str:
        """`fp8 (target default: target h100-fp8's recipe --quant fp8)`."""
        what = "float weights" if self.quant in (None, "none") else f"--quant {self.quant}"
        return f"{what} ({self.reason}: {self.origin})"


def weight_choice(tgt, quant: str | None, explicit_passes: bool, source_quantised: bool) -> WeightChoice:
    """Which recipe `default_quant` (or the user) picks for a compile for `tgt`, and why."""
    if quant is not None:
        return WeightChoice(quant, USER_FLAG, f"--quant {quant}")
    if explicit_passes:
        return WeightChoice(None, USER_PASSES, "--passes, in the order given")
    chosen = default_quant(False, source_quantised, tgt.default_quant)
    if chosen == SOURCE_QUANT and tgt.default_quant is None:
        return WeightChoice(chosen, KEPT_FROM_SOURCE, f"target {tgt.name} keeps a quantised source's own blocks")
    return WeightChoice(chosen, TARGET_DEFAULT, f"target {tgt.name}'s recipe")


def target_recipe(tgt) -> str:
    """What a target makes of the weights when the user names no --quant, in words."""
    if tgt.default_quant is None:
        return f"recipe: a quantised source's own blocks kept (a GGUF's), other sources {tgt.weight_dtype} weights"
    if tgt.default_quant == "none":
        return f"recipe: {tgt.weight_dtype} weights whatever the source"
    return f"recipe: --quant {tgt.default_quant}, {RECIPE_FORMATS[tgt.default_quant]}, whatever the source"


def check_quant_kernels(tgt, quant: str | None) -> None:
    """Refuse `--quant gguf` on a target whose kernels cannot read a GGUF's block formats as stored."""
    if quant != SOURCE_QUANT:
        return
    missing = sorted(set(schemes_where(gguf=True)) - set(served_schemes(tgt.device)))
    if missing:
        raise PassError(f"--quant {SOURCE_QUANT} keeps a GGUF file's blocks ({', '.join(missing)} codes), but target "
                        f"{tgt.name} has no kernels for them; choose another --quant or --target cpu")


def served_schemes(device: str) -> tuple[str, ...]:
    """The qlinear schemes the kernel families of `device` run (compiler/schemes.py's rows name them)."""
    return schemes_where(family=TRITON if device == "cuda" else TORCH)


def requantise_note(choice: WeightChoice, stored: dict, tgt) -> str | None:
    """What to tell the user when the compile re-quantises (or dequantises) the weights a source
    stores quantised (`stored`: param name -> its stored form, which names its format)."""
    if not stored or choice.quant == SOURCE_QUANT or choice.reason == USER_PASSES:
        return None
    if choice.reason == USER_FLAG and choice.quant == "none":
        return None
    counts = Counter(weight.format for weight in stored.values())
    formats = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
    becomes = (f"stores them as {tgt.weight_dtype} from their dequantised values" if choice.quant in (None, "none")
               else f"re-quantises them from their dequantised values into {RECIPE_FORMATS[choice.quant]}")
    who = f"--quant {choice.quant}" if choice.reason == USER_FLAG else f"target {tgt.name}'s recipe"
    return (f"llmc: the source stores quantised weights ({formats}); {who} {becomes} "
            f"(--quant {SOURCE_QUANT} keeps the file's own)")


def kv_cache_passes(kv_cache: str | None, device: str = "cpu") -> list[PassConfig]:
    """"none" keeps the cache in the activation dtype where a target would quantise it. A format the
    attention kernels of the target's `device` do not read is refused here, before any pass runs."""
    if kv_cache is None or kv_cache == "none":
        return []
    if kv_cache not in KV_CACHE_CHOICES:
        raise PassError(f"--kv-cache {kv_cache!r} is unknown; choose one of {', '.join(KV_CACHE_CHOICES)}")
    family = TRITON if device == "cuda" else TORCH
    if family not in KV_CACHE_FORMATS[kv_cache].families:
        served = ", ".join(n for n, f in KV_CACHE_FORMATS.items() if family in f.families)
        raise PassError(f"--kv-cache {kv_cache} is not read by the {family} attention kernels this {device} target "
                        f"runs; choose --kv-cache {served} or none, or compile for --target cpu")
    return configs("--kv-cache", [("quantize_kv_cache", {"dtype": kv_cache})])


def kv_heads_passes(kv_heads: int | None, grouping: str | None) -> list[PassConfig]:
    if kv_heads is None:
        if grouping is not None:
            raise PassError(f"--kv-grouping {grouping} needs --kv-heads N, the number of KV heads to keep")
        return []
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise PassError(f"--kv-heads {kv_heads!r} must be a positive number of KV heads dividing the "
                        f"model's (1 = multi-query attention)")
    return configs("--kv-heads", [("convert_kv_heads", {"kv_heads": kv_heads, "grouping": grouping or "auto"})])


def parse_prune(spec: str) -> dict[str, str]:
    """`"heads:0.25,ffn:0.3,layers:4"` -> {"heads": "0.25", "ffn": "0.3", "layers": "4"}."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise PassError(f"--prune is empty; give kind:amount parts such as {PRUNE_EXAMPLE}")
    amounts: dict[str, str] = {}
    for part in parts:
        kind, sep, text = (s.strip() for s in part.partition(":"))
        if kind not in PRUNE_KINDS:
            raise PassError(f"--prune part {part!r}: unknown kind {kind!r}; kinds are "
                            f"{', '.join(sorted(PRUNE_KINDS))} (e.g. {PRUNE_EXAMPLE})")
        if kind in amounts:
            raise PassError(f"--prune part {part!r}: {kind} is given twice; give each kind once")
        if not sep or not text:
            raise PassError(f"--prune part {part!r} has no amount; write {kind}:"
                            f"{'COUNT' if kind == 'layers' else 'FRACTION'} (e.g. {PRUNE_EXAMPLE})")
        amounts[kind] = text
    return amounts


def prune_passes(prune: str | None = None, sparsity: str | float | None = None,
                 sparsity_method: str | None = None) -> list[PassConfig]:
    """Structured pruning (layers, heads, ffn) then unstructured sparsity."""
    if sparsity_method is not None and sparsity_method not in SPARSITY_METHODS:
        raise PassError(f"--sparsity-method {sparsity_method!r} is unknown; choose one of "
                        f"{', '.join(SPARSITY_METHODS)}")
    if sparsity_method is not None and sparsity is None:
        raise PassError("--sparsity-method needs --sparsity (a fraction such as 0.5, or 2:4)")
    amounts = parse_prune(prune) if prune is not None else {}
    out = []
    for kind, (name, key) in PRUNE_KINDS.items():
        if kind in amounts:
            out += part_config(f"{kind}:{amounts[kind]}", name, key, amounts[kind])
    if sparsity is not None:
        out += configs("--sparsity", [("prune_sparse", {**sparsity_options(sparsity),
                                                         "method": sparsity_method or "wanda"})])
    return out


def part_config(part: str, name: str, key: str, text: str) -> list[PassConfig]:
    """The pass of one --prune part; its pass's options class bounds a fraction (a layer count's
    upper bound depends on the model, so prune_layers checks it when it runs)."""
    if key == "count" and not (text.isdigit() and int(text) >= 1):
        raise PassError(f"--prune part {part!r}: {text!r} is not a whole number of layers >= 1 (e.g. layers:4)")
    try:
        return configs("--prune", [(name, {key: text})])
    except PassError:
        pass
    if key == "count":
        raise PassError(f"--prune part {part!r}: {text!r} is not a whole number of layers >= 1 (e.g. layers:4)")
    try:
        float(text)
    except ValueError:
        raise PassError(f"--prune part {part!r}: {text!r} is not a number; give a fraction "
                        f"between 0 and 1 (e.g. ffn:0.3)") from None
    raise PassError(f"--prune part {part!r}: the fraction must lie strictly between 0 and 1")


def sparsity_options(sparsity: str | float) -> dict:
    text = str(sparsity).strip()
    if ":" in text:
        n, _, m = text.partition(":")
        if not (n.isdigit() and m.isdigit() and 0 < int(n) < int(m)):
            raise PassError(f"--sparsity {text!r} is not an N:M pattern with 0 < N < M (e.g. 2:4)")
        return {"pattern": f"{int(n)}:{int(m)}"}
    try:
        value = float(text)
    except ValueError:
        raise PassError(f"--sparsity {text!r} is neither a fraction (e.g. 0.5) nor an N:M pattern "
                        f"(e.g. 2:4)") from None
    if not 0.0 < value < 1.0:
        raise PassError(f"--sparsity {text!r}: the fraction of weights to zero must lie strictly between 0 and 1")
    return {"sparsity": value}


def shard_passes(tp: int, pp: int = 1, pp_split: str | None = None) -> list[PassConfig]:
    """`--tp N`: tensor parallelism over N ranks; `--pp N [--pp-split A,B]`: N pipeline stages
    (none for 1)."""
    if pp_split is not None and pp == 1:
        raise PassError(f"--pp-split {pp_split} splits pipeline stages; give --pp N with it")
    tensor = [] if tp == 1 else configs("--tp", [("shard_tensor_parallel", {"tp": tp})])
    return tensor + ([] if pp == 1 else configs("--pp", [("shard_pipeline", {"pp": pp, "split": pp_split or ""})]))


def added_passes(add: list[str]) -> list[PassConfig]:
    """`--add-pass name[:key=value...]`: a registered pass placed by its stage."""
    return [c for spec in add for c in parse_pass_list([spec], origin="--add-pass")]


__all__ = ["QUANT_RECIPES", "QUANT_CHOICES", "KV_CACHE_CHOICES", "KV_GROUPING_CHOICES", "SPARSITY_METHODS",
           "PRUNE_KINDS", "DEFAULT_GROUP_SIZE", "SOURCE_QUANT", "default_quant", "requantise_note",
           "RECIPE_FORMATS", "WeightChoice", "weight_choice", "target_recipe", "check_quant_kernels",
           "quant_passes", "kv_cache_passes", "kv_heads_passes",
           "parse_prune", "prune_passes", "shard_passes", "added_passes"]
