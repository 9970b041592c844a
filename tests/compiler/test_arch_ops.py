"""The IR ops the new architectures brought, against float64 math written out here: qk_norm (a
per-head RMS norm), partial_rope (rotate-half on the first rotary_dim features of each head),
layer_norm, gelu, and soft-capped attention scores, on fresh random inputs."""

import math

import pytest
import torch

from llmc.compiler.ops import OPS, causal_attention


def run(op, *inputs, **attrs):
    return OPS[op].reference(*inputs, **attrs)[0]


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_qk_norm_normalises_each_head_by_its_own_rms():
    x, w = randn(5, 3 * 8, seed=1), randn(8, seed=2)
    heads = x.double().reshape(5, 3, 8)
    want = heads / (heads.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    torch.testing.assert_close(run("qk_norm", x, w, head_dim=8, eps=1e-6).double(), want.reshape(5, 24))


@pytest.mark.parametrize("rotary_dim", [2, 4, 6])
def test_partial_rope_turns_pairs_of_the_first_rotary_dims_and_keeps_the_rest(rotary_dim):
    head_dim, heads, positions = 8, 2, torch.tensor([0, 3, 17])
    x = randn(3, heads * head_dim, seed=rotary_dim)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)
    got = run("partial_rope", x, positions, inv_freq.float(), head_dim=head_dim, rotary_dim=rotary_dim)
    source = x.double().reshape(3, heads, head_dim)
    want, half = source.clone(), rotary_dim // 2
    for t, p in enumerate(positions.tolist()):
        for i in range(half):  # rotate-half: feature i pairs with feature i + rotary_dim / 2
            c, s = math.cos(p * inv_freq[i]), math.sin(p * inv_freq[i])
            a, b = source[t, :, i], source[t, :, i + half]
            want[t, :, i], want[t, :, i + half] = a * c - b * s, b * c + a * s
    torch.testing.assert_close(got.double(), want.reshape(3, -1), rtol=1e-5, atol=1e-5)


def test_layer_norm_and_gelu_follow_their_formulas():
    x, w, b = randn(4, 16, seed=3), randn(16, seed=4), randn(16, seed=5)
    xd = x.double()
    normed = (xd - xd.mean(-1, keepdim=True)) / (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(run("layer_norm", x, w, b, eps=1e-5).double(), normed * w.double() + b.double())
    torch.testing.assert_close(run("layer_norm", x, eps=1e-5).double(), normed)
    exact = 0.5 * xd * (1 + torch.erf(xd / math.sqrt(2)))
    tanh = 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    torch.testing.assert_close(run("gelu", x).double(), exact)
    torch.testing.assert_close(run("gelu", x, approximate="tanh").double(), tanh)


@pytest.mark.parametrize("window", [None, 3])
def test_soft_capped_causal_attention_caps_scores_before_the_mask(window):
    t, heads, kv_heads, hd, cap, scale = 7, 4, 2, 8, 5.0, 0.9
    q, k, v = randn(t, heads * hd, seed=6), randn(t, kv_heads * hd, seed=7), randn(t, kv_heads * hd, seed=8)
    got = causal_attention(q, k, v, num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, scale=scale,
                           window=window, softcap=cap)
    qh = q.double().reshape(t, heads, hd).transpose(0, 1)
    kh = k.double().reshape(t, kv_heads, hd).transpose(0, 1).repeat_interleave(2, 0)
    vh = v.double().reshape(t, kv_heads, hd).transpose(0, 1).repeat_interleave(2, 0)
    scores = cap * torch.tanh(qh @ kh.transpose(1, 2) * scale / cap)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    hidden = (j > i) | ((i - j >= window) if window else torch.zeros(t, t, dtype=torch.bool))
    want = torch.softmax(scores.masked_fill(hidden, -math.inf), -1) @ vh
    torch.testing.assert_close(got.double(), want.transpose(0, 1).reshape(t, -1), rtol=1e-5, atol=1e-5)
