"""Mixtral, a tiny seeded random-weight HF checkpoint: each sparse MoE block (router softmax, top-2
of 4 experts renormalised, SwiGLU experts) is recognised and lowered to the `moe` op, which the CPU
runs sparsely (an expert no token chose is never read) and a GPU target runs as Triton kernels.
HF's logits at every position of a 40-token prompt and 24 decode steps through the paged KV cache
match to 1e-4, 16 mixed-length requests batched equal their solo runs, fp8 weights refuse it in one
line (int8/int4 store the experts: test_arch_moe_quant.py), and an MoE block of another structure
(OLMoE's) is refused at lowering."""

import json
import math

import pytest
import tiny_hf_models as tiny
import torch
import torch.nn.functional as F
import transformers

import llmc
from llmc import SamplingParams
from llmc.codegen.torch_cpu.cpu_moe import moe as cpu_moe
from llmc.compiler.ops import OPS
from llmc.errors import IRError, PassError

WINDOW = 16


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    source = tmp_path_factory.mktemp("mixtral")
    module = tiny.save_checkpoint(tiny.ARCHS["mixtral"](sliding_window=WINDOW), source, seed=7)
    path = llmc.compile(str(source), output=tmp_path_factory.mktemp("art") / "mixtral.llmc")
    return source, module, llmc.load(path, kv_memory="8MiB"), path


def randn(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def expert_weights(experts=4, hidden=24, inter=20, seed=0):
    return (randn(experts, hidden, seed=seed), randn(experts, 2 * inter, hidden, seed=seed + 1, scale=hidden ** -0.5),
            randn(experts, hidden, inter, seed=seed + 2, scale=inter ** -0.5))


def moe_float64(x, router, gate_up, down, top_k):
    """Token by token, as Mixtral's model card states it, in float64."""
    x, router, gate_up, down = (t.double() for t in (x, router, gate_up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router @ x[t], -1)
        top = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e] for e in top)
        for e in top:
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += probs[e] / total * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_the_reference_and_the_sparse_cpu_kernel_compute_the_routed_experts(top_k):
    x, (router, gate_up, down) = randn(9, 24, seed=top_k), expert_weights(seed=10 * top_k)
    want = moe_float64(x, router, gate_up, down, top_k)
    for got in (OPS["moe"].reference(x, router, gate_up, down, top_k=top_k)[0],
                cpu_moe(x, router, gate_up, down, top_k=top_k)[0]):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_cpu_kernel_never_reads_an_expert_no_token_chose():
    x, (router, gate_up, down) = randn(6, 24, seed=3), expert_weights(seed=4)
    router[3] = -100.0 * x.sum(0)  # expert 3 loses every token's vote
    want = cpu_moe(x, router, gate_up, down, top_k=2)[0]
    gate_up[3], down[3] = math.nan, math.nan
    got = cpu_moe(x, router, gate_up, down, top_k=2)[0]
    assert torch.equal(got, want)


def test_every_block_is_lowered_to_the_moe_op(mixtral):
    nodes = json.loads((mixtral[3] / "graph.json").read_text())["nodes"]
    assert [n["attrs"] for n in nodes if n["op"] == "moe"] == [{"top_k": 2}, {"top_k": 2}]
    assert not [n for n in nodes if n["op"] == "aten"]


def test_logits_at_every_position_past_the_window_match_hf_through_the_paged_cache(mixtral):
    _, module, llm, _ = mixtral
    ids = tiny.prompt_ids(40, seed=1)
    ids += tiny.hf_greedy(module, ids, 24)
    got = tiny.paged_logits(llm, ids, prefill_chunks=(17, 23))
    assert tiny.max_relative_error(got, tiny.hf_logits(module, ids)) < 1e-4


def test_16_mixed_length_requests_batched_equal_their_solo_runs(mixtral):
    llm = mixtral[2]
    prompts = [{"prompt_token_ids": tiny.prompt_ids(n, seed=n)} for n in (3, 5, 8, 9, 12, 15, 17, 20, 23, 26, 29,
                                                                         31, 33, 36, 38, 40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]


def test_fp8_weights_refuse_the_expert_weights_they_would_leave_float(mixtral, tmp_path):
    with pytest.raises(PassError, match=r"node moe_0 \(moe\): this weight format covers linears"):
        llmc.compile(str(mixtral[0]), output=tmp_path / "fp8.llmc", quant="fp8", calib_samples=1,
                     calib_seq_len=16)
    assert not (tmp_path / "fp8.llmc").exists()


def test_an_moe_block_of_another_structure_is_refused_at_lowering(tmp_path):
    config = transformers.OlmoeConfig(**tiny.SIZES, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    tiny.save_checkpoint(config, tmp_path / "hf")
    with pytest.raises(IRError, match=r"node grouped_mm\S* \(transformers\.grouped_mm_fallback\.default\) is an op "
                                      r"of namespace 'transformers'"):
        llmc.compile(str(tmp_path / "hf"), output=tmp_path / "out.llmc")


@pytest.mark.triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_triton_kernels_match_the_reference(dtype, tol):
    from llmc.codegen.triton.triton_moe import moe as triton_moe

    x, weights = randn(7, 24, seed=5), expert_weights(seed=6)
    x, (router, gate_up, down) = x.to(dtype), (w.to(dtype) for w in weights)
    got = triton_moe(x, router, gate_up, down, top_k=2, target="h100")
    want = OPS["moe"].reference(x, router, gate_up, down, top_k=2)[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.triton
def test_a_gpu_target_decodes_hf_s_greedy_tokens_through_the_triton_interpreter(mixtral, tmp_path):
    source, module, _, _ = mixtral
    # kept in fp32 (cast_bf16 off): bf16 rounding may flip a router's near-tie and so an expert
    path = llmc.compile(str(source), target="h100-bf16", output=tmp_path / "gpu.llmc", disable=["cast_bf16"])
    assert "moe" in json.loads((path / "plan.json").read_text())["meta"]["kernels"]["triton_ops"]
    llm = llmc.load(path, device="cpu", kv_memory="8MiB")
    ids = tiny.prompt_ids(20, seed=3)
    assert tiny.llmc_greedy(llm, ids, 8) == tiny.hf_greedy(module, ids, 8)
