"""KV policies (runtime/kv_policy.py) on the compiled tiny-llama: H2O keeps exactly the entries a float64
reference of the policy (the HF weights decoded token by token, each KV head its own kept set) keeps, and
its logits agree with the reference's; StreamingLLM keeps the sinks and the newest tokens; the blocks a
sequence holds drop to its budget; batched sequences keep what each keeps alone, bit for bit; bad
options and unserved artifacts are refused in one line."""

import math

import pytest
import torch

import llmc
from llmc.compiler.frontends import load_model
from llmc.errors import RuntimeLlmcError
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.kv_policy import KVPolicy, kv_policy
from llmc.runtime.sampling_params import SamplingParams

BLOCK = 4
POLICIES = {"h2o": dict(kv_policy="h2o", kv_budget=32, kv_sinks=2, kv_recent=8),
            "streaming": dict(kv_policy="streaming", kv_budget=24, kv_sinks=3)}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("kvp") / "tiny.llmc",
                        quiet=True, quant="none", kernels="cpu")


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def run(engine, requests, max_tokens=40, after_step=None):
    """Greedy outputs and each request's Sequence (its KV policy state kept after it finishes)."""
    seqs, outs = {}, {}
    for rid, ids in requests.items():
        engine.add_request(rid, prompt_token_ids=ids,
                           params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        seqs[rid] = engine.requests[rid].samples[0].seq
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants()
        if after_step:
            after_step(engine, seqs)
    return outs, seqs


# --- the float64 reference ---------------------------------------------------------------------------


def rotate(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.cat([pos * inv, pos * inv])
    half = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
    return x * ang.cos() + half * ang.sin()


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean() + eps) * w


def reference(ids: list[int], policy: KVPolicy):
    """Decode `ids` one token at a time in float64 with `policy` applied per layer and KV head as
    runtime/kv_policy.py states it: evict a block's worth when the cache is full and a token must be written.
    Returns each step's logits and, per layer, the positions each KV head keeps at the end."""
    loaded = load_model("tiny-llama")
    c, sd = loaded.config, {k: v.double() for k, v in loaded.module.state_dict().items()}
    heads, kvh, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    theta, group = c.rope_parameters["rope_theta"], heads // kvh
    cache = [dict(k=torch.zeros(kvh, 0, hd, dtype=torch.float64), v=torch.zeros(kvh, 0, hd, dtype=torch.float64),
                  pos=torch.zeros(kvh, 0, dtype=torch.long), score=torch.zeros(kvh, 0, dtype=torch.float64))
             for _ in range(c.num_hidden_layers)]
    logits = []
    for t, tok in enumerate(ids):
        x = sd["model.embed_tokens.weight"][tok]
        for i, layer in enumerate(cache):
            p = f"model.layers.{i}."
            if layer["k"].shape[1] == policy.budget:
                evict(layer, policy)
            h = rms(x, sd[p + "input_layernorm.weight"], eps)
            q = rotate((sd[p + "self_attn.q_proj.weight"] @ h).reshape(heads, hd), t, theta)
            k = rotate((sd[p + "self_attn.k_proj.weight"] @ h).reshape(kvh, hd), t, theta)
            v = (sd[p + "self_attn.v_proj.weight"] @ h).reshape(kvh, hd)
            layer["k"] = torch.cat([layer["k"], k[:, None]], 1)
            layer["v"] = torch.cat([layer["v"], v[:, None]], 1)
            layer["pos"] = torch.cat([layer["pos"], torch.full((kvh, 1), t)], 1)
            layer["score"] = torch.cat([layer["score"], torch.zeros(kvh, 1, dtype=torch.float64)], 1)
            out = []
            for j in range(heads):
                probs = torch.softmax(layer["k"][j // group] @ q[j] * hd ** -0.5, dim=0)
                layer["score"][j // group] += probs
                out.append(probs @ layer["v"][j // group])
            x = x + sd[p + "self_attn.o_proj.weight"] @ torch.cat(out)
            h = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
            gate, up = sd[p + "mlp.gate_proj.weight"] @ h, sd[p + "mlp.up_proj.weight"] @ h
            x = x + sd[p + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
        logits.append(sd["lm_head.weight"] @ rms(x, sd["model.norm.weight"], eps))
    return torch.stack(logits), [layer["pos"] for layer in cache]


def evict(layer, policy: KVPolicy):
    n = layer["k"].shape[1]
    for h in range(layer["k"].shape[0]):
        candidates = list(range(policy.sinks, n - policy.recent))
        if policy.kind == "h2o":   # lowest accumulated score first, ties to the older
            candidates.sort(key=lambda j: (layer["score"][h, j].item(), j))
        gone = set(candidates[:BLOCK])
        keep = torch.tensor([j for j in range(n) if j not in gone])
        for name in ("k", "v", "pos", "score"):
            kept = layer[name][h].index_select(0, keep)
            layer.setdefault("next_" + name, []).append(kept)
    for name in ("k", "v", "pos", "score"):
        layer[name] = torch.stack(layer.pop("next_" + name))


# --- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_keeps_what_a_float64_reference_keeps(artifact, name):
    options = POLICIES[name]
    engine = Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=BLOCK, **options))
    prompt = prompts([41])[0]
    outs, seqs = run(engine, {"a": prompt}, max_tokens=60)
    seq = seqs["a"]
    assert seq.num_evicted_tokens > 0
    # the last token sampled was never fed: the reference decodes what the engine computed
    ids = seq.token_ids[:seq.num_computed_tokens]
    ref_logits, ref_kept = reference(ids, engine.kv_policy)
    got = seq.kv_state.positions
    for layer, want in enumerate(ref_kept):
        assert torch.equal(got[layer, :, :seq.kv_len], want), f"layer {layer}"
        assert (got[layer, :, seq.kv_len:] == -1).all()
    # each generated token is the reference's greedy choice after the same context
    assert seq.output_token_ids == ref_logits[len(prompt) - 1:].argmax(-1).tolist()
    if name == "streaming":
        want = list(range(3)) + list(range(len(ids) - seq.kv_len + 3, len(ids)))
        assert got[0, 0, :seq.kv_len].tolist() == want


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_blocks_held_drop_to_the_budget(artifact, name):
    options = POLICIES[name]
    budget_blocks = math.ceil(options["kv_budget"] / BLOCK)
    most = {}

    def check(engine, seqs):
        for rid, seq in seqs.items():
            if not seq.is_finished:
                assert len(seq.live_blocks) <= budget_blocks, (rid, seq)
                most[rid] = max(most.get(rid, 0), len(seq.live_blocks))

    engine = Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=BLOCK, **options))
    full = Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=BLOCK))
    requests = dict(zip("abc", prompts([50, 9, 30], seed=2)))
    run(engine, requests, max_tokens=50, after_step=check)
    assert most == {rid: budget_blocks for rid in requests}
    most_full = {}
    run(full, requests, max_tokens=50, after_step=lambda e, seqs: most_full.update(
        {r: max(most_full.get(r, 0), len(s.live_blocks)) for r, s in seqs.items() if not s.is_finished}))
    assert all(most_full[r] > budget_blocks for r in requests)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_batched_is_solo_with_the_policy_on(artifact):
    requests = dict(zip("abcd", prompts([45, 12, 33, 70], seed=3)))
    options = dict(kv_memory="4MiB", block_size=BLOCK, max_num_batched_tokens=64, **POLICIES["h2o"])
    together, seqs = run(Engine(artifact, EngineConfig(**options)), requests)
    for rid, ids in requests.items():
        alone, solo = run(Engine(artifact, EngineConfig(**options)), {rid: ids})
        assert together[rid] == alone[rid], rid
        assert torch.equal(seqs[rid].kv_state.positions, solo[rid].kv_state.positions), rid
        assert torch.equal(seqs[rid].kv_state.scores, solo[rid].kv_state.scores), rid


def test_forked_samples_keep_their_own_entries(artifact):
    """n > 1 samples share the prompt's blocks; each evicts into blocks of its own."""
    engine = Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=BLOCK, seed=1, **POLICIES["h2o"]))
    engine.add_request("n", prompt_token_ids=prompts([20])[0],
                       params=SamplingParams(n=3, temperature=1.0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_policy_options_are_refused_in_one_line(artifact):
    with pytest.raises(RuntimeLlmcError, match="--kv-budget"):
        EngineConfig(kv_policy="h2o")
    with pytest.raises(RuntimeLlmcError, match="--kv-policy"):
        EngineConfig(kv_budget=64)
    with pytest.raises(RuntimeLlmcError, match="h2o, streaming"):
        kv_policy("lru", 64)
    with pytest.raises(RuntimeLlmcError, match="--kv-recent applies"):
        kv_policy("streaming", 64, recent=8)
    with pytest.raises(RuntimeLlmcError, match="fewer than one block"):
        Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=16, kv_policy="h2o", kv_budget=32))
    with pytest.raises(RuntimeLlmcError, match="speculative decoding"):
        Engine(artifact, EngineConfig(kv_memory="4MiB", block_size=BLOCK, speculative="ngram", **POLICIES["h2o"]))
