"""Attention backends: how the attention kernel finds the keys and values its queries see.
The kernel hands each layer's new q/k/v to `backend.forward`; a backend keeps its own
per-forward metadata (cache length here; block tables and slot mapping for a paged cache)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from llmc.compiler.ops import scaled_dot_product


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, num_heads: int,
           num_kv_heads: int, head_dim: int, scale: float, causal: bool,
           window: int | None = None, softcap: float | None = None, sequences: int = 1) -> torch.Tensor:
    """q: [t, num_heads*head_dim] at positions start..start+t-1; k/v: [ctx, num_kv_heads,
    head_dim] or [ctx, num_kv_heads*head_dim] for positions 0..ctx-1. Out: [t, num_heads*head_dim].
    With a sliding `window`, the query at position p sees only the keys in (p - window, p]; with
    `softcap`, scores are soft-capped (compiler.ops.scaled_dot_product). With `sequences` = n, q, k
    and v each hold n equally long sequences side by side, each attending only to its own keys, in
    one call (torch's CPU flash kernel costs 1.5-2x more as one call per sequence)."""
    t, ctx = q.shape[0] // sequences, k.shape[0] // sequences
    # batched [n, heads, tokens, head_dim]: torch's CPU flash kernel takes only 4-d inputs; 3-d
    # ones fall back to the math path, three times slower at 512 tokens
    qh = q.reshape(sequences, t, num_heads, head_dim).transpose(1, 2)
    kh = k.reshape(sequences, ctx, num_kv_heads, head_dim).transpose(1, 2)
    vh = v.reshape(sequences, ctx, num_kv_heads, head_dim).transpose(1, 2)
    if softcap is not None:
        out = scaled_dot_product(qh, kh, vh, visible_keys(t, ctx, start, causal, window, q.device), scale, softcap)
    elif causal and start == 0 and t == ctx and window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=num_heads != num_kv_heads)
    else:
        mask = visible_keys(t, ctx, start, causal, window, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=num_heads != num_kv_heads)
    return out.transpose(1, 2).reshape(sequences * t, num_heads * head_dim)


def visible_keys(t: int, ctx: int, start: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """[t, ctx] True where query i (at position start + i) may see key j; None when it sees all."""
    if not causal:
        return None
    sees_all = t == 1 and ctx == start + 1 and (window is None or window >= ctx)
    if sees_all:
        return None
    # query i sees keys 0..start + i, and with a window only those after start + i - window
    mask = torch.ones(t, ctx, dtype=torch.bool, device=device).tril(diagonal=start)
    return mask if window is None else mask.triu(diagonal=start - window + 1)


class AttentionBackend(ABC):
    """Where a layer's keys and values live between forwards."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                causal: bool, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [tokens, num_heads*head_dim], k/v: [tokens, num_kv_heads*head_dim] for this
        forward's tokens; returns [tokens, num_heads*head_dim]. `window`, `softcap`: see `attend`."""


class NoCacheAttention(AttentionBackend):
    """One sequence whose every token is in this forward; nothing is kept."""

    def forward(self, layer, q, k, v, *, num_heads, num_kv_heads, head_dim, scale, causal, window=None,
                softcap=None):
        return attend(q, k, v, start=0, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, scale=scale, causal=causal, window=window, softcap=softcap)


__all__ = ["AttentionBackend", "NoCacheAttention", "attend", "visible_keys"]
