"""Ring attention (runtime/parallel/ring_attention.py) on real gloo ranks equals full causal
attention (torch SDPA in float64) within 1e-5: world 2 and 3, odd lengths, grouped-query heads,
with the heads split over the ranks (tensor parallel) or replicated on each."""

import json
import subprocess
import sys

import torch
import torch.nn.functional as F

from llmc.runtime.parallel.group import free_port, join_group, leave_group
from llmc.runtime.parallel.ring_attention import ring_attention, sequence_parallel_attention, slices

HEAD_DIM = 8
# (tokens, query heads, KV heads, dtype): odd lengths, GQA groups of 2 and 3, one length below 2 slices a rank
CASES = [(13, 6, 3, torch.float64), (31, 12, 6, torch.float64), (7, 6, 6, torch.float32), (50, 12, 6, torch.float32)]


def reference(q, k, v, scale):
    """Full causal attention, float64: q [H, t, d], k/v [KV, t, d] -> [H, t, d]."""
    out = F.scaled_dot_product_attention(q.double()[None], k.double()[None], v.double()[None], is_causal=True,
                                         scale=scale, enable_gqa=True)
    return out[0]


def rank_errors(rank: int, world: int, port: int) -> list:
    """(check, tokens, largest error against the reference) of every case, on this rank."""
    torch.set_num_threads(1)
    join_group(rank, world, port, 30.0)
    errors = []
    for seed, (t, heads, kv_heads, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(n, t, HEAD_DIM, generator=gen, dtype=dtype) for n in (heads, kv_heads, kv_heads))
        scale = HEAD_DIM ** -0.5
        want = reference(q, k, v, scale)
        lo, hi = slices(t, world)[rank]
        got = ring_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], slices(t, world), scale, 30.0)
        errors.append(("ring", t, (got.double() - want[:, lo:hi]).abs().max().item()))
        layouts = [(False, (q, k, v), want)]  # attention replicated: every rank holds every head
        if kv_heads % world == 0:  # tensor-parallel layout: this rank's whole KV groups, every position
            h, g = heads // world, kv_heads // world
            mine = (q[rank * h:(rank + 1) * h], k[rank * g:(rank + 1) * g], v[rank * g:(rank + 1) * g])
            layouts.append((True, mine, want[rank * h:(rank + 1) * h]))
        for split, (qr, kr, vr), expect in layouts:
            flat = [x.transpose(0, 1).reshape(t, -1) for x in (qr, kr, vr)]
            got = sequence_parallel_attention(*flat, num_heads=qr.shape[0], num_kv_heads=kr.shape[0],
                                              head_dim=HEAD_DIM, scale=scale, heads_split=split, timeout=30.0)
            expect = expect.transpose(0, 1).reshape(t, -1)
            errors.append((f"heads split {split}", t, (got.double() - expect).abs().max().item()))
    leave_group()
    return errors


def run_worlds(worlds: tuple[int, ...]) -> dict[int, list]:
    """Every rank's errors by world size: fresh interpreters running this module's main, all worlds at once."""
    procs = {}
    for world in worlds:
        port = free_port()
        procs[world] = [subprocess.Popen([sys.executable, "-m", "tests.parallel.test_ring_attention", str(r),
                                          str(world), str(port)], stdout=subprocess.PIPE, text=True)
                        for r in range(world)]
    try:
        outs = {w: [p.communicate(timeout=120)[0] for p in ps] for w, ps in procs.items()}
    finally:
        for p in (p for ps in procs.values() for p in ps):
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for ps in procs.values() for p in ps)
    return {w: [(r, *e) for r, out in enumerate(outs[w]) for e in json.loads(out)] for w in worlds}


def test_ring_attention_equals_full_causal_attention_on_2_and_3_gloo_ranks():
    for world, results in run_worlds((2, 3)).items():
        assert len(results) == world * sum(2 + (kv % world == 0) for _, _, kv, _ in CASES)
        worst = max(results, key=lambda r: r[3])
        assert worst[3] < 1e-5, f"world {world}: rank {worst[0]} {worst[1]} at {worst[2]} tokens is off by {worst[3]}"


def test_slices_are_contiguous_and_cover_the_sequence():
    assert slices(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert slices(4, 2) == [(0, 2), (2, 4)]


if __name__ == "__main__":
    print(json.dumps(rank_errors(*map(int, sys.argv[1:4]))))
