"""Attention of Triton plans over the paged KV cache (runtime/paged_attention.py's PagedKVCache):
each layer writes its new keys and values through the slot mapping, then runs the varlen prefill
kernel on the step's prefill chunks (reading cached prefix blocks through their block tables) and
the split-K decode kernel on its decode rows. With a fused rotary embedding, q and k arrive
unrotated: the cache write rotates k, the attention kernels rotate q as they load it."""

from __future__ import annotations

import torch

from llmc.codegen.triton.triton_attention import (
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv_cache,
)
from llmc.codegen.triton.triton_configs import AttentionConfig, attention_config
from llmc.runtime.attention import AttentionBackend
from llmc.runtime.paged_attention import PagedKVCache, StepMetadata


class TritonPagedAttention(AttentionBackend):
    """Attention over a PagedKVCache for the batch described by `metadata` (set per step), launched
    with `config`: the plan's attention config (the target's default without one)."""
    runs_triton = True

    def __init__(self, cache: PagedKVCache, target: str, config: AttentionConfig | None = None):
        self.cache = cache
        self.target = target
        self.config = config or attention_config(target)
        self.metadata: StepMetadata | None = None

    def forward(self, layer, q, k, v, *, num_heads, num_kv_heads, head_dim, scale, causal, window=None,
                positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None, rope_scaling=1.0):
        """q: [tokens, num_heads*head_dim], k/v: [tokens, num_kv_heads*head_dim]; given positions
        [tokens] and inv_freq [head_dim / 2], q and k are unrotated and the kernels apply the rotary
        embedding (cos/sin times rope_scaling). Returns [tokens, num_heads*head_dim] in q's dtype."""
        rotary = dict(positions=None if positions is None else positions.reshape(-1), inv_freq=inv_freq,
                      rope_scaling=rope_scaling)
        meta, cache = self.metadata, self.cache
        k_cache, v_cache = cache.k_cache[layer], cache.v_cache[layer]
        kv_scales = cache.kv_scales[layer] if cache.quantized else None
        write_kv_cache(k.reshape(-1, num_kv_heads, head_dim), v.reshape(-1, num_kv_heads, head_dim), k_cache,
                       v_cache, meta.slot_mapping, kv_scales=kv_scales, **rotary, target=self.target)
        shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                     window=window, kv_scales=kv_scales, target=self.target, config=self.config)
        out = q.new_empty(q.shape[0], num_heads * head_dim)
        if meta.prefills:
            rows = meta.prefill_rows
            o = paged_prefill_attention(q if rows is None else q[rows], k_cache, v_cache, meta.prefill_block_tables,
                                        meta.cu_seqlens_q, meta.context_starts, causal=causal,
                                        max_seqlen_q=meta.max_query_len, **_for_rows(rotary, rows), **shape)
            if rows is None:   # no decodes: the prefill queries are the whole batch
                return o
            out[rows] = o
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            # from host-side lengths: choosing splits must not wait for the device
            splits = decode_num_splits(self.config, meta.max_context_len, len(rows), num_kv_heads)
            if not meta.prefills:   # decodes only: row i is decode i, so no gather or scatter
                return paged_decode_attention(q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens,
                                              num_splits=splits, **rotary, **shape)
            out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, meta.decode_blocks, meta.decode_lens,
                                               num_splits=splits, **_for_rows(rotary, rows), **shape)
        return out


class TritonNoCacheAttention(AttentionBackend):
    """One sequence whose every token is in this forward (scoring, one-shot forwards): each layer
    runs the same kernels as serving over a temporary paged cache of the forward's tokens, in the
    artifact's KV dtype (int8/fp8 with its scales) and the plan's attention config, so the numbers
    match serving."""
    runs_triton = True

    def __init__(self, target: str, kv_dtype: torch.dtype | None = None,
                 kv_scales: list[torch.Tensor] | None = None, block_size: int = 16,
                 config: AttentionConfig | None = None):
        self.target = target
        self.kv_dtype = kv_dtype
        self.kv_scales = kv_scales
        self.block_size = block_size
        self.config = config

    def forward(self, layer, q, k, v, *, num_heads, num_kv_heads, head_dim, **kw):
        tokens = q.shape[0]
        num_blocks = max(1, -(-tokens // self.block_size))
        scales = None if self.kv_scales is None else [self.kv_scales[layer]]
        cache = PagedKVCache(1, num_blocks, self.block_size, num_kv_heads, head_dim, self.kv_dtype or k.dtype,
                             device=q.device, kv_scales=scales)
        paged = TritonPagedAttention(cache, self.target, self.config)
        paged.metadata = StepMetadata.build([(list(range(num_blocks)), 0, tokens)], self.block_size, q.device)
        return paged.forward(0, q, k, v, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, **kw)


def _for_rows(rotary: dict, rows: torch.Tensor | None) -> dict:
    """The launchers' rotary arguments for the batch rows `rows` (None: every row)."""
    if rows is None or rotary["positions"] is None:
        return rotary
    return {**rotary, "positions": rotary["positions"][rows]}


__all__ = ["TritonPagedAttention", "TritonNoCacheAttention"]
