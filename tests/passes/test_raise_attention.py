"""Unfused attention (matmul -> scale -> mask -> softmax -> matmul, with or without repeat_kv) is
raised to the `attention` op: HF Llama with eager attention and hand-written modules lower with
no aten fallback left and keep their logits; a sliding-window mask is raised with its window; a
mask that is neither fails the compile naming the node; lowering's `lower` pass is what raises them."""

import math
from types import SimpleNamespace

import pytest
import torch
from contiguous_kv_cache import ContiguousKVCache
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from llmc.codegen.plan import build_plan
from llmc.compiler.interpreter import interpret
from llmc.compiler.pipeline import full_pipeline, trace_and_lower
from llmc.compiler.targets import get_target
from llmc.compiler.trace import export_lm, translate
from llmc.errors import IRError
from llmc.passes.base import PassContext, PassManager, Stage
from llmc.passes.registry import get_pass
from llmc.runtime.executor import PlanExecutor

VOCAB = 96


def lower(module):
    return trace_and_lower(module, 64, lambda *a: None)


def graph_logits(graph, ids):
    t = ids.shape[0]
    known = {"input_ids": ids, "positions": torch.arange(t), "logits_indices": torch.arange(t)}
    return interpret(graph, {v.name: known[v.name] for v in graph.inputs})[graph.outputs[0]]


def model_logits(module, ids):
    with torch.no_grad():
        return module(input_ids=ids[None], position_ids=torch.arange(ids.shape[0])[None]).logits[0]


def assert_same_logits(graph, module, lengths=(2, 7, 19)):
    gen = torch.Generator().manual_seed(sum(lengths))
    for t in lengths:
        ids = torch.randint(0, VOCAB, (t,), generator=gen)
        ref = model_logits(module, ids)
        assert (graph_logits(graph, ids) - ref).abs().max() <= 1e-5 * ref.abs().max(), f"length {t}"


def aten_targets(graph) -> set[str]:
    return {n.attrs["target"] for n in graph.nodes if n.op == "aten"}


# -- HF Llama, eager attention ------------------------------------------------------------------
def eager_llama(kv_heads: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(kv_heads)
        model = LlamaForCausalLM(cfg).eval()
    assert model.config._attn_implementation == "eager"
    return model


@pytest.fixture(scope="module")
def eager_gqa():
    """Eager Llama, 4 query heads over 2 KV heads, and its lowered graph (read-only)."""
    model = eager_llama(2)
    return model, lower(model)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_eager_llama_lowers_to_attention_with_no_fallback_and_same_logits(kv_heads, eager_gqa):
    model, graph = eager_gqa if kv_heads == 2 else (eager_llama(kv_heads), None)
    graph = graph or lower(model)
    counts = graph.op_counts()
    assert "aten" not in counts, aten_targets(graph)
    assert counts["attention"] == 2 and counts["rope"] == 4
    for layer, node in enumerate(n for n in graph.nodes if n.op == "attention"):
        assert node.attrs == {"num_heads": 4, "num_kv_heads": kv_heads, "head_dim": 8, "scale": 8 ** -0.5,
                              "causal": True, "layer": layer}
    assert_same_logits(graph, model)


def test_eager_llama_decodes_through_a_kv_cache_like_hf(eager_gqa):
    """Prefill, then one token at a time through the plan: raised attention keeps a real cache."""
    model, graph = eager_gqa
    plan = build_plan(graph, "cpu", max_tokens=32)
    executor, cache = PlanExecutor(plan, graph.weights), ContiguousKVCache(2, 32, 2, 8)
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(3))
    rows = []
    for lo, hi in [(0, 9)] + [(p, p + 1) for p in range(9, 14)]:
        logits = executor.run_values({"input_ids": ids[lo:hi], "positions": torch.arange(lo, hi),
                                      "logits_indices": torch.tensor([hi - lo - 1])}, cache)["logits"]
        rows.append(logits)
        cache.advance(hi - lo)
    ref = model_logits(model, ids)[[8, 9, 10, 11, 12, 13]]
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


# -- a hand-written decoder with plain matmul/softmax attention ----------------------------------
class PlainAttention(nn.Module):
    """Multi-head attention spelled out: q k^T, scale, causal mask (`mask` says how), softmax, @ v;
    with fewer KV heads, K/V are repeated as HF's repeat_kv does (expand + reshape)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, mask: str):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.mask = heads, kv_heads, hidden // heads, mask
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.register_buffer("tril", torch.ones(128, 128, dtype=torch.bool).tril(), persistent=False)

    def split(self, x, heads):
        b, t, _ = x.shape
        return x.view(b, t, heads, self.hd).transpose(1, 2)

    def repeat(self, x):
        b, kvh, t, hd = x.shape
        rep = self.heads // kvh
        return x if rep == 1 else x[:, :, None].expand(b, kvh, rep, t, hd).reshape(b, kvh * rep, t, hd)

    def forward(self, x):
        b, t, c = x.shape
        q = self.split(self.q(x), self.heads)
        k, v = (self.repeat(self.split(p(x), self.kv_heads)) for p in (self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        scores = self.apply_mask(scores, t)
        out = torch.softmax(scores, dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, c))

    def apply_mask(self, scores, t):
        causal = torch.ones(t, t, dtype=torch.bool, device=scores.device).tril()
        if self.mask == "masked_fill":
            return scores.masked_fill(~causal, float("-inf"))
        if self.mask == "buffer":  # nanoGPT's registered lower-triangular buffer, sliced
            return scores.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        if self.mask == "additive":
            return scores + torch.full((t, t), float("-inf"), device=scores.device).triu(1)
        if self.mask == "where":
            return torch.where(causal, scores, torch.finfo(scores.dtype).min)
        if self.mask == "window":  # sliding window of 3: not the causal mask
            return scores.masked_fill(~(causal & ~causal.tril(-3)), float("-inf"))
        assert self.mask == "soft", self.mask  # a penalty, not a mask: the future stays visible
        return scores - 1.0 * (~causal)


class PlainDecoder(nn.Module):
    """Token + learned position embeddings, pre-norm blocks (RMS norm, plain attention, SiLU MLP),
    LM head. Called as an HF causal LM is (`input_ids`, `position_ids` -> `.logits`)."""

    def __init__(self, heads=4, kv_heads=4, mask="masked_fill", hidden=32, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, hidden)
        self.embed_positions = nn.Embedding(64, hidden)
        self.attn = nn.ModuleList(PlainAttention(hidden, heads, kv_heads, mask) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 64, bias=False), nn.SiLU(),
                                               nn.Linear(64, hidden, bias=False)) for _ in range(layers))
        self.norms = nn.ParameterList(nn.Parameter(1 + 0.1 * torch.randn(hidden)) for _ in range(2 * layers + 1))
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def norm(self, x, i):
        return self.norms[i] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, input_ids, position_ids, **unused):
        x = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.norm(x, 2 * i))
            x = x + mlp(self.norm(x, 2 * i + 1))
        return SimpleNamespace(logits=self.lm_head(self.norm(x, -1)))


def plain_decoder(**kw) -> PlainDecoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return PlainDecoder(**kw).eval()


@pytest.mark.parametrize("mask,kv_heads", [("masked_fill", 4), ("buffer", 2), ("additive", 2), ("where", 4)])
def test_plain_matmul_softmax_attention_is_raised_with_same_logits(mask, kv_heads):
    model = plain_decoder(kv_heads=kv_heads, mask=mask)
    graph = lower(model)
    counts = graph.op_counts()
    assert "aten" not in counts, aten_targets(graph)
    assert counts["attention"] == 2 and "rope" not in counts
    node = next(n for n in graph.nodes if n.op == "attention")
    assert (node.attrs["num_kv_heads"], node.attrs["scale"]) == (kv_heads, pytest.approx(8 ** -0.5))
    assert_same_logits(graph, model)


def test_a_sliding_window_mask_is_raised_with_its_window_and_same_logits():
    model = plain_decoder(mask="window")
    graph = lower(model)
    assert "aten" not in graph.op_counts(), aten_targets(graph)
    assert [n.attrs["window"] for n in graph.nodes if n.op == "attention"] == [3, 3]
    assert_same_logits(graph, model, lengths=(3, 11))


def test_attention_under_a_soft_penalty_is_refused_naming_the_node():
    with pytest.raises(IRError, match=r"^node softmax\S* \(aten\.softmax\.int\) pairs tokens with tokens"):
        lower(plain_decoder(mask="soft"))


# -- the lowering pass ----------------------------------------------------------------------------
def run_pass(graph):
    return PassManager([get_pass("lower"), get_pass("dce")], PassContext(quiet=True), [Stage.LOWER] * 2).run(graph)


def test_the_lower_pass_raises_attention_in_a_traced_graph():
    model = plain_decoder(kv_heads=2, mask="additive")
    graph = translate(export_lm(model, max_tokens=64))
    lowered, dce = run_pass(graph)
    assert lowered.details["attention"] == 2 and dce.matches > 0 and lowered.stage == dce.stage == "lower"
    assert [n.attrs["layer"] for n in graph.nodes if n.op == "attention"] == [0, 1]
    assert not aten_targets(graph) & {"aten.matmul.default", "aten.softmax.int", "aten.expand.default"}
    assert_same_logits(graph, model, lengths=(4, 13))


def test_lowering_leaves_nothing_to_raise_so_no_target_pipeline_raises_again(eager_gqa):
    graph = eager_gqa[1].copy()
    before = graph.to_json()
    assert run_pass(graph)[0].details["attention"] == 0 and graph.to_json() == before
    for target in ("cpu", "h100-bf16"):
        assert "raise_attention" not in full_pipeline(get_target(target))
