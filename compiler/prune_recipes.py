"""What `--prune` and `--sparsity` mean as passes, and where they go: first in the pipeline,
ahead of KV-head conversion, quantisation and the cleanup and fusion passes, so every later
pass sees the pruned shapes and quantises weights whose zeros are already in place."""

from __future__ import annotations

from llmc.compiler.quant_recipes import pass_name
from llmc.errors import PassError

# --prune kind -> its pass spec; applied in this order: whole layers first, so heads and FFN
# channels are scored on the layers that stay.
PRUNE_KINDS = {"layers": "prune_layers:count={}", "heads": "prune_heads:fraction={}",
               "ffn": "prune_ffn:fraction={}"}
SPARSITY_METHODS = ("wanda", "magnitude")
PRUNE_PASS_NAMES = {"prune_layers", "prune_heads", "prune_ffn", "prune_sparse"}
EXAMPLE = "heads:0.25,ffn:0.3,layers:4"


def parse_prune(spec: str) -> dict[str, float | int]:
    """`"heads:0.25,ffn:0.3,layers:4"` -> {"heads": 0.25, "ffn": 0.3, "layers": 4}."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise PassError(f"--prune is empty; give kind:amount parts such as {EXAMPLE}")
    amounts: dict[str, float | int] = {}
    for part in parts:
        kind, sep, text = (s.strip() for s in part.partition(":"))
        if kind not in PRUNE_KINDS:
            raise PassError(f"--prune part {part!r}: unknown kind {kind!r}; kinds are "
                            f"{', '.join(sorted(PRUNE_KINDS))} (e.g. {EXAMPLE})")
        if kind in amounts:
            raise PassError(f"--prune part {part!r}: {kind} is given twice; give each kind once")
        if not sep or not text:
            raise PassError(f"--prune part {part!r} has no amount; write {kind}:"
                            f"{'COUNT' if kind == 'layers' else 'FRACTION'} (e.g. {EXAMPLE})")
        amounts[kind] = layer_count(part, text) if kind == "layers" else fraction(part, text)
    return amounts


def layer_count(part: str, text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise PassError(f"--prune part {part!r}: {text!r} is not a whole number of layers >= 1 (e.g. layers:4)")
    return count


def fraction(part: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PassError(f"--prune part {part!r}: {text!r} is not a number; give a fraction "
                        f"between 0 and 1 (e.g. ffn:0.3)") from None
    if not 0.0 < value < 1.0:
        raise PassError(f"--prune part {part!r}: the fraction must lie strictly between 0 and 1")
    return value


def sparsity_spec(sparsity: str | float, method: str) -> str:
    """`0.5` or `"2:4"` -> the prune_sparse pass spec."""
    text = str(sparsity).strip()
    if ":" in text:
        n, _, m = text.partition(":")
        if not (n.isdigit() and m.isdigit() and 0 < int(n) < int(m)):
            raise PassError(f"--sparsity {text!r} is not an N:M pattern with 0 < N < M (e.g. 2:4)")
        return f"prune_sparse:pattern={int(n)}:{int(m)}:method={method}"
    try:
        value = float(text)
    except ValueError:
        raise PassError(f"--sparsity {text!r} is neither a fraction (e.g. 0.5) nor an N:M pattern "
                        f"(e.g. 2:4)") from None
    if not 0.0 < value < 1.0:
        raise PassError(f"--sparsity {text!r}: the fraction of weights to zero must lie strictly between 0 and 1")
    return f"prune_sparse:sparsity={value!r}:method={method}"


def prune_pass_specs(prune: str | None = None, sparsity: str | float | None = None,
                     sparsity_method: str | None = None) -> list[str]:
    """The pass specs of `--prune` and `--sparsity [--sparsity-method]`: structured passes
    (layers, heads, ffn) first, then unstructured sparsity."""
    if sparsity_method is not None and sparsity_method not in SPARSITY_METHODS:
        raise PassError(f"--sparsity-method {sparsity_method!r} is unknown; choose one of "
                        f"{', '.join(SPARSITY_METHODS)}")
    if sparsity_method is not None and sparsity is None:
        raise PassError("--sparsity-method needs --sparsity (a fraction such as 0.5, or 2:4)")
    amounts = parse_prune(prune) if prune is not None else {}
    specs = [PRUNE_KINDS[kind].format(amounts[kind]) for kind in PRUNE_KINDS if kind in amounts]
    if sparsity is not None:
        specs.append(sparsity_spec(sparsity, sparsity_method or "wanda"))
    return specs


def insert_prune_passes(entries: list[str], specs: list[str], explicit: bool) -> list[str]:
    """`specs` ahead of every other pass; a user's explicit --passes list may not prune already."""
    present = [e for e in entries if pass_name(e) in PRUNE_PASS_NAMES]
    if specs and present and explicit:
        raise PassError(f"--passes already prunes ({', '.join(present)}) and --prune/--sparsity add "
                        f"{', '.join(specs)}; give one or the other")
    return specs + entries


__all__ = ["PRUNE_KINDS", "SPARSITY_METHODS", "PRUNE_PASS_NAMES", "parse_prune", "prune_pass_specs",
           "insert_prune_passes"]
