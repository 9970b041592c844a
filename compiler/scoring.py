"""Next-token scoring math shared by the compile-time accuracy measurement of lossy passes and
`llmc eval`: per-row negative log-likelihood, KL divergence and top-1 agreement, in float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], targets [rows] -> -log p(target) per row, float64 [rows]."""
    return F.cross_entropy(logits.double(), targets.long(), reduction="none")


def row_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(ours)) per row, float64 [rows]."""
    ref_logp = F.log_softmax(ref_logits.double(), dim=-1)
    logp = F.log_softmax(logits.double(), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def row_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """1.0 where both pick the same most likely token, else 0.0 [rows]."""
    return (ref_logits.argmax(-1) == logits.argmax(-1)).double()


__all__ = ["token_nll", "row_kl", "row_agreement"]
