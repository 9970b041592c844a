"""Checks shared by the sharded-runtime tests: a sharded artifact's greedy tokens and top-5
log-probabilities against the unsharded one's, mixed-length requests batched against alone, and
`llmc run` refusing a copy whose rank 1 weights changed."""

import shutil

import torch

from llmc.runtime.sampling_params import SamplingParams
from tests.llmc_cli import error_line, llmc_in_process


def outputs(model, prompts, max_tokens=32):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    return [o.outputs[0] for o in model.generate(prompts, params)]


def assert_same_tokens_and_logprobs(want, got, tolerance):
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        for step_w, step_g in zip(w.logprobs, g.logprobs):
            assert step_g.keys() == step_w.keys()
            for token, lp in step_w.items():
                assert abs(step_g[token].logprob - lp.logprob) < tolerance


def assert_mixed_requests_batched_equal_alone(model, text, count, max_tokens):
    """`count` prompts cut from `text` at seeded random lengths, the i-th asking `max_tokens(i)`."""
    gen = torch.Generator().manual_seed(0)
    base = model.engine.tokenizer(text)["input_ids"]
    prompts = [{"prompt_token_ids": base[: 2 + int(torch.randint(0, len(base) - 2, (1,), generator=gen))]}
               for _ in range(count)]
    params = [SamplingParams(max_tokens=max_tokens(i), temperature=0.0, ignore_eos=True) for i in range(count)]
    together = [o.outputs[0].token_ids for o in model.generate(prompts, params)]
    alone = [model.generate(p, q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone


def assert_a_changed_rank_1_fails_to_load(artifact, folder, capfd, rank_name: str):
    """`llmc run` on a copy of `artifact` with one byte of rank 1's weights flipped: exit 2, one line
    naming the rank (`rank_name`) and the file."""
    art = shutil.copytree(artifact, folder / "tampered.llmc")
    weights = art / "rank1" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 1
    weights.write_bytes(bytes(data))
    code, _, err = llmc_in_process(capfd, "run", art, "--prompt", "hi", "--max-tokens", "2")
    assert code == 2
    assert error_line(err) == (f"{rank_name} failed to load: artifact '{art}': file rank1/weights.safetensors "
                               f"fails its sha256 check (tampered or truncated); recompile")
