"""The cpu-bf16 target: bf16 weights and activations through torch on the CPU. Its linear kernel
runs oneDNN's blocked bf16 weight and gives F.linear's bits; a batch decoding together (block-diagonal
decode attention) follows the reference interpreter on the same bf16 graph; SmolLM2 compiled for it
stays within bf16 rounding of the fp32 model."""

import pytest
import torch
import torch.nn.functional as F

import llmc
from llmc.codegen.torch_cpu.cpu_kernels import linear, prepare_linear
from llmc.compiler.artifact import read_artifact
from llmc.compiler.inspect import report as inspect_report
from llmc.compiler.inspect import summarize
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams

needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="this CPU has no native bf16 GEMM (AVX512-BF16 or AMX)")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_blocked_bf16_linear_gives_f_linear_bits(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).bfloat16()
    x = torch.randn(rows, 80, generator=gen).bfloat16()
    prepared = prepare_linear([None, weight], {})
    assert prepared["blocked_from"] == 1
    [out] = linear(x, weight, **prepared)
    assert out.dtype == torch.bfloat16 and torch.equal(out, F.linear(x, weight))


def test_fp32_weights_get_no_blocked_copy_at_load():
    assert prepare_linear([None, torch.randn(8, 8)], {}) == {}


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu-bf16", output=tmp_path_factory.mktemp("bf16") / "tiny.llmc")


def reference_logits(art, ids: list[int]) -> torch.Tensor:
    """The artifact's own bf16 graph through the reference interpreter: logits [len(ids), vocab]."""
    graph = Graph.from_json(art.graph_json)
    rows = torch.arange(len(ids))
    inputs = {"input_ids": torch.tensor(ids), "positions": rows, "logits_indices": rows}
    return interpret(graph, inputs, weights=art.weights)["logits"].float()


def test_tiny_bf16_artifact_is_bf16_throughout(tiny_bf16):
    report = inspect_report(tiny_bf16)
    assert report["target"] == "cpu-bf16"
    assert set(report["weight_bytes"]) == {"bfloat16", "float32"}   # float32: rotary inv_freq only
    assert report["weight_bytes"]["float32"] < 1024
    # the steps stay in torch for two reasons, each shown once rather than once per node
    kept = [line for line in summarize(tiny_bf16).splitlines() if line.strip().startswith("torch: ")]
    assert len(kept) == 2 and "more: only float32 activations run in ONNX Runtime segments" in kept[0]


def test_batched_bf16_decode_follows_the_reference_interpreter(tiny_bf16):
    """Five sequences decode together (every step past the prompts is decode-only, so attention takes
    the block-diagonal path). Teacher-forced through the reference on the same graph, each token the
    engine chose is the reference's top-1 or within bf16 rounding of it: the two attentions round
    scores and probabilities at different places."""
    engine = Engine(tiny_bf16, EngineConfig(kv_memory="4MiB", seed=0))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 17, 9, 33, 12)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, params=SamplingParams(max_tokens=16, temperature=0.0,
                                                                              ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    art = read_artifact(tiny_bf16)
    top1 = total = 0
    for i, p in enumerate(prompts):
        tokens = done[str(i)].outputs[0].token_ids
        logits = reference_logits(art, p + tokens)[len(p) - 1:-1]
        best = logits.max(dim=-1).values
        chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
        spread = (logits.max() - logits.min()).item()
        assert ((best - chosen) <= 0.02 * spread).all(), (i, (best - chosen).max().item(), spread)
        top1 += int((chosen == best).sum())
        total += len(tokens)
    assert top1 >= 0.9 * total
