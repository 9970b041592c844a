"""Paged KV cache and the attention backend that reads it: new keys/values are written
through a slot mapping, and each sequence's context is read back through its block table.
Prefill chunks attend per sequence; decode tokens attend in one batched call. A cache made
with `kv_scales` stores int8/fp8 codes, one made with `kv_group` packed int4 codes with their
per-group scales; both are quantised on write and dequantised on read."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from llmc.codegen.native import cpu_native
from llmc.compiler.ops import scaled_dot_product
from llmc.compiler.quant import kv_int4_row_bytes
from llmc.runtime.attention import AttentionBackend, attend
from llmc.runtime.host_memory import zeroed
from llmc.runtime.kv_policy import accumulate_scores
from llmc.runtime.kv_quant import dequantize_kv, dequantize_kv_int4, is_quantized_kv, quantize_kv, quantize_kv_int4


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A cache tensor of zeros; on the CPU in pages zero-filled at first touch (host_memory.zeroed), so the
    RSS grows as tokens fill the cache rather than by the whole budget at load."""
    if torch.device(device).type == "cpu":
        return zeroed(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class PagedKVCache:
    """Per layer `k_cache`/`v_cache`: [num_blocks, block_size, kv_heads, head_dim] of `dtype`.
    With an int8/float8_e4m3fn `dtype`, `kv_scales[layer]` fp32 [2, kv_heads] (keys, values)
    gives each head's scale. With `kv_group` (an int4 cache, `dtype` uint8) the last dim is each
    token's head as runtime/kv_quant.quantize_kv_int4 packs it: head_dim / 2 code bytes, then an fp16
    scale per kv_group channels, so copies, exports and block moves carry the scales with the codes."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu",
                 kv_scales: list[torch.Tensor] | None = None, kv_group: int | None = None):
        assert kv_group is None or (dtype == torch.uint8 and head_dim % kv_group == 0 and head_dim % 2 == 0), \
            (dtype, head_dim, kv_group)
        row = head_dim if kv_group is None else kv_int4_row_bytes(head_dim, kv_group)
        shape = (num_blocks, block_size, num_kv_heads, row)
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.dtype = dtype
        self.kv_group = kv_group
        self.quantized = is_quantized_kv(dtype) or kv_group is not None
        assert is_quantized_kv(dtype) == (kv_scales is not None), \
            f"{dtype} KV cache with kv_scales={kv_scales is not None}"
        assert kv_scales is None or len(kv_scales) == num_layers, (len(kv_scales), num_layers)
        self.kv_scales = None if kv_scales is None else [s.to(device=device, dtype=torch.float32)
                                                         for s in kv_scales]
        # every layer's cache is a view into one tensor, so a step's keys for all layers are one copy
        self._k_layers = _zeros((num_layers, *shape), dtype, device)
        self._v_layers = _zeros((num_layers, *shape), dtype, device)
        self.k_cache, self.v_cache = list(self._k_layers.unbind(0)), list(self._v_layers.unbind(0))
        # each layer's cache as one row per slot, [slots, kv_heads * head_dim]: views made once, so a
        # decode step's write and span read cost no reshaping calls per layer
        self._rows = [[c.view(-1, num_kv_heads * row) for c in layers]
                      for layers in (self.k_cache, self.v_cache)]
        self._scratch = [torch.empty(0, dtype=dtype, device=device) for _ in range(2)]   # see read
        # what the native decode attention writes and reads (codegen/native/cpu_native.py), per layer
        self._native = [None if self.quantized else cpu_native.cache_pointers(k, v) for k, v in zip(*self._rows)]

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layer` as one row per slot, [slots, kv_heads * head_dim] (views)."""
        return self._rows[0][layer], self._rows[1][layer]

    def native_pointers(self, layer: int) -> tuple[int, int, int] | None:
        return self._native[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [tokens, kv_heads, head_dim] (or [tokens, kv_heads * head_dim]) at cache `slots`
        [tokens] of `layer`."""
        for rows, x, which in ((self._rows[0][layer], k, 0), (self._rows[1][layer], v, 1)):
            if self.kv_group is not None:   # dynamic scales: each token's head groups quantised on their own
                packed = quantize_kv_int4(x.reshape(x.shape[0], self.num_kv_heads, self.head_dim), self.kv_group)
                rows.index_copy_(0, slots, packed.reshape(x.shape[0], -1))
            elif self.quantized:   # per-head scales: quantised as [tokens, kv_heads, head_dim]
                codes = quantize_kv(x.reshape(x.shape[0], *self.k_cache[layer].shape[2:]),
                                    self.kv_scales[layer][which], self.dtype)
                # CPU torch has no index_copy_ for float8; both code dtypes are one byte
                rows.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8).reshape(x.shape[0], -1))
            else:
                rows.index_copy_(0, slots, x if x.dim() == 2 else x.reshape(x.shape[0], -1))

    def write_layers(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store every layer's k/v [layers, tokens, kv_heads, head_dim] at cache `slots` [tokens]
        (an unquantised cache)."""
        for cache, x in ((self._k_layers, k), (self._v_layers, v)):
            cache.view(cache.shape[0], -1, *cache.shape[3:]).index_copy_(1, slots, x)

    def read(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype,
             scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` (any index shape) as [*blocks.shape, block_size, kv_heads,
        head_dim]; a quantised cache dequantises them to `dtype`. With `scratch`, the gathered blocks
        land in two buffers this cache reuses, valid until the next scratch read: a fresh
        multi-megabyte gather per layer costs more in page faults than in copying."""
        # index_select over blocks viewed as rows: several times faster than advanced indexing, and
        # than index_select on the 4-d cache (which copies element by element)
        flat, shape = blocks.reshape(-1), (*blocks.shape, *self.k_cache[layer].shape[1:])
        keys, values = (self._gather(c[layer].flatten(1), flat, which if scratch else None).view(shape)
                        for which, c in enumerate((self.k_cache, self.v_cache)))
        return self._dequantize(layer, keys, values, dtype)

    def _dequantize(self, layer: int, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype):
        """Stored keys and values [..., kv_heads, stored row] as [..., kv_heads, head_dim] of `dtype`
        (an unquantised cache's as they are)."""
        if not self.quantized:
            return keys, values
        if self.kv_group is not None:
            return tuple(dequantize_kv_int4(x, self.head_dim, self.kv_group, dtype) for x in (keys, values))
        scales = self.kv_scales[layer]
        return dequantize_kv(keys, scales[0], dtype), dequantize_kv(values, scales[1], dtype)

    def _gather(self, rows: torch.Tensor, index: torch.Tensor, buffer: int | None) -> torch.Tensor:
        if buffer is None:
            return rows.index_select(0, index)
        numel = index.numel() * rows.shape[1]
        if self._scratch[buffer].numel() < numel:
            self._scratch[buffer] = rows.new_empty(numel)
        return torch.index_select(rows, 0, index, out=self._scratch[buffer][:numel].view(-1, rows.shape[1]))

    def read_span(self, layer: int, first: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """As `read` for the consecutive blocks first .. first + count - 1: views, no gather (a
        quantised cache still dequantises them)."""
        keys, values = self.k_cache[layer][first:first + count], self.v_cache[layer][first:first + count]
        return self._dequantize(layer, keys, values, dtype)

    def heads_span(self, layer: int, first_slot: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the `count` consecutive slots from `first_slot` of an unquantised cache,
        heads first, [1, kv_heads, count, head_dim]: views, one call each."""
        kv, hd = self.k_cache[layer].shape[2:]
        return tuple(torch.as_strided(rows, (1, kv, count, hd), (0, hd, kv * hd, 1),
                                      rows.storage_offset() + first_slot * kv * hd)
                     for rows in (self._rows[0][layer], self._rows[1][layer]))

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Keys and values at cache slots `src` go to slots `dst`, in every layer (a token tree's kept
        path moved to the positions it now holds)."""
        src_t, dst_t = (torch.tensor(s, device=self.k_cache[0].device) for s in (src, dst))
        for cache in self.k_cache + self.v_cache:
            flat = cache.view(-1, *cache.shape[2:])
            flat[dst_t] = flat[src_t]

    def export_blocks(self, blocks: list[int]) -> torch.Tensor:
        """The stored bytes of `blocks` in every layer, [2 (keys, values), layers, len(blocks), block bytes]
        (uint8, a copy): what runtime/kv_transfer.py moves into another engine's cache of this layout."""
        index = torch.tensor(blocks, device=self._k_layers.device)
        sources = [c.view(torch.uint8).flatten(2) for c in (self._k_layers, self._v_layers)]
        out = sources[0].new_empty((2, sources[0].shape[0], len(blocks), sources[0].shape[2]))
        for source, part in zip(sources, out):   # gathered in place: one copy of the blocks, not two
            torch.index_select(source, 1, index, out=part)
        return out

    def import_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Store export_blocks' bytes `data` [2, layers, len(blocks), block bytes] into `blocks`."""
        index = torch.tensor(blocks, device=self._k_layers.device)
        for cache, part in zip((self._k_layers, self._v_layers), data):
            cache.view(torch.uint8).flatten(2).index_copy_(1, index, part)

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A KV policy's compaction (runtime/kv_policy.py): in layer l and KV head h, slot dst[i] gets what slot
        src[l, h, i] holds, keys and values. All kept entries are read before any is written, so a destination
        may be a source or a block the step gave back."""
        layers, heads, n = src.shape
        li = torch.arange(layers)[:, None, None]
        hi = torch.arange(heads)[None, :, None]
        for cache in (self._k_layers, self._v_layers):
            flat = cache.view(torch.uint8).view(layers, -1, heads, cache.shape[-1] * cache.element_size())
            moved = flat[li, src, hi]                      # [layers, heads, n, row bytes]
            flat[li, dst[None, None, :], hi] = moved

    def keys(self, layer: int, blocks: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `count` cached keys of the sequence whose table is `blocks`: [count, kv_heads, head_dim]."""
        keys = self.k_cache[layer].index_select(0, blocks)
        if self.kv_group is not None:
            keys = dequantize_kv_int4(keys, self.head_dim, self.kv_group, dtype)
        elif self.quantized:
            keys = dequantize_kv(keys, self.kv_scales[layer][0], dtype)
        return keys.reshape(-1, self.num_kv_heads, self.head_dim)[:count].to(dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets src's keys and values in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for cache in self.k_cache + self.v_cache:
            cache[dst] = cache[src]


@dataclass
class PrefillChunk:
    q_start: int            # first row of this sequence's queries in the packed batch
    q_len: int
    start: int              # position of the first query in its sequence
    blocks: torch.Tensor    # block ids covering positions [0, start + q_len)
    # a speculative token tree's [q_len, start + q_len] visible keys (runtime/draft_tree.py);
    # None: causal
    visible: torch.Tensor | None = None


@dataclass
class StepMetadata:
    """How one packed batch maps onto the cache; built once per step, used by every layer.
    The packed prefill fields and `decode_lens` are what the Triton attention kernels read."""
    slot_mapping: torch.Tensor              # [tokens] cache slot of each new token
    prefills: list[PrefillChunk]
    decode_rows: torch.Tensor | None        # [decodes] rows of single-token sequences
    decode_blocks: torch.Tensor | None      # [decodes, max_blocks] block tables, padded
    decode_mask: torch.Tensor | None        # [decodes, 1, 1, max_blocks * block_size] True = visible
    # prefill chunks packed: their queries are rows prefill_rows (None: every row, in order)
    prefill_rows: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None          # int32 [prefills + 1] query offsets in the packing
    context_starts: torch.Tensor | None = None        # int32 [prefills] position of each chunk's first query
    prefill_block_tables: torch.Tensor | None = None  # int32 [prefills, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None = None           # int32 [decodes] keys each decode row sees (its own too)
    max_query_len: int = 0                  # longest prefill chunk
    max_context_len: int = 0                # longest context any query sees
    # one decode whose blocks are consecutive in the cache: (first block, blocks, keys it sees)
    decode_span: tuple[int, int, int] | None = None
    _decode_biases: dict = field(default_factory=dict, repr=False)  # by (window, dtype)
    _native_step: list = field(default_factory=list, repr=False)    # [native_step's answer] once made
    _native_read_step: list = field(default_factory=list, repr=False)   # [native_read_step's] likewise
    _seqs: list = field(default_factory=list, repr=False)   # build's (block table, start, new tokens)
    _native_row_step: list = field(default_factory=list, repr=False)   # [native_row_step's] once made

    def native_row_step(self, block_size: int) -> "cpu_native.DecodeStep | None":
        """Every row of the step (prefill queries too) as a decode row of the native attention: its
        slot, its sequence's block table and the keys it sees (its position + 1); None where the
        native kernels are not built, or a row sees a token tree rather than a causal prefix."""
        if not self._native_row_step:
            step = None
            if self._seqs and all(c.visible is None for c in self.prefills):
                # a sequence's table, padded, once per row it brings; a row at position p sees p + 1 keys
                used = [-(-(start + n) // block_size) for _, start, n in self._seqs]
                width = max(used)
                cut = [t[:u] for (t, _, _), u in zip(self._seqs, used)]
                padded = torch.tensor([t + [0] * (width - len(t)) for t in cut], dtype=torch.int64)
                tables = padded.repeat_interleave(torch.tensor([n for *_, n in self._seqs]), dim=0)
                lens = torch.cat([torch.arange(start + 1, start + n + 1, dtype=torch.int32)
                                  for _, start, n in self._seqs])
                step = cpu_native.read_step(tables, lens, int(lens.max()), block_size)
                step = None if step is None else step._replace(slots=self.slot_mapping.data_ptr())
                self._row_tensors = (tables, lens)   # kept alive while the step's pointers are used
            self._native_row_step.append(step)
        return self._native_row_step[0]

    def native_read_step(self, block_size: int) -> "cpu_native.DecodeStep | None":
        """The decode rows' block tables and lengths as native kernels that only read the cache take
        them (any number of rows); made once a step, read by every layer."""
        if not self._native_read_step:
            self._native_read_step.append(None if self.decode_rows is None else cpu_native.read_step(
                self.decode_blocks, self.decode_lens, self.max_context_len, block_size))
        return self._native_read_step[0]

    def native_step(self, block_size: int) -> "cpu_native.DecodeStep | None":
        """The native decode attention's view of a decode-only step (None: not one, or too many
        rows); made once a step, read by every layer."""
        if not self._native_step:
            self._native_step.append(None if self.prefills or self.decode_rows is None else cpu_native.decode_step(
                self.slot_mapping, self.decode_blocks, self.decode_lens, self.max_context_len, block_size))
        return self._native_step[0]

    def decode_bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """decode_mask as an additive 0/-inf mask of `dtype`, narrowed to a sliding `window` (a
        decode at position p sees keys p - window + 1 .. p): built once per step, not per layer."""
        bias = self._decode_biases.get((window, dtype))
        if bias is None:
            mask = self.decode_mask
            if window is not None:
                mask = mask & (torch.arange(mask.shape[-1], device=mask.device)
                               >= self.decode_lens[:, None] - window)[:, None, None, :]
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._decode_biases[(window, dtype)] = bias
        return bias

    def decode_block_diagonal_bias(self, window: int | None, num_heads: int, num_kv_heads: int,
                                   dtype: torch.dtype) -> torch.Tensor:
        """[decodes, heads, max_blocks * block_size * kv_heads] of `dtype`: 0 where query head j may see
        the gathered row (key position t, KV head h), i.e. h is j's KV head and t is visible as in
        decode_bias; -inf elsewhere. Built once per step, not per layer."""
        key = (window, "block_diagonal", num_heads, num_kv_heads, dtype)
        bias = self._decode_biases.get(key)
        if bias is None:
            visible = self.decode_bias(window, dtype)[:, 0, 0]           # [decodes, ctx]: 0 or -inf
            own_head = torch.eye(num_kv_heads, dtype=torch.bool, device=visible.device)
            bias = torch.where(own_head[None, :, None, :], visible[:, None, :, None], float("-inf"))
            b, group = visible.shape[0], num_heads // num_kv_heads  # query head j reads KV head j // group
            bias = bias.reshape(b, num_kv_heads, 1, -1).expand(b, num_kv_heads, group, bias[0, 0].numel())
            self._decode_biases[key] = bias = bias.reshape(b, num_heads, -1).contiguous()
        return bias

    @functools.cached_property   # read by every attention layer of the step
    def fresh_prefill_runs(self) -> list[tuple[int, int, int]]:
        """(first chunk, chunks, tokens each) for each run of two or more prefill chunks that lie side by
        side in the batch, start at position 0, have the same length and a causal mask: each run is one
        batched attention (attend's `sequences`)."""
        runs: list[tuple[int, int, int]] = []
        for i, c in enumerate(self.prefills):
            fresh = c.start == 0 and c.visible is None
            if runs and fresh and runs[-1][2] == c.q_len and runs[-1][0] + runs[-1][1] == i \
                    and self.prefills[i - 1].q_start + self.prefills[i - 1].q_len == c.q_start:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, c.q_len)
            elif fresh:
                runs.append((i, 1, c.q_len))
        return [r for r in runs if r[1] > 1]

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int]], block_size: int, device="cpu") -> "StepMetadata":
        """seqs: (block_table, start, num_new_tokens) in batch order; tensors go to `device`."""
        slots, prefills, pre_tables, dec_rows, dec_tables, dec_lens = [], [], [], [], [], []
        row = 0
        for table, start, n in seqs:
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
            if n == 1 and start > 0:
                dec_rows.append(row)
                dec_tables.append(table[: start // block_size + 1])
                dec_lens.append(start + 1)
            else:
                used = (start + n + block_size - 1) // block_size
                pre_tables.append(table[:used])
                prefills.append(PrefillChunk(row, n, start, torch.tensor(table[:used], device=device)))
            row += n
        meta = cls(torch.tensor(slots, device=device), prefills, None, None, None)
        meta._seqs = seqs
        meta.max_context_len = max([c.start + c.q_len for c in prefills] + dec_lens, default=0)
        if prefills:
            meta._pack_prefills(pre_tables, bool(dec_rows), device)
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            meta.decode_rows = torch.tensor(dec_rows, device=device)
            meta.decode_blocks = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], device=device)
            meta.decode_lens = lens = torch.tensor(dec_lens, dtype=torch.int32, device=device)
            meta.decode_mask = (torch.arange(width * block_size, device=device)[None, :]
                                < lens[:, None])[:, None, None, :]
            table = dec_tables[0]
            if len(dec_tables) == 1 and table == list(range(table[0], table[0] + len(table))):
                meta.decode_span = (table[0], len(table), dec_lens[0])
        return meta

    def _pack_prefills(self, tables: list[list[int]], has_decodes: bool, device) -> None:
        chunks = self.prefills
        if has_decodes:
            self.prefill_rows = torch.tensor([c.q_start + i for c in chunks for i in range(c.q_len)], device=device)
        offsets = [0]
        for c in chunks:
            offsets.append(offsets[-1] + c.q_len)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        self.cu_seqlens_q = torch.tensor(offsets, dtype=torch.int32, device=device)
        self.context_starts = torch.tensor([c.start for c in chunks], dtype=torch.int32, device=device)
        self.prefill_block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
        self.max_query_len = max(c.q_len for c in chunks)


class PagedAttention(AttentionBackend):
    """Attention over a PagedKVCache for the batch described by `metadata` (set per step)."""

    def __init__(self, cache: PagedKVCache, invariant: bool = False):
        self.cache = cache
        self.metadata: StepMetadata | None = None
        self.invariant = invariant   # every query row through the native kernel (runtime/batch_invariance.py)
        # an H2O policy's sequences this step, set by the model runner: (state, first query row, first slot,
        # rows, block table); each layer's attention adds to their scores (runtime/kv_policy.py)
        self.scored: list[tuple] | None = None

    def forward(self, layer, q, k, v, *, num_heads, num_kv_heads, head_dim, scale, causal, window=None, softcap=None):
        out = self._attention(layer, q, k, v, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              scale=scale, causal=causal, window=window, softcap=softcap)
        for state, row, first, n, blocks in self.scored or ():
            keys = self.cache.keys(layer, blocks, first + n, torch.float64)
            accumulate_scores(state.scores[layer], q[row:row + n].reshape(n, num_heads, head_dim), keys, first,
                              scale)
        return out

    @property
    def quantizes_kv(self) -> bool:
        """A quantised cache stores codes: keys and values are read back through it."""
        return self.cache.quantized

    def _attention(self, layer, q, k, v, *, num_heads, num_kv_heads, head_dim, scale, causal, window=None,
                   softcap=None):
        meta, cache = self.metadata, self.cache
        if self.invariant and softcap is None and causal:
            out = self._invariant_rows(layer, q, k, v, None, num_heads, num_kv_heads, head_dim, scale, window)
            if out is not None:
                return out
        cache.write(layer, meta.slot_mapping, k, v)
        if not meta.prefills and meta.decode_rows is not None:   # decodes only: row i is decode i
            return self._decode(layer, q, meta, num_heads, num_kv_heads, head_dim, scale, window, softcap)
        out = q.new_empty(q.shape[0], num_heads * head_dim)
        batched = set()
        if window is None and softcap is None and causal and not self.cache.quantized:
            for first, count, length in meta.fresh_prefill_runs:
                rows = slice(meta.prefills[first].q_start, meta.prefills[first].q_start + count * length)
                out[rows] = attend(q[rows], k[rows], v[rows], start=0, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, scale=scale, causal=True, sequences=count)
                batched.update(range(first, first + count))
        for i, c in enumerate(meta.prefills):
            if i in batched:
                continue
            keys, values = self._prefill_context(layer, c, k, v, q.dtype, num_kv_heads, head_dim)
            rows = q[c.q_start:c.q_start + c.q_len]
            if c.visible is not None:
                out[c.q_start:c.q_start + c.q_len] = _attend_tree(rows, keys, values, c.visible, num_heads,
                                                                  num_kv_heads, head_dim, scale, softcap)
                continue
            out[c.q_start:c.q_start + c.q_len] = attend(
                rows, keys, values, start=c.start, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, causal=causal, window=window,
                softcap=softcap)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(layer, q[meta.decode_rows], meta,
                                                 num_heads, num_kv_heads, head_dim, scale, window, softcap)
        return out

    def decode_native(self, q, k, v, rotary, *, layer, num_heads, num_kv_heads, head_dim, scale, causal=True,
                      window=None, softcap=None, **attrs) -> torch.Tensor | None:
        """`forward` for a step of decodes only, with the rotary (cos, sin [decodes, head_dim]) on q and
        k folded in, as one native call (codegen/native/cpu_native.py); None where it does not apply: the
        caller rotates and runs `forward`. Nothing is written to the cache unless it applies. Takes the
        attention op's attrs as they are; those it does not read (`attrs`) do not change decoding."""
        if softcap is not None or not causal or self.scored:   # scores read the rotated queries: forward's
            return None
        if self.invariant:
            return self._invariant_rows(layer, q, k, v, rotary, num_heads, num_kv_heads, head_dim, scale, window)
        step = self.metadata.native_step(self.cache.block_size)
        cache = self.cache.native_pointers(layer)
        if step is None or cache is None:
            return None
        return cpu_native.decode_attention(q, k, v, rotary, cache, step, window, num_heads, num_kv_heads,
                                           head_dim, scale)

    def _invariant_rows(self, layer, q, k, v, rotary, num_heads, num_kv_heads, head_dim, scale, window):
        """Attention for every row of the step as the native decode kernel computes a decode row (rotary
        folded in where given, k and v written to the cache first), INVARIANT_ROWS rows a call: a row's
        output is the same bits whatever else the step holds. None where it does not apply."""
        step = self.metadata.native_row_step(self.cache.block_size)
        cache = self.cache.native_pointers(layer)
        if step is None or cache is None or q.dim() != 2:
            return None
        rows = q.shape[0]
        if rows <= INVARIANT_ROWS:
            return cpu_native.decode_attention(q, k, v, rotary, cache, step, window, num_heads, num_kv_heads,
                                               head_dim, scale, invariant=True)
        out = q.new_empty(rows, num_heads * head_dim)
        for first in range(0, rows, INVARIANT_ROWS):
            end = min(first + INVARIANT_ROWS, rows)
            part = _rows_of_step(step, first, end)
            cut = None if rotary is None else tuple(t[first:end] for t in rotary)
            got = cpu_native.decode_attention(q[first:end], k[first:end], v[first:end], cut, cache, part, window,
                                              num_heads, num_kv_heads, head_dim, scale, invariant=True)
            if got is None:
                return None if first == 0 else _fail_midway()
            out[first:end] = got
        return out

    def _prefill_context(self, layer, c: PrefillChunk, k, v, dtype, num_kv_heads, head_dim):
        """Keys and values [start + q_len, kv_heads, head_dim] a prefill chunk attends to. A chunk
        from position 0 sees only its own rows, which an unquantised cache holds unchanged: they are
        taken from k and v rather than gathered back out of the cache."""
        if c.start == 0 and not self.cache.quantized:
            rows = slice(c.q_start, c.q_start + c.q_len)
            return tuple(x[rows].reshape(-1, num_kv_heads, head_dim).to(self.cache.dtype) for x in (k, v))
        keys, values = self.cache.read(layer, c.blocks, dtype, scratch=True)
        ctx = c.start + c.q_len
        return (keys.reshape(-1, num_kv_heads, head_dim)[:ctx], values.reshape(-1, num_kv_heads, head_dim)[:ctx])

    def _decode(self, layer, q, meta, num_heads, num_kv_heads, head_dim, scale, window, softcap):
        b = q.shape[0]
        if self.cache.kv_group is not None and softcap is None and not meta.prefills:
            # the packed int4 rows read where they lie (codegen/native/decode_int4.c); None where the native
            # kernels are not built or q is not fp32. (A step with prefills sizes its read step by them.)
            step = meta.native_read_step(self.cache.block_size)
            out = None if step is None else cpu_native.decode_attention_int4(
                q, *self.cache.layer_rows(layer), step, window, num_heads, num_kv_heads, head_dim,
                self.cache.kv_group, scale)
            if out is not None:
                return out
        if meta.decode_span is not None:   # one sequence, consecutive blocks: its keys as they lie
            return self._decode_span(layer, q, meta, num_heads, num_kv_heads, head_dim, scale, window, softcap)
        if q.dtype == self.cache.dtype == torch.bfloat16 and softcap is None:
            # the keys where they lie, each read once per KV head group, in fp32 (SmolLM2 cpu-bf16, 64
            # sequences: see codegen/native/decode_kernels.c); None where the native kernels are not built
            step = meta.native_read_step(self.cache.block_size)
            out = None if step is None else cpu_native.decode_attention_bf16(
                q, *self.cache.layer_rows(layer), step, window, num_heads, num_kv_heads, head_dim, scale)
            if out is not None:
                return out
        keys, values = self.cache.read(layer, meta.decode_blocks, q.dtype, scratch=True)
        if q.dtype == torch.bfloat16 and softcap is None and num_kv_heads <= BLOCK_DIAGONAL_MAX_KV_HEADS:
            bias = meta.decode_block_diagonal_bias(window, num_heads, num_kv_heads, q.dtype)
            return _decode_block_diagonal(q, keys.reshape(b, -1, head_dim), values.reshape(b, -1, head_dim),
                                          bias, scale)
        mask = meta.decode_bias(window, q.dtype)
        # gathered: [decodes, max_blocks * block_size, kv_heads, head_dim] -> heads first
        keys = keys.reshape(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = values.reshape(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        o = scaled_dot_product(_group_queries(q, num_kv_heads, head_dim), keys, values, mask, scale, softcap)
        return o.reshape(b, num_heads * head_dim)

    def _decode_span(self, layer, q, meta, num_heads, num_kv_heads, head_dim, scale, window, softcap):
        first_block, num_blocks, ctx = meta.decode_span
        # a decode at position ctx - 1 sees keys 0 .. ctx - 1, with a sliding window only the last `window`
        first_key = 0 if window is None else max(0, ctx - window)
        if not self.cache.quantized:   # the keys as they lie, heads first, one view each
            first_slot = first_block * self.cache.block_size + first_key
            keys, values = self.cache.heads_span(layer, first_slot, ctx - first_key)
            o = scaled_dot_product(_group_queries(q, num_kv_heads, head_dim), keys, values, None, scale, softcap)
            return o.reshape(1, num_heads * head_dim)
        keys, values = self.cache.read_span(layer, first_block, num_blocks, q.dtype)
        keys = keys.reshape(-1, num_kv_heads, head_dim)[first_key:ctx].transpose(0, 1)[None]
        values = values.reshape(-1, num_kv_heads, head_dim)[first_key:ctx].transpose(0, 1)[None]
        o = scaled_dot_product(_group_queries(q, num_kv_heads, head_dim), keys, values, None, scale, softcap)
        return o.reshape(1, num_heads * head_dim)


# rows a batch-invariant attention call takes (its scratch grows with rows x context): a call each 8 rows cost
# SmolLM2's 64-sequence decode step 7 ms of its 48 ms of attention in calls alone
INVARIANT_ROWS = 256


def _rows_of_step(step: "cpu_native.DecodeStep", first: int, end: int) -> "cpu_native.DecodeStep":
    """Rows first..end of a native DecodeStep (pointer offsets into its int64 slots and tables, int32 lens)."""
    return step._replace(slots=step.slots + 8 * first, tables=step.tables + 8 * first * step.width,
                         lens=step.lens + 4 * first, rows=end - first)


def _fail_midway():
    raise AssertionError("the native attention applied to a step's first rows and not to later ones")


# _decode_block_diagonal does kv_heads times per-head attention's FLOPs and its bias grows with kv_heads^2:
# measured a win at SmolLM2's 3 KV heads; above this, unmeasured, decodes keep SDPA
BLOCK_DIAGONAL_MAX_KV_HEADS = 4


def _decode_block_diagonal(q, keys, values, bias, scale: float) -> torch.Tensor:
    """bf16 decode attention as two batched GEMMs over every KV head at once. q [b, heads * hd];
    keys/values [b, ctx * kv_heads, hd] as gathered (row t * kv_heads + h: position t, KV head h);
    bias [b, heads, ctx * kv_heads] from decode_block_diagonal_bias. Each query head scores every KV
    head's keys and the bias keeps its own head's: kv_heads times the FLOPs of per-head attention,
    but two large GEMMs instead of CPU SDPA's small kernel per (sequence, head), which runs bf16 at
    half this speed or less (SmolLM2, 64 sequences, 200-430 keys). Scores and probabilities round to
    bf16 between the GEMMs, as in HF's eager bf16 attention; the softmax computes in fp32."""
    b, hd = q.shape[0], keys.shape[-1]
    scores = torch.baddbmm(bias, q.reshape(b, -1, hd), keys.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), values).reshape(b, -1)


def _group_queries(q: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Decode queries [b, heads * head_dim] as [b, kv_heads, heads per kv head, head_dim]: a GQA group's
    single-token queries become the query rows of one attention over their shared KV head, so each
    key is read once per group rather than once per query head (2x faster on CPU SDPA for SmolLM2).
    Query head h reads KV head h // group, as HF's repeat_kv lays them out."""
    return q.reshape(q.shape[0], num_kv_heads, -1, head_dim)


def _attend_tree(q, keys, values, visible, num_heads, num_kv_heads, head_dim, scale, softcap):
    """q [t, heads * head_dim] over keys/values [ctx, kv_heads, head_dim] where `visible` [t, ctx]."""
    t, ctx = q.shape[0], keys.shape[0]
    qh = q.reshape(1, t, num_heads, head_dim).transpose(1, 2)
    kh, vh = (x.reshape(1, ctx, num_kv_heads, head_dim).transpose(1, 2) for x in (keys, values))
    o = scaled_dot_product(qh, kh, vh, visible, scale, softcap)
    return o[0].transpose(0, 1).reshape(t, num_heads * head_dim)
