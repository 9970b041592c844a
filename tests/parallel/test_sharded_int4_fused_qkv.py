"""int4 weights (RTN, groups of 32) with fused QKV and gate/up projections on real gloo ranks:
tiny-llama compiled with --pp 2 runs each stage's q/k/v as one int4 GEMM (qkv_proj) and gives the
unsharded int4 artifact's greedy tokens (64) and log-probabilities within 1e-4. (--tp int4 is
checked against the fp32 references in test_shard_pass.py: the CPU int4 GEMM runs on bf16
activations, so a row-parallel split rounds its partial sums differently from the whole GEMM.)"""

import json

import pytest

import llmc
from tests.parallel.sharded_checks import assert_same_tokens_and_logprobs, outputs

PROMPTS = ["The river starts as a thin stream", "Numbers help us count"]
INT4 = {"quant": "int4-rtn", "group_size": 32}


@pytest.fixture(scope="module")
def unsharded_int4_outputs(tmp_path_factory):
    # torch kernels, as the sharded stages run: the default (auto) may choose ONNX Runtime's
    # MatMulNBits on fp32 activations, ~5e-3 from torch's packed GEMM on bf16 activations
    path = llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("int4") / "tiny.llmc",
                        kernels="cpu", **INT4)
    # each prompt alone, as the stages prefill them: up to 8 rows run the native 4-bit GEMV on fp32
    # activations, a batch of more torch's packed GEMM on bf16 ones (~5e-3 apart in a log-probability)
    model = llmc.load(path)
    return [out for prompt in PROMPTS for out in outputs(model, [prompt], max_tokens=64)]


def fused_projections(artifact, rank: int) -> dict[str, set[str]]:
    """The kernels of rank `rank`'s fused q/k/v and gate/up projections."""
    plan = json.loads((artifact / f"rank{rank}" / "plan.json").read_text())
    kernels = {}
    for step in plan["steps"]:
        name = step["node"].rsplit("_", 1)[0]
        if name in ("qkv_proj", "gate_up_proj"):
            kernels.setdefault(name, set()).add(step["kernel"])
    return kernels


def test_int4_fused_qkv_stages_equal_the_unsharded_int4_artifact(tmp_path, unsharded_int4_outputs):
    artifact = llmc.compile("tiny-llama", target="cpu", output=tmp_path / "pp2.llmc", pp=2, **INT4)
    for rank in range(2):
        assert fused_projections(artifact, rank) == {"qkv_proj": {"cpu.qlinear"}, "gate_up_proj": {"cpu.qlinear"}}
    model = llmc.load(artifact)
    try:
        assert_same_tokens_and_logprobs(unsharded_int4_outputs, outputs(model, PROMPTS, max_tokens=64), 1e-4)
    finally:
        model.close()
