"""Speculative sampling's acceptance rule (Leviathan et al. 2023, Chen et al. 2023): draft token
x drawn from q is kept with probability min(1, p(x)/q(x)); at the first rejection the token is
drawn from the residual max(0, p - q), normalised, and when every draft is kept one more comes
from p. The tokens that come out are distributed exactly as drawing from p one at a time."""

from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                     num_drafts: torch.Tensor, uniform: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every row's drafts at once; rows may carry fewer drafts than the widest.

    target_probs: [rows, K + 1, vocab], p at each draft position and one past the last
    draft_probs:  [rows, K, vocab] the q each draft was drawn from; None: one-hot (n-gram, greedy drafts)
    draft_tokens: [rows, K] long; entries past a row's num_drafts are ignored
    num_drafts:   [rows] long, in [0, K]
    uniform:      [rows, K] U[0, 1) draws for the acceptance tests
    noise:        [rows, vocab] Exp(1) draws for the final token (the exponential race)
    Returns (tokens [rows, K + 1], num_emitted [rows]): row i's first num_emitted[i] tokens are
    its kept drafts followed by one token from the residual (or from p)."""
    rows, k = draft_tokens.shape
    arange = torch.arange(rows, device=draft_tokens.device)
    p_draft = target_probs[:, :k].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else \
        draft_probs.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    # u < p / q without dividing: q is never 0 at a token drawn from it
    keep = (uniform * q_draft < p_draft) & (torch.arange(k, device=draft_tokens.device) < num_drafts.unsqueeze(1))
    num_accepted = keep.long().cumprod(dim=1).sum(dim=1)
    residual = _residual(target_probs[arange, num_accepted], draft_probs, draft_tokens, num_accepted, num_drafts)
    final = (residual / noise.clamp_min(1e-10)).argmax(dim=1)
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(rows, 1)], dim=1)
    tokens[arange, num_accepted] = final
    return tokens, num_accepted + 1


def _residual(p: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
              position: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) at each row's first rejected position (unnormalised: the exponential race
    does not need it); p itself where every draft was kept."""
    rows, k = draft_tokens.shape
    rejected = position < num_drafts
    at = position.clamp(max=max(k - 1, 0))
    arange = torch.arange(rows, device=p.device)
    if k == 0:
        return p
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(1, draft_tokens[arange, at].unsqueeze(1), 1.0)
    else:
        q = draft_probs[arange, at]
    residual = torch.where(rejected.unsqueeze(1), (p - q).clamp_min(0.0), p)
    # p == q up to rounding leaves nothing: then p itself is the right distribution
    empty = residual.sum(dim=1, keepdim=True) <= 0
    return torch.where(empty, p, residual)
