"""`prune_sparse`: unstructured and N:M semi-structured weight sparsity. Weights of the float
linears (all but the LM head) are scored by magnitude |W| or by Wanda's |W_ij| · ‖X_j‖₂ on
calibration inputs (Sun et al., 2023), and the lowest are set to zero: a `sparsity` fraction of
each matrix (magnitude) or of each output row (Wanda, its comparison group), or, for a `pattern`
N:M such as 2:4, all but the N highest of every M consecutive weights along the input (K) dim.
Shapes do not change: the zeros are stored and multiplied densely, and the report says what
speedup each target can get from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph, Node
from llmc.compiler.targets import TARGETS, Target
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassResult, Stage, register_pass
from llmc.passes.calibration_stats import channel_norms
from llmc.passes.decoder_structure import kv_bytes_per_token
from llmc.passes.options import PassOptions, option
from llmc.passes.quantize import FLOAT_DTYPES, lm_head_weights

METHODS = ("wanda", "magnitude")
# GPU architectures whose tensor cores have 2:4 sparse MMA instructions (Ampere and later).
SPARSE_TENSOR_CORE_ARCHS = {"sm_80", "sm_86", "sm_87", "sm_89", "sm_90"}


def parse_pattern(pattern: str) -> tuple[int, int]:
    """"2:4" -> (2, 4): keep at most n of every m consecutive weights."""
    n_text, sep, m_text = pattern.partition(":")
    try:
        n, m = int(n_text), int(m_text)
    except ValueError:
        n, m = 0, 0
    if not sep or not 0 < n < m:
        raise PassError(f"prune_sparse: pattern={pattern!r} is not N:M with 0 < N < M (e.g. 2:4)")
    return n, m


def weight_scores(weight: torch.Tensor, input_norms: torch.Tensor | None) -> torch.Tensor:
    """|W| (magnitude) or |W_ij| · ‖X_j‖₂ (Wanda) for weight [N, K], float64."""
    scores = weight.double().abs()
    return scores if input_norms is None else scores * input_norms.double()[None, :]


def unstructured_mask(scores: torch.Tensor, sparsity: float, per_row: bool) -> torch.Tensor:
    """True where a weight is kept: the lowest round(sparsity * size) scores of the matrix, or
    of each row, are dropped (ties drop the lower index first)."""
    flat = scores.reshape(scores.shape[0], -1) if per_row else scores.reshape(1, -1)
    cut = round(sparsity * flat.shape[1])
    keep = torch.ones_like(flat, dtype=torch.bool)
    keep.scatter_(1, torch.sort(flat, dim=1, stable=True).indices[:, :cut], False)
    return keep.reshape(scores.shape)


def n_m_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """True where a weight is kept: the n highest scores of every m consecutive along K."""
    rows, k = scores.shape
    groups = scores.reshape(rows, k // m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, torch.sort(groups, dim=2, stable=True, descending=True).indices[..., :n], True)
    return keep.reshape(rows, k)


def speedup_note(target: Target, pattern: tuple[int, int] | None) -> str:
    """What `target` can gain from these zeros, said plainly."""
    if pattern == (2, 4) and target.device == "cuda" and target.arch in SPARSE_TENSOR_CORE_ARCHS:
        return ("the GPU's sparse tensor cores run 2:4 GEMMs at up to 2x the dense math rate, but llmc "
                "has no 2:4 sparse kernels yet: this artifact runs dense, no speedup")
    if target.device == "cpu":
        return "none: CPU GEMMs are dense, the zeros are stored and multiplied like any weight"
    return (f"none: {target.arch} has no path for {'this N:M' if pattern else 'unstructured'} sparsity; "
            f"weights are stored and multiplied densely")


def sparse_linears(graph: Graph, m: int) -> tuple[list[Node], dict[str, list[str]]]:
    """(linears to sparsify, {reason: weight names} of those left alone); an N:M pattern
    needs K to be a multiple of M."""
    heads = lm_head_weights(graph)
    chosen, skipped = [], {}
    for node in graph.nodes:
        if node.op not in ("linear", "qlinear"):
            continue
        weight = node.inputs[1]
        param = graph.params.get(weight)
        reason = None
        if node.op == "qlinear" or param is None or param.quant is not None or weight not in graph.weights:
            reason = "quantised or not a stored weight (run prune_sparse before quantisation)"
        elif param.type.rank != 2 or param.type.dtype not in FLOAT_DTYPES:
            reason = "not a 2-D float weight"
        elif weight in heads:
            reason = "lm_head or tied embedding (kept dense)"
        elif param.type.shape[1] % m:
            reason = f"K is not a multiple of {m}"
        if reason is None:
            chosen.append(node)
        else:
            skipped.setdefault(reason, []).append(weight)
    return chosen, skipped


@register_pass
class PruneSparse(Pass):
    name = "prune_sparse"
    description = ("zero the lowest-scoring linear weights (magnitude or Wanda): a fraction `sparsity`, "
                   "or an N:M `pattern` such as 2:4 along the input dim; stored densely")
    stage = Stage.PRUNE
    lossy = True
    needs = ("calibration",)

    @dataclass(frozen=True)
    class Options(PassOptions):
        sparsity: float = option(0.0, "fraction of weights to zero, strictly between 0 and 1 (or give pattern)")
        pattern: str = option("", "N:M pattern along the input dim, e.g. 2:4 (or give sparsity)")
        method: str = option("wanda", "how weights are scored: |W|·‖X‖ on calibration text, or |W|",
                             choices=METHODS)

        def validate(self) -> None:
            if bool(self.pattern) == bool(self.sparsity):
                raise self.invalid("give exactly one of sparsity=FRACTION or pattern=N:M "
                                   f"(got sparsity={self.sparsity}, pattern={self.pattern!r})")
            if self.pattern:
                parse_pattern(self.pattern)
            elif not 0.0 < self.sparsity < 1.0:
                raise self.invalid(f"sparsity={self.sparsity} must lie strictly between 0 and 1")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        sparsity, pattern, method = self.checked_options()
        linears, skipped = sparse_linears(graph, pattern[1] if pattern else 1)
        if not linears:
            raise PassError(f"prune_sparse: no float linear weights to sparsify ({skipped}); "
                            f"run it before quantisation")
        norms = (channel_norms(graph, ctx, {n.inputs[0] for n in linears}, self.name)
                 if method == "wanda" else {})
        counts = {"linears": len(linears), "weights": 0, "zeros_before": 0, "zeros_after": 0}
        for node in linears:
            weight = graph.weights[node.inputs[1]]
            scores = weight_scores(weight, norms.get(node.inputs[0]))
            keep = (n_m_mask(scores, *pattern) if pattern is not None
                    else unstructured_mask(scores, sparsity, per_row=method == "wanda"))
            graph.weights[node.inputs[1]] = weight * keep.to(weight.dtype)
            counts["weights"] += weight.numel()
            counts["zeros_before"] += int((weight == 0).sum())
            counts["zeros_after"] += int((graph.weights[node.inputs[1]] == 0).sum())
        return PassResult(len(linears), True, self.details(ctx, graph, skipped, counts, pattern))

    def checked_options(self) -> tuple[float, tuple[int, int] | None, str]:
        sparsity, pattern, method = self.options.sparsity, self.options.pattern, self.options.method
        return sparsity, parse_pattern(pattern) if pattern else None, method

    def details(self, ctx: PassContext, graph: Graph, skipped: dict, counts: dict, pattern) -> dict:
        own = ctx.target if isinstance(ctx.target, Target) else TARGETS.get(ctx.target_name or "cpu")
        kv = kv_bytes_per_token(graph)
        return {"method": self.options.method, "pattern": self.options.pattern or None,
                "sparsity": self.options.sparsity or None,
                "skipped": {reason: len(names) for reason, names in sorted(skipped.items())},
                **counts, "sparsity_achieved": round(counts["zeros_after"] / counts["weights"], 6),
                "params_removed": 0, "bytes_removed": 0, "storage": "dense",
                "kv_bytes_per_token_before": kv, "kv_bytes_per_token_after": kv,
                "expected_speedup": speedup_note(own, pattern) if own is not None else None,
                "expected_speedup_by_target": {name: speedup_note(t, pattern) for name, t in TARGETS.items()}}


__all__ = ["PruneSparse", "parse_pattern", "weight_scores", "unstructured_mask", "n_m_mask", "speedup_note",
           "sparse_linears", "METHODS"]
