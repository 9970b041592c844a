"""A test-only attention backend: one sequence at a time, keys and values in one preallocated
tensor per layer, so plan tests can decode step by step without the paged engine."""

import torch

from llmc.errors import RuntimeLlmcError
from llmc.runtime.attention import AttentionBackend, attend


class ContiguousKVCache(AttentionBackend):
    """One sequence at a time, keys and values in one preallocated tensor per layer.
    Each forward writes its tokens at `length`; the caller then calls `advance(n)`."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.max_len = max_len
        self.length = 0
        # k_cache[layer], v_cache[layer]: [max_len, num_kv_heads, head_dim]
        shape = (max_len, num_kv_heads, head_dim)
        self.k_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def forward(self, layer, q, k, v, *, num_heads, num_kv_heads, head_dim, scale, causal, window=None):
        start, n = self.length, q.shape[0]
        self._check_room(n)
        if layer >= len(self.k_cache):
            raise RuntimeLlmcError(f"attention layer {layer} has no KV cache; the cache was made "
                                   f"for {len(self.k_cache)} layers; size it from the plan's kv_layout()")
        end = start + n
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache[start:end] = k.reshape(n, num_kv_heads, head_dim)
        v_cache[start:end] = v.reshape(n, num_kv_heads, head_dim)
        return attend(q, k_cache[:end], v_cache[:end], start=start, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, causal=causal,
                      window=window)

    def advance(self, n: int) -> None:
        """Count the `n` tokens of the last forward as cached."""
        self._check_room(n)
        self.length += n

    def reset(self) -> None:
        self.length = 0

    def _check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise RuntimeLlmcError(f"KV cache overflow: {self.length} cached tokens + {n} new "
                                   f"exceed max_len {self.max_len}; shorten the prompt or "
                                   f"max_tokens, or make the cache longer")
