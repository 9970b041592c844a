"""Ring attention (runtime/parallel/ring_attention.py) on real gloo ranks equals full causal
attention (torch SDPA in float64) within 1e-5: world 2 and 3, odd lengths, grouped-query heads,
with the heads split over the ranks (tensor parallel) or replicated on each. End to end, a tiny
Llama (6 query heads, 3 KV heads) compiled with --tp 3 and served on three gloo ranks, its prompt
above the ring threshold (llmc.load's ring_attention_threshold), gives HF's next-token
log-probabilities (1e-4) and greedy tokens. A threshold that is no whole number of tokens is refused
in one line (llmc.load, `llmc run/bench --ring-attention-threshold`)."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import llmc
from llmc import SamplingParams
from llmc.errors import RuntimeLlmcError
from llmc.runtime.parallel import ring_attention as ring
from llmc.runtime.parallel.group import free_port, join_group, leave_group
from llmc.runtime.parallel.ring_attention import ring_attention, sequence_parallel_attention, slices
from tests.llmc_cli import error_line, llmc_in_process

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


def test_the_threshold_is_a_whole_number_of_tokens_given_before_the_environment(monkeypatch, compiled, capsys):
    monkeypatch.setenv(ring.THRESHOLD_ENV, "lots")
    with pytest.raises(RuntimeLlmcError, match=r"LLMC_RING_ATTENTION_THRESHOLD='lots' is not a whole number"):
        ring.ring_threshold()
    assert ring.ring_threshold(0) == 0 and ring.ring_threshold(77) == 77
    monkeypatch.delenv(ring.THRESHOLD_ENV)
    assert ring.ring_threshold() == ring.DEFAULT_THRESHOLD
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(RuntimeLlmcError, match=rf"^engine option ring_attention_threshold={bad!r} must be an "
                                                   rf"integer >= 0 or None$"):
            llmc.load(compiled, ring_attention_threshold=bad)
    for command, *more in (("run", "--prompt", "hi"), ("bench",)):
        code, _, err = llmc_in_process(capsys, command, compiled, "--ring-attention-threshold", "-3", *more)
        assert code == 2
        assert error_line(err) == (f"Invalid value for '--ring-attention-threshold': -3 is not in the range x>=0; "
                                   f"see `llmc {command} --help`")


def tiny_tp3(folder):
    """(a tiny Llama whose heads, KV heads and MLP split over 3 ranks, compiled with --tp 3; HF's module)."""
    from tiny_hf_models import SPECIAL, VOCAB, save_checkpoint
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512, **SPECIAL)
    module = save_checkpoint(config, folder / "hf", seed=11)
    return llmc.compile(str(folder / "hf"), target="cpu", output=folder / "tiny-tp3.llmc", tp=3), module


def test_a_prompt_above_the_threshold_runs_ring_attention_and_gives_hfs_logits_and_tokens(tmp_path, monkeypatch):
    from tiny_hf_models import VOCAB, hf_greedy, hf_logits

    artifact, module = tiny_tp3(tmp_path)
    rings = []
    def counted(q, *args, **kwargs):  # rank 0's calls; the followers ring with it or the step fails
        rings.append(q.shape[0])
        return sequence_parallel_attention(q, *args, **kwargs)
    monkeypatch.setattr(ring, "sequence_parallel_attention", counted)
    monkeypatch.setenv(ring.THRESHOLD_ENV, "0")  # the keyword wins
    ids = torch.randint(3, VOCAB, (101,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)
    # batch-invariant (the default), no ring: a ring splits a prefill's keys by rank, which would round its
    # rows otherwise than a short prefill of the same prompt
    model = llmc.load(artifact, threads=1, ring_attention_threshold=32)
    try:
        invariant = model.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    finally:
        model.close()
    assert rings == []
    model = llmc.load(artifact, threads=1, ring_attention_threshold=32, batch_invariant=False)
    try:
        out = model.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    finally:
        model.close()
    assert rings == [101, 101]  # the prefill, in both layers; the decodes take the normal path
    assert invariant.token_ids == out.token_ids
    want = torch.log_softmax(hf_logits(module, ids)[-1].double(), dim=-1)
    for token, lp in out.logprobs[0].items():
        assert abs(lp.logprob - want[token].item()) < 1e-4
    assert out.token_ids == hf_greedy(module, ids, 16)


if __name__ == "__main__":
    print(json.dumps(rank_errors(*map(int, sys.argv[1:4]))))
