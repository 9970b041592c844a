"""What a lossy pass costs in accuracy: the graph's next-token logits on calibration sequences
before and after it (perplexity, KL(ref || ours), top-1 agreement), and the compile-time budget
`max_ppl_increase` that fails a pass which raises perplexity too far."""

from __future__ import annotations

import math

import torch

from llmc.compiler.interpreter import interpret_many
from llmc.compiler.ir import Graph
from llmc.compiler.scoring import row_agreement, row_kl, token_nll
from llmc.errors import PassError


def graph_logits(graph: Graph, seqs: list[torch.Tensor], progress=None) -> list[torch.Tensor]:
    """Each sequence's logits [T, vocab] from the reference interpreter, all T rows (the
    sequences run node by node: each weight is read once for all of them)."""
    names = {v.name for v in graph.inputs}
    inputs = []
    for seq in seqs:
        positions = torch.arange(len(seq), dtype=torch.long)
        inputs.append({"input_ids": seq.long(), "positions": positions})
        if "logits_indices" in names:
            inputs[-1]["logits_indices"] = positions
    return [out[graph.outputs[0]].float() for out in interpret_many(graph, inputs, progress=progress)]


def perplexity(logits: list[torch.Tensor], seqs: list[torch.Tensor]) -> float:
    """exp(mean NLL) of every next token: row t of a sequence's logits predicts token t + 1
    (a last row, which predicts past the sequence, is ignored)."""
    nll = torch.cat([token_nll(lg[:len(seq) - 1], seq[1:]) for lg, seq in zip(logits, seqs)])
    return math.exp(nll.mean().item())


def mean_kl(ref_logits: list[torch.Tensor], logits: list[torch.Tensor]) -> float:
    """Mean over all rows of KL(ref || ours)."""
    return torch.cat([row_kl(r, o) for r, o in zip(ref_logits, logits)]).mean().item()


def top1_agreement(ref_logits: list[torch.Tensor], logits: list[torch.Tensor]) -> float:
    """Fraction of rows where ours and the reference agree on the most likely token."""
    return torch.cat([row_agreement(r, o) for r, o in zip(ref_logits, logits)]).mean().item()


def significant(x: float, digits: int = 6) -> float:
    """Round for the manifest: readable, and stable against last-bit noise in the report."""
    return float(f"{x:.{digits}g}")


class AccuracyMeter:
    """Measures lossy passes against the graph as it was before the first of them ran; the
    reference logits are computed once per pipeline run."""

    def __init__(self, seqs: list[torch.Tensor], walk=None):
        """walk(desc, graph), when given, makes the progress bar of one run through the graph."""
        self.seqs = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
        self.ref_logits: list[torch.Tensor] | None = None
        self.ref_ppl: float | None = None
        self.walk = walk

    def _logits(self, graph: Graph, desc: str) -> list[torch.Tensor]:
        # the logits rows that predict a next token: the last row of each sequence has none
        if self.walk is None:
            return [lg[:-1] for lg in graph_logits(graph, self.seqs)]
        with self.walk(desc, graph) as bar:
            return [lg[:-1] for lg in graph_logits(graph, self.seqs, bar.update)]

    def capture_reference(self, graph: Graph) -> None:
        if self.ref_logits is None:
            self.ref_logits = self._logits(graph, "reference logits")
            self.ref_ppl = perplexity(self.ref_logits, self.seqs)

    def measure(self, graph: Graph) -> dict:
        """Figures of `graph` against the reference: call capture_reference first."""
        assert self.ref_logits is not None, "capture_reference must run before measure"
        logits = self._logits(graph, "accuracy")
        return {"ppl_before": significant(self.ref_ppl),
                "ppl_after": significant(perplexity(logits, self.seqs)),
                "kl": significant(mean_kl(self.ref_logits, logits)),
                "top1_agreement": significant(top1_agreement(self.ref_logits, logits)),
                "tokens": sum(len(s) - 1 for s in self.seqs)}


def check_budget(pass_name: str, accuracy: dict, max_ppl_increase: float | None) -> None:
    """Raise if the pass left calibration perplexity more than `max_ppl_increase` percent
    above the reference."""
    if max_ppl_increase is None:
        return
    before, after = accuracy["ppl_before"], accuracy["ppl_after"]
    increase = (after / before - 1.0) * 100.0
    if not increase <= max_ppl_increase:  # also catches a NaN perplexity
        raise PassError(f"pass {pass_name!r} raised calibration perplexity from {before:.4g} to "
                        f"{after:.4g} ({increase:+.2f}%), over the budget of {max_ppl_increase:g}%; "
                        f"relax --max-ppl-increase or choose a milder scheme")


__all__ = ["graph_logits", "perplexity", "mean_kl", "top1_agreement", "AccuracyMeter", "check_budget"]
