"""Sequence parallelism for long prefills: ring attention across the tensor-parallel ranks.

Tensor parallelism splits attention by heads: each rank holds q/k/v of its own heads for every
token. For a prefill chunk of at least `threshold` tokens with no cached prefix, the ranks instead
split the sequence: a head-to-sequence exchange (point-to-point, an all-to-all) gives rank r the
queries, keys and values of every head for its contiguous slice r of the positions; each rank then
attends its queries to the key/value slices passed along the ring 0 -> 1 -> ... -> tp-1 (isend /
irecv), merging the partial outputs by their log-sum-exp; the inverse exchange returns each rank its
own heads for every position. Causal: a slice after rank r's is never computed nor sent to it, so
rank r receives r slices and the ring never wraps. Where attention is replicated (its KV heads do
not divide by tp) every rank already holds every head: it slices locally and the outputs are
all-gathered. The scores one rank holds at a time are [heads, slice, slice], not [heads/tp, t, t].

The KV cache is written first, exactly as the normal path writes it; decodes, chunks with a cached
prefix, sliding windows and soft-capped scores take the normal path. The threshold (tokens; 0 turns
ring attention off) is llmc.load's ring_attention_threshold or `--ring-attention-threshold`, else
LLMC_RING_ATTENTION_THRESHOLD, else 4096; rank 0 hands its value to the followers, so every rank
takes the same path."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from llmc.errors import RuntimeLlmcError
from llmc.runtime.attention import attend
from llmc.runtime.paged_attention import PagedAttention

THRESHOLD_ENV = "LLMC_RING_ATTENTION_THRESHOLD"
DEFAULT_THRESHOLD = 4096


def ring_threshold(tokens: int | None = None) -> int:
    """Prompt tokens from which a prefill runs ring attention (0: never): `tokens` (llmc.load's
    ring_attention_threshold, `--ring-attention-threshold`), else $LLMC_RING_ATTENTION_THRESHOLD,
    else 4096."""
    if tokens is not None:
        if type(tokens) is not int or tokens < 0:
            raise RuntimeLlmcError(f"ring_attention_threshold={tokens!r} is not a whole number of tokens; give e.g. "
                                   f"4096, or 0 to turn ring attention off")
        return tokens
    text = os.environ.get(THRESHOLD_ENV, "").strip()
    if not text:
        return DEFAULT_THRESHOLD
    if not text.isdigit():
        raise RuntimeLlmcError(f"{THRESHOLD_ENV}={text!r} is not a whole number of tokens; set it to e.g. 4096, "
                               f"or 0 to turn ring attention off")
    return int(text)


def slices(length: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's contiguous part of `length` positions (the first ones longer)."""
    base, extra = divmod(length, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + base + (r < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def _wait(works, timeout: float) -> None:
    for work in works:
        work.wait(timedelta(seconds=timeout))


def _exchange(pieces: list[torch.Tensor], shapes: list[tuple], timeout: float) -> list[torch.Tensor]:
    """All-to-all by point-to-point: send pieces[j] to rank j, receive a tensor of shapes[j] from it."""
    rank = dist.get_rank()
    got = [pieces[rank] if j == rank else pieces[rank].new_empty(shapes[j]) for j in range(len(pieces))]
    works = []
    for j in range(len(pieces)):
        if j != rank:
            works += [dist.isend(pieces[j].contiguous(), j), dist.irecv(got[j], j)]
    _wait(works, timeout)
    return got


def _block(q, k, v, scale: float, q_start: int, k_start: int):
    """Attention of q [H, n, d] at positions q_start.. to k/v [KV, m, d] at k_start..: (out, lse)."""
    heads, kv_heads = q.shape[0], k.shape[0]
    group = heads // kv_heads
    qg = q.reshape(kv_heads, group * q.shape[1], q.shape[2])          # query heads of one KV head together
    scores = torch.matmul(qg, k.transpose(1, 2)).mul_(scale).reshape(heads, q.shape[1], k.shape[1])
    if k_start + k.shape[1] - 1 > q_start:                            # some keys lie after some queries
        q_pos = torch.arange(q_start, q_start + q.shape[1])[:, None]
        k_pos = torch.arange(k_start, k_start + k.shape[1])[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).reshape(kv_heads, group * q.shape[1], k.shape[1])
    return torch.matmul(probs, v).reshape(heads, q.shape[1], v.shape[2]), lse


def ring_attention(q, k, v, bounds: list[tuple[int, int]], scale: float, timeout: float) -> torch.Tensor:
    """Causal attention of this rank's query slice [H, n, d] (positions bounds[rank]) over every
    slice up to its own; k/v [KV, n, d] are this rank's slice, the earlier ones come along the ring."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = _block(q, k, v, scale, bounds[rank][0], bounds[rank][0])
    kv = torch.stack([k, v])
    for step in range(1, world):
        source = rank - step                           # the slice arriving this step
        works, incoming = [], None
        if rank + 1 < world and source + 1 >= 0:       # pass on the slice held, which rank + 1 still needs
            works.append(dist.isend(kv.contiguous(), rank + 1))
        if source >= 0:
            length = bounds[source][1] - bounds[source][0]
            incoming = kv.new_empty(2, k.shape[0], length, k.shape[2])
            works.append(dist.irecv(incoming, rank - 1))
        _wait(works, timeout)
        if incoming is None:
            continue
        kv = incoming
        part, part_lse = _block(q, kv[0], kv[1], scale, bounds[rank][0], bounds[source][0])
        merged = torch.logaddexp(lse, part_lse)
        out = out * torch.exp(lse - merged) + part * torch.exp(part_lse - merged)
        lse = merged
    return out


def sequence_parallel_attention(q, k, v, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                                heads_split: bool, timeout: float) -> torch.Tensor:
    """q [t, num_heads*head_dim], k/v [t, num_kv_heads*head_dim]: this rank's heads (all heads
    when not `heads_split`) of one sequence at positions 0..t-1. Returns causal attention of the
    same layout, computed by ring attention across the group."""
    rank, world, t = dist.get_rank(), dist.get_world_size(), q.shape[0]
    bounds = slices(t, world)
    lo, hi = bounds[rank]

    def heads_first(x, n):  # [t, n*d] -> [n, t, d]
        return x.reshape(t, n, head_dim).transpose(0, 1)

    qh, kh, vh = heads_first(q, num_heads), heads_first(k, num_kv_heads), heads_first(v, num_kv_heads)
    if heads_split:  # rank j gets every rank's heads for slice j: concatenated, all heads in order
        packed = torch.cat([qh, kh, vh])                                   # [H + 2 KV, t, d] of this rank
        got = _exchange([packed[:, a:b] for a, b in bounds], [packed[:, lo:hi].shape] * world, timeout)
        parts = [p.split([num_heads, num_kv_heads, num_kv_heads]) for p in got]
        qs, ks, vs = (torch.cat([p[i] for p in parts]) for i in range(3))
    else:
        qs, ks, vs = qh[:, lo:hi], kh[:, lo:hi], vh[:, lo:hi]
    out = ring_attention(qs, ks, vs, bounds, scale, timeout)          # [H_all, n, d]
    if heads_split:  # back: rank j gets its heads for every slice
        pieces = list(out.split(num_heads))
        got = _exchange(pieces, [(num_heads, b - a, head_dim) for a, b in bounds], timeout)
        whole = torch.cat(got, dim=1)
    else:
        longest = bounds[0][1] - bounds[0][0]
        padded = out.new_zeros(num_heads, longest, head_dim)
        padded[:, :hi - lo] = out
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded)
        whole = torch.cat([g[:, :b - a] for g, (a, b) in zip(gathered, bounds)], dim=1)
    return whole.transpose(0, 1).reshape(t, num_heads * head_dim)


class RingPagedAttention(PagedAttention):
    """PagedAttention of one tensor-parallel rank whose long prefills run sequence_parallel_attention."""

    def __init__(self, cache, threshold: int, whole_heads: int, timeout: float):
        super().__init__(cache)
        self.threshold, self.whole_heads, self.timeout = threshold, whole_heads, timeout

    def _rings(self, chunk, causal, window, softcap) -> bool:
        long = chunk.q_len >= max(self.threshold, dist.get_world_size())  # every rank gets a slice
        return self.threshold > 0 and long and chunk.start == 0 and causal and window is None and softcap is None

    def forward(self, layer, q, k, v, *, num_heads, num_kv_heads, head_dim, scale, causal, window=None, softcap=None):
        meta = self.metadata
        if not any(self._rings(c, causal, window, softcap) for c in meta.prefills):
            return super().forward(layer, q, k, v, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, scale=scale, causal=causal, window=window, softcap=softcap)
        self.cache.write(layer, meta.slot_mapping, k.reshape(-1, num_kv_heads, head_dim),
                         v.reshape(-1, num_kv_heads, head_dim))
        out = q.new_empty(q.shape[0], num_heads * head_dim)
        for c in meta.prefills:
            rows = slice(c.q_start, c.q_start + c.q_len)
            if self._rings(c, causal, window, softcap):  # no cached prefix: its keys are these rows'
                out[rows] = sequence_parallel_attention(
                    q[rows], k[rows], v[rows], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    scale=scale, heads_split=num_heads != self.whole_heads, timeout=self.timeout)
                continue
            keys, values = self.cache.read(layer, c.blocks, q.dtype)
            ctx = c.start + c.q_len
            out[rows] = attend(q[rows], keys.reshape(-1, num_kv_heads, head_dim)[:ctx],
                               values.reshape(-1, num_kv_heads, head_dim)[:ctx], start=c.start,
                               num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                               causal=causal, window=window, softcap=softcap)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(layer, q[meta.decode_rows], meta,
                                                 num_heads, num_kv_heads, head_dim, scale, window, softcap)
        return out


def ring_backend(backend, manifest: dict, threshold: int, timeout: float):
    """The rank's paged attention backend, with ring attention for prefills of `threshold` tokens.
    Kept as it is when ring attention is off, the backend is not the CPU one, the ranks are also
    pipeline stages (the ring spans the whole group), the manifest does not say the model's heads, or
    the run is batch-invariant (a ring splits a prefill's keys by rank: its rows would round otherwise
    than the same prompt's in a short prefill; such runs take `batch_invariant=False`)."""
    hf = manifest["model"].get("hf_config") or {}
    whole_heads = hf.get("num_attention_heads", hf.get("n_head"))
    pipelined = manifest["parallel"].get("pp", 1) > 1
    if threshold <= 0 or type(backend) is not PagedAttention or pipelined or not isinstance(whole_heads, int):
        return backend
    if backend.invariant:
        return backend
    return RingPagedAttention(backend.cache, threshold, whole_heads, timeout)


__all__ = ["THRESHOLD_ENV", "DEFAULT_THRESHOLD", "ring_threshold", "slices", "ring_attention",
           "sequence_parallel_attention", "RingPagedAttention", "ring_backend"]
