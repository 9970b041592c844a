"""The CPU kernels' short rotary path: q and k split from one fused projection are rotated in one
pass, and the result equals rotary applied to each in float64 (compiler.ops.apply_rope)."""

import pytest
import torch

from llmc.codegen.torch_cpu.cpu_kernels import TILED_ROPE_ROWS, RopeCache, resolve_kernel
from llmc.compiler.ops import apply_rope, rope_cos_sin
from llmc.runtime.attention import NoCacheAttention, attend


def float64_rope(x, positions, inv_freq, head_dim, scaling):
    cos, sin = rope_cos_sin(positions, inv_freq.double(), scaling, torch.float64)
    return apply_rope(x.double(), cos, sin, head_dim)


@pytest.mark.parametrize("fused", [True, False])
# up to TILED_ROPE_ROWS rows the tables are tiled and the halves swapped by a column gather; beyond, per head
@pytest.mark.parametrize("heads,kv_heads,t", [(4, 2, 5), (6, 1, 1), (3, 3, 9), (4, 2, TILED_ROPE_ROWS + 3)])
def test_flash_attention_rotates_fused_and_separate_q_k_as_float64(fused, heads, kv_heads, t):
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + t)
    head_dim, scaling = 8, float(torch.empty(()).uniform_(0.5, 1.5, generator=gen))
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    if fused:   # views side by side in one buffer, as a fused QKV projection's split gives them
        q, k, v = torch.randn(t, sum(widths), generator=gen).split(widths, dim=-1)
    else:
        q, k, v = (torch.randn(t, w, generator=gen) for w in widths)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(t) + int(torch.randint(0, 500, (1,), generator=gen))
    attrs = {"layer": 0, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
             "scale": head_dim ** -0.5, "causal": True, "rope": {"scaling": scaling}}
    qr, kr = (float64_rope(x, positions, inv_freq, head_dim, scaling) for x in (q, k))
    want = attend(qr, kr, v.double(), start=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  scale=head_dim ** -0.5, causal=True)
    kernel = resolve_kernel("cpu.flash_attention")
    for rope_cache in (None, RopeCache()):
        got = kernel(q, k, v, positions, inv_freq, backend=NoCacheAttention(), rope_cache=rope_cache, **attrs)[0]
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [6, TILED_ROPE_ROWS + 1])
@pytest.mark.parametrize("lead", [(), (1,)])
def test_rope_kernel_matches_float64_on_a_strided_view(rows, lead):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(*lead, rows, 40, generator=gen)[..., 8:]   # rows with a stride wider than their width
    positions = torch.randint(0, 1000, (rows,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    for rope_cache in (None, RopeCache()):
        got = resolve_kernel("cpu.rope")(x, positions, inv_freq, head_dim=8, scaling=0.7, rope_cache=rope_cache)[0]
        want = float64_rope(x.reshape(rows, 32), positions, inv_freq, 8, 0.7).reshape(got.shape)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
