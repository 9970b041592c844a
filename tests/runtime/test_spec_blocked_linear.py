"""A verification step multiplies k + 1 rows per sequence; on the CPU the speculator gives the
target's fp32 linears oneDNN-blocked weights for that. They must compute what F.linear computes:
checked against float64 at every row count, and through a whole engine's logits."""

import pytest
import torch

import llmc
from llmc.codegen.torch_cpu.cpu_kernels import blocked_linear_weight, linear
from llmc.runtime.engine import Engine, EngineConfig


@pytest.mark.parametrize("rows", [1, 2, 6, 9, 64])
def test_blocked_linear_matches_float64(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(300, 200, generator=gen), torch.randn(300, generator=gen)
    x = torch.randn(rows, 200, generator=gen)
    out = linear(x, weight, bias, blocked=blocked_linear_weight(weight))[0]
    reference = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)


def test_blocked_linear_refuses_what_it_cannot_hold():
    assert blocked_linear_weight(None) is None
    assert blocked_linear_weight(torch.randn(8, 4, dtype=torch.bfloat16)) is None


@pytest.fixture(scope="module")
def torch_artifact(tmp_path_factory):
    """tiny-llama on torch's CPU kernels (its default plan may run ONNX Runtime segments)."""
    return llmc.compile("tiny-llama", target="cpu", kernels="cpu",
                        output=tmp_path_factory.mktemp("torch-kernels") / "tiny.llmc")


def test_speculating_engine_blocks_its_linears_and_keeps_the_logits(torch_artifact):
    """With batch invariance off (it runs the native fp32 GEMV at every row count, blocking nothing)."""
    invariant = Engine(torch_artifact, EngineConfig(kv_memory="4MiB", speculative={"method": "ngram"}))
    assert not [launch for launch in invariant.executor._program if "blocked" in launch.attrs]
    plain = Engine(torch_artifact, EngineConfig(kv_memory="4MiB", batch_invariant=False))
    spec = Engine(torch_artifact, EngineConfig(kv_memory="4MiB", speculative={"method": "ngram"},
                                               batch_invariant=False))
    blocked = [launch for launch in spec.executor._program if "blocked" in launch.attrs]
    assert blocked and all(launch.fn is linear for launch in blocked)
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 6, 33):
        ids = torch.randint(0, plain.model["vocab_size"], (tokens,), generator=gen)
        inputs = {"input_ids": ids, "positions": torch.arange(tokens), "logits_indices": torch.arange(tokens)}
        torch.testing.assert_close(spec.executor.run_values(inputs)["logits"],
                                   plain.executor.run_values(inputs)["logits"], rtol=1e-4, atol=1e-4)
