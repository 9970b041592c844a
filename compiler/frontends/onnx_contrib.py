"""ONNX Runtime's contrib ops (domain com.microsoft), as ONNX Runtime GenAI's model builder writes
decoders with them, with torch reference semantics in the forms lowering raises:

- GroupQueryAttention: q, k, v (packed in one input or apart) split into heads, rotated as HF's
  rotate-half rope over an inv_freq param when `do_rotary`, k/v repeated per query group, then
  causal SDPA. Its past_key/past_value inputs are read as the empty past: llmc traces a forward
  without a cache and runs its own paged one, so the present outputs are never read.
  Folded into it as HF writes them: RotaryEmbedding nodes turning its q and k, per-head RMS norms
  of q and k (Qwen3), and a packed qkv projection, split into q, k and v linears (bias too).
- SkipSimplifiedLayerNormalization / SimplifiedLayerNormalization: the residual add, then HF's
  RMSNorm.
- MatMulNBits (4 bits): a linear over the weight dequantised as w = (q - zero_point) * scale,
  whose codes and scales are also kept (OnnxGraphModule.stored) as llmc params that dequantise to
  exactly those values: symmetric weights (no zero points: 8) as affine4's (q - 8) * s, others as
  int4's (q - z) * s. accuracy_level (ORT's leave to round activations to int8) is read as the
  op's float reference.

Attributes and inputs outside these semantics are refused, naming the node and op. A rotary cache
holds no inv_freq, so it is read off the table (`cache_inv_freq`) and checked against every row."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from llmc.compiler.frontends.gguf_dequant import AffineWeight
from llmc.compiler.quant import AFFINE4_CENTRE, dequantize_int4_codes, pack_int4
from llmc.errors import UnsupportedModelError

CONTRIB_DOMAIN = "com.microsoft"
PAST_INPUTS = (3, 4)   # GroupQueryAttention's past_key, past_value
ROPE_TOLERANCE = 1e-5  # |cache - cos/sin(p * inv_freq)|, plus the float32 rounding of the angle p * inv_freq


def refuse(step, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"ONNX node '{step.name}' (op {CONTRIB_DOMAIN}::{step.op}) {what}, "
                                 f"which llmc cannot read; build the model without it")


def check_attrs(step, allowed: dict) -> None:
    """Every attribute known, with a value llmc computes: allowed maps name -> accepted values (None: any)."""
    for name, value in step.attrs.items():
        if name not in allowed:
            raise refuse(step, f"has attribute {name}")
        if allowed[name] is not None and value not in allowed[name]:
            raise refuse(step, f"has {name}={value!r}")


def check_absent(step, indices: tuple[int, ...], names: tuple[str, ...]) -> None:
    for i, name in zip(indices, names):
        if i < len(step.inputs) and step.inputs[i]:
            raise refuse(step, f"has a {name} input")


def initializer(step, module, name: str, what: str) -> np.ndarray:
    if name in module.tensors:
        return module.tensors[name]
    if name in module.consts:
        c = module.consts[name]
        return np.array(c.values, dtype=torch.empty(0, dtype=c.dtype).numpy().dtype)
    raise refuse(step, f"computes its {what} in the graph (llmc reads it only as an initializer)")


# -- rotary ---------------------------------------------------------------------------------
def cache_inv_freq(step, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, float]:
    """(inv_freq [rotary_dim / 2], scaling) with cos[p, i] = scaling * cos(p * inv_freq[i]) (sin
    likewise), to the table's precision: the angle at position 1, refined at doubling positions up
    to the last (each doubling's prediction is close enough to count the turns), then every row checked."""
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[0] < 2:
        raise refuse(step, f"has rotary caches of shapes {cos.shape} and {sin.shape}, not [positions, rotary_dim/2]")
    tolerance = max(ROPE_TOLERANCE, 2 * float(np.finfo(cos.dtype).eps))  # a float16 table rounds its values
    cos, sin = cos.astype(np.float64), sin.astype(np.float64)
    magnitude = np.hypot(cos, sin)
    scaling = float(magnitude.mean())
    inv_freq, p = np.arctan2(sin[1], cos[1]), 1
    while p < len(cos) - 1:
        p = min(2 * p, len(cos) - 1)
        angle = np.arctan2(sin[p], cos[p])
        inv_freq = (angle + 2 * np.pi * np.round((inv_freq * p - angle) / (2 * np.pi))) / p
    angles = np.arange(len(cos))[:, None] * inv_freq
    bound = tolerance + 2.5e-7 * angles  # the table's own float32 angles round by up to ~6e-8 of the angle
    off = [np.abs(magnitude - scaling) > tolerance, np.abs(cos - scaling * np.cos(angles)) > bound,
           np.abs(sin - scaling * np.sin(angles)) > bound]
    if any(o.any() for o in off):
        raise refuse(step, "has rotary caches that are no cos/sin(position * inv_freq) table")
    return inv_freq.astype(np.float32), 1.0 if abs(scaling - 1.0) < tolerance else scaling


def register_rotary(step, module, cos_name: str, sin_name: str) -> str:
    """The name of the inv_freq tensor (added to module.tensors) of the cos/sin cache pair."""
    name = f"{cos_name}.inv_freq"
    if name not in module.tensors:
        cos = initializer(step, module, cos_name, "cos_cache")
        sin = initializer(step, module, sin_name, "sin_cache")
        module.tensors[name], module.rope_scaling[name] = cache_inv_freq(step, cos, sin)
    return name


def positions_of(ctx, tokens) -> torch.Tensor:
    """The tokens' positions ([T] or [B, T]): the runtime's, the graph's position_ids input, else
    those of a fresh sequence."""
    if ctx.positions is not None:
        return ctx.positions
    return ctx.env["position_ids"] if "position_ids" in ctx.env else torch.arange(tokens)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """HF's rotate-half rope of heads-first x [B, H, T, D] over its first 2 * len(inv_freq) features,
    at positions [T] (or [B, T])."""
    freqs = positions.float().unsqueeze(-1) * inv_freq           # [(B,) T, r/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if emb.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    r = emb.shape[-1]
    turned = x if r == x.shape[-1] else x[..., :r]
    half = r // 2
    x1, x2 = turned[..., :half], turned[..., half:]
    out = turned * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


# -- attention ------------------------------------------------------------------------------
GQA_ATTRS = {"num_heads": None, "kv_num_heads": None, "scale": None, "do_rotary": (0, 1),
             "rotary_interleaved": (0,), "local_window_size": (-1,), "softcap": (0.0,), "smooth_softmax": (0,),
             "qk_output": (0,)}


def prepare_gqa(step, module):
    """GroupQueryAttention -> (q, k, v, inv_freq); past, sequence lengths and caches dropped."""
    check_attrs(step, GQA_ATTRS)
    check_absent(step, (9, 10, 11), ("position_ids", "attention_bias", "head_sink"))
    for i in PAST_INPUTS:
        past = step.inputs[i] if i < len(step.inputs) else ""
        if past and past not in module.graph_inputs:
            raise refuse(step, f"reads its past KV '{past}' from inside the graph (llmc reads the past "
                               f"only as the graph's own input, which it treats as empty)")
    inputs = (step.inputs + [""] * 9)[:9]
    rotary = step.attrs.get("do_rotary", 0)
    if rotary and not (inputs[7] and inputs[8]):
        raise refuse(step, "has do_rotary=1 without cos_cache and sin_cache")
    step.inputs = inputs[:3] + [register_rotary(step, module, inputs[7], inputs[8]) if rotary else ""]
    return step


def group_query_attention(ctx, step, query, key, value, inv_freq, q_gain=None, k_gain=None):
    at = step.attrs
    heads, kv_heads = at["num_heads"], at["kv_num_heads"]
    if key is None:  # packed: each token's features are q, then k, then v
        d = query.shape[-1] // (heads + 2 * kv_heads)
        query, key, value = (query[..., a * d:b * d] for a, b in ((0, heads), (heads, heads + kv_heads),
                                                                  (heads + kv_heads, heads + 2 * kv_heads)))
    d = query.shape[-1] // heads
    eps = at.get("head_norm_eps", (0.0, 0.0))
    q, k, v = split_heads(query, d, q_gain, eps[0]), split_heads(key, d, k_gain, eps[1]), split_heads(value, d)
    if inv_freq is not None:
        positions = positions_of(ctx, q.shape[2])
        scaling = ctx.module.rope_scaling[step.inputs[3]]
        q, k = rotate(q, positions, inv_freq, scaling), rotate(k, positions, inv_freq, scaling)
    window = at.get("window")
    mask = None if window is None else sliding_window_mask(q.shape[2], window)
    out = F.scaled_dot_product_attention(q, repeat_kv(k, heads), repeat_kv(v, heads), attn_mask=mask,
                                         is_causal=mask is None, scale=at.get("scale") or None)
    return out.transpose(1, 2).reshape(*query.shape[:2], heads * d), k, v


def sliding_window_mask(tokens, window: int) -> torch.Tensor:
    """[T, T] True where query i sees key j: j <= i and i - j < window."""
    i = torch.arange(tokens)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def set_windows(steps: list, windows: list) -> None:
    """Each GroupQueryAttention's sliding window (attr "window"; None: plain causal), in layer order.
    The model builder leaves Mistral's window out of the graph (local_window_size -1) and records it
    in genai_config.json for ORT GenAI to apply, so the config gives it."""
    attentions = [s for s in steps if s.op == "GroupQueryAttention"]
    if len(attentions) == len(windows):
        for step, window in zip(attentions, windows):
            step.attrs["window"] = window


def split_heads(x: torch.Tensor, head_dim: int, gain: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """[B, T, H * D] -> [B, H, T, D], each head RMS-normed by `gain` [D] if given."""
    heads = x.view(*x.shape[:2], -1, head_dim)
    return (heads if gain is None else rms_norm(heads, gain, eps)).transpose(1, 2)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv_heads, T, D] -> [B, heads, T, D], each KV head serving heads / kv_heads query heads."""
    b, kv_heads, t, d = x.shape
    if kv_heads == heads:
        return x
    return x.unsqueeze(2).expand(b, kv_heads, heads // kv_heads, t, d).reshape(b, heads, t, d)


def fold_head_norms(steps: list, module) -> list:
    """reshape(rms_norm(reshape(x, [.., heads, head_dim]), w [head_dim]), [.., heads * head_dim]) read
    by a GroupQueryAttention's q or k alone (Qwen3's q_norm/k_norm) -> that attention's own head norm
    (inputs 4 and 5: the gains; attr head_norm_eps), as HF applies it between head split and rotary."""
    readers = reader_counts(steps)
    producers = {o: s for s in steps for o in s.outputs}
    folded = set()
    for s in steps:
        if s.op != "GroupQueryAttention":
            continue
        s.inputs += ["", ""]
        eps = [0.0, 0.0]
        for i in (0, 1):
            chain = head_norm_chain(s.inputs[i], producers, readers, module)
            if chain is not None:
                (r1, norm, r2), s.inputs[i] = chain, chain[0].inputs[0]
                s.inputs[4 + i], eps[i] = norm.inputs[1], norm.attrs.get("epsilon", 1e-5)
                folded.update((id(r1), id(norm), id(r2)))
        s.attrs["head_norm_eps"] = tuple(eps)
    return [s for s in steps if id(s) not in folded]


def head_norm_chain(value: str, producers: dict, readers: dict, module):
    """(reshape to heads, SimplifiedLayerNormalization over head_dim, reshape back) giving `value`, or None."""
    r2 = producers.get(value)
    norm = producers.get(r2.inputs[0]) if r2 is not None and r2.op == "Reshape" else None
    r1 = producers.get(norm.inputs[0]) if norm is not None and norm.op == "SimplifiedLayerNormalization" else None
    if r1 is None or r1.op != "Reshape" or any(readers[s.outputs[0]] != 1 for s in (r1, norm, r2)):
        return None
    gain = module.tensors.get(norm.inputs[1])
    target = module.consts.get(r1.inputs[1])
    if gain is None or gain.ndim != 1 or target is None or target.values[-1] != len(gain):
        return None
    return r1, norm, r2


def reader_counts(steps: list) -> dict[str, int]:
    readers: dict[str, int] = {}
    for s in steps:
        for i in s.inputs:
            readers[i] = readers.get(i, 0) + 1
    return readers


def split_packed_qkv(steps: list, module) -> list:
    """A GroupQueryAttention reading q, k and v packed from one Linear (plus a bias Add) nothing else
    reads -> three Linears over the row blocks of its weight (and bias, and stored codes), as HF's
    separate projections: lowering then finds each projection whole, so a stored int4 weight stays stored."""
    readers = reader_counts(steps)
    producers = {o: s for s in steps for o in s.outputs}
    splits, dropped = {}, set()
    for s in steps:
        lin = producers.get(s.inputs[0]) if s.op == "GroupQueryAttention" and not s.inputs[1] else None
        add = None
        if lin is not None and lin.op == "Add":
            add, lin = lin, with_bias(lin, producers, readers, module)
        if lin is not None and lin.op == "Linear" and readers[lin.outputs[0]] == 1 and all(
                i in module.tensors for i in lin.inputs[1:]):
            splits[id(lin)] = projections(lin, s, module, add.inputs[1] if add else None)
            s.inputs = [p.outputs[0] for p in splits[id(lin)]] + s.inputs[3:]
            dropped.add(id(add))  # its bias went into the Linears
    return [p for s in steps if id(s) not in dropped for p in splits.get(id(s), [s])]


def with_bias(add, producers: dict, readers: dict, module):
    """The bias-free Linear `add` adds a bias to (its inputs put in that order), else None."""
    for x, bias in (add.inputs, add.inputs[::-1]):
        lin = producers.get(x)
        if lin is not None and lin.op == "Linear" and len(lin.inputs) == 1 and bias in module.tensors \
                and module.tensors[bias].ndim == 1:
            add.inputs = [x, bias]
            return lin
    return None


def projections(lin, attention, module, bias: str | None) -> list:
    """The q, k and v Linears of the packed projection `lin` (with its bias, or `bias`), feeding `attention`."""
    heads, kv_heads = attention.attrs["num_heads"], attention.attrs["kv_num_heads"]
    weight = lin.attrs["weight"]
    d = module.tensors[weight].shape[1] // (heads + 2 * kv_heads)   # stored [K, N], as MatMul's
    bounds = {"q": (0, heads * d), "k": (heads * d, (heads + kv_heads) * d),
              "v": ((heads + kv_heads) * d, (heads + 2 * kv_heads) * d)}
    bias = lin.inputs[1] if len(lin.inputs) > 1 else bias
    out = []
    for part, (a, b) in bounds.items():
        name = f"{weight}.{part}"
        module.tensors[name] = module.tensors[weight][:, a:b]
        if weight in module.stored:
            module.stored[name] = module.stored[weight].rows(torch.arange(a, b))
        inputs = lin.inputs[:1]
        if bias is not None:
            module.tensors[f"{bias}.{part}"] = module.tensors[bias][a:b]
            inputs = inputs + [f"{bias}.{part}"]
        out.append(type(lin)("Linear", f"{lin.name}/{part}", inputs, [f"{lin.outputs[0]}/{part}"], {"weight": name}))
    return out


ROTARY_ATTRS = {"interleaved": (0,), "is_packed_batching": (0,), "num_heads": None, "rotary_embedding_dim": None,
                "scale": (1.0,)}


def fold_rotary(steps: list, module) -> list:
    """A RotaryEmbedding over the graph's position_ids whose only reader is a GroupQueryAttention's q
    or k (both rotated alike) -> that attention's own rotary; any other RotaryEmbedding is refused."""
    producers = {o: s for s in steps for o in s.outputs}
    readers: dict[str, list] = {}
    for s in steps:
        for i in s.inputs:
            readers.setdefault(i, []).append(s)
    folded = set()
    for s in steps:
        if s.op != "GroupQueryAttention":
            continue
        ropes = [producers.get(s.inputs[i]) for i in (0, 1)]
        if not any(r is not None and r.op == "RotaryEmbedding" for r in ropes):
            continue
        if s.inputs[3] or any(r is None or r.op != "RotaryEmbedding" or len(readers[r.outputs[0]]) != 1
                              or r.inputs[2:4] != ropes[0].inputs[2:4] for r in ropes):
            raise refuse(s, "reads q or k through a RotaryEmbedding llmc cannot fold into it (only q and k "
                            "rotated alike, read by this attention alone, without do_rotary)")
        s.inputs = [ropes[0].inputs[0], ropes[1].inputs[0], s.inputs[2],
                    register_rotary(ropes[0], module, *ropes[0].inputs[2:4])]
        folded.update(id(r) for r in ropes)
    left = [s for s in steps if s.op == "RotaryEmbedding" and id(s) not in folded]
    if left:
        raise refuse(left[0], "is not read by a GroupQueryAttention's q or k alone")
    return [s for s in steps if id(s) not in folded]


def prepare_rotary(step, module):
    check_attrs(step, ROTARY_ATTRS)
    if len(step.inputs) < 4 or step.inputs[1] != "position_ids":
        raise refuse(step, "rotates by positions other than the graph's position_ids input")
    if step.attrs.get("rotary_embedding_dim", 0) not in (0, 2 * initializer(step, module, step.inputs[2],
                                                                            "cos_cache").shape[-1]):
        raise refuse(step, "has a rotary_embedding_dim its caches do not have")
    return step


# -- norms --------------------------------------------------------------------------------
def prepare_norm(step, module):
    allowed = {"epsilon": None, "axis": (-1,), "stash_type": (1,)}
    check_attrs(step, allowed)
    extra = [o for o in step.outputs[1:3] if o]
    if extra:
        raise refuse(step, f"outputs its mean or inverse deviation '{extra[0]}'")
    return step


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, in the form lowering raises to rms_norm."""
    return gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def simplified_layer_norm(ctx, step, x, gain):
    return rms_norm(x, gain, step.attrs.get("epsilon", 1e-5))


def skip_simplified_layer_norm(ctx, step, x, skip, gain, bias=None):
    total = with_skip(x, skip, bias)
    return rms_norm(total, gain, step.attrs.get("epsilon", 1e-5)), None, None, total


def with_skip(x, skip, bias):
    total = x + skip
    return total if bias is None else total + bias


# -- MatMulNBits ------------------------------------------------------------------------------
NBITS_ATTRS = {"K": None, "N": None, "bits": (4,), "block_size": None, "accuracy_level": None}


class Int4Weight(NamedTuple):
    """A MatMulNBits weight with zero points as llmc's int4 params: w = (q - z) * s in groups along K."""
    scheme: str                   # "int4"
    format: str                   # "MatMulNBits"
    group_size: int
    qweight: torch.Tensor         # uint8 [N, K/2]: two codes a byte, the low nibble holds the even k
    scales: torch.Tensor          # float32 [N, K/g]
    zeros: torch.Tensor           # float32 [N, K/g]: the integer zero points

    def rows(self, index: torch.Tensor) -> Int4Weight:
        pick = (lambda t: t.index_select(0, index).contiguous())
        return self._replace(qweight=pick(self.qweight), scales=pick(self.scales), zeros=pick(self.zeros))


def prepare_matmul_nbits(step, module):
    """MatMulNBits -> a Linear over its dequantised weight (module.tensors, stored [K, N] as MatMul's
    are), whose codes, scales and zero points are also kept (module.stored) when K is whole blocks."""
    check_attrs(step, NBITS_ATTRS)
    check_absent(step, (4,), ("g_idx",))
    inputs = (step.inputs + [""] * 6)[:6]
    k, n, block = step.attrs["K"], step.attrs["N"], step.attrs["block_size"]
    if block < 16 or block & (block - 1):
        raise refuse(step, f"has block_size={block}, not a power of two from 16")
    blocks = -(-k // block)
    packed = initializer(step, module, inputs[1], "weight")
    scales = initializer(step, module, inputs[2], "scales")
    if packed.dtype != np.uint8 or packed.size != n * blocks * block // 2 or scales.size != n * blocks:
        raise refuse(step, f"has a weight {packed.dtype}{list(packed.shape)} and scales {list(scales.shape)} "
                           f"that do not hold N={n} x {blocks} blocks of {block}")
    codes = unpack_nibbles(torch.from_numpy(packed.reshape(n, -1).copy()))               # [N, blocks * block]
    scales_t = torch.from_numpy(scales.reshape(n, blocks).astype(np.float32))
    symmetric = not inputs[3]
    zeros = torch.full_like(scales_t, AFFINE4_CENTRE) if symmetric else zero_points(step, module, inputs[3], n, blocks)
    weight = dequantize_int4_codes(codes, scales_t, zeros)[:, :k]  # (q - z) * s, as affine4's (q - 8) * s
    name = f"{inputs[1]}.dequantized"
    module.tensors[name] = weight.T.numpy()
    if k % block == 0:
        module.stored[name] = AffineWeight("affine4", "MatMulNBits", block, pack_int4(codes), scales_t, None) \
            if symmetric else Int4Weight("int4", "MatMulNBits", block, pack_int4(codes), scales_t, zeros.float())
    step.op, step.inputs, step.attrs = "Linear", [inputs[0]] + ([inputs[5]] if inputs[5] else []), {"weight": name}
    return step


def zero_points(step, module, name: str, n: int, blocks: int) -> torch.Tensor:
    """The zero points z [N, blocks] of w = (q - z) * s, from their 4-bit packing (two blocks a byte)."""
    raw = initializer(step, module, name, "zero_points")
    if raw.dtype != np.uint8 or raw.size != n * -(-blocks // 2):
        raise refuse(step, f"has zero points {raw.dtype}{list(raw.shape)}, not 4-bit packed uint8 for {n} x {blocks}")
    return unpack_nibbles(torch.from_numpy(raw.reshape(n, -1).copy()))[:, :blocks]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, M] -> uint8 [N, 2M]: each byte's low nibble first."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


PREPARE = {"GroupQueryAttention": prepare_gqa, "RotaryEmbedding": prepare_rotary,
           "SimplifiedLayerNormalization": prepare_norm, "SkipSimplifiedLayerNormalization": prepare_norm,
           "MatMulNBits": prepare_matmul_nbits}
CONTRIB_OPS = {"GroupQueryAttention": group_query_attention,
               "SkipSimplifiedLayerNormalization": skip_simplified_layer_norm,
               "SimplifiedLayerNormalization": simplified_layer_norm}
