"""Sharded GPU-target artifacts: their plans' all_reduce, all_gather, send and recv are
torch.distributed calls on the ranks' tensors, which go over NCCL between GPUs (one a rank) and
over gloo between CPUs. No GPU here: tiny-llama compiled for h100-bf16 (bf16 activations; a stage
sends float32) with --tp 2 --pp 2 runs on 4 gloo ranks through Triton's interpreter (device="cpu")
and gives the unsharded h100-bf16 artifact's greedy tokens."""

import pytest
import torch

import llmc
from llmc.codegen.torch_cpu import cpu_kernels
from llmc.codegen.triton import triton_kernels
from llmc.runtime.parallel.group import process_group_backend
from llmc.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.triton

PROMPT = "The river starts as a thin stream"


def test_gpu_ranks_join_over_nccl_and_cpu_ranks_over_gloo():
    assert process_group_backend(torch.device("cuda", 1)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"
    for op in ("all_reduce", "all_gather", "send", "recv"):
        assert triton_kernels.resolve_kernel(f"triton.{op}") is cpu_kernels.CPU_KERNELS[f"cpu.{op}"]


def greedy(path, tokens=4) -> list[int]:
    model = llmc.load(path, device="cpu", threads=1)
    try:
        return model.generate(PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0] \
            .outputs[0].token_ids
    finally:
        model.close()


def test_a_triton_plan_on_tp2_x_pp2_ranks_gives_the_unsharded_tokens(tmp_path):
    whole = llmc.compile("tiny-llama", target="h100-bf16", output=tmp_path / "whole.llmc")
    sharded = llmc.compile("tiny-llama", target="h100-bf16", output=tmp_path / "tp2pp2.llmc", tp=2, pp=2)
    assert greedy(sharded) == greedy(whole)
