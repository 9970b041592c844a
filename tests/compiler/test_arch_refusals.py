"""Fail closed: a model llmc would compute wrongly is refused at compile time with one line naming
the node or config field (exit 2 from the CLI, no artifact): a config field that changes attention
and that llmc does not carry, attention lowering cannot raise (SDPA over no causal mask), and an op
from another namespace than aten (as transformers 5 runs the experts of MoE blocks other than
Mixtral's: see test_arch_moe.py)."""

from types import SimpleNamespace

import pytest
import tiny_hf_models as tiny
import torch
import torch.nn.functional as F
import transformers
from llmc_cli import error_line, llmc_in_process
from torch import nn

from llmc.compiler.pipeline import trace_and_lower
from llmc.errors import IRError

SIZES = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128, **tiny.SPECIAL)


@pytest.mark.parametrize("config,field", [
    (lambda: transformers.LlamaConfig(**SIZES, use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (lambda: transformers.FalconConfig(vocab_size=tiny.VOCAB, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, alibi=True), "alibi=True"),
    (lambda: transformers.LlamaConfig(**SIZES, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope type 'dynamic'"),
])
def test_an_uncarried_attention_field_fails_the_cli_compile_naming_it(config, field, tmp_path, capfd):
    tiny.save_checkpoint(config(), tmp_path / "hf")
    code, _, err = llmc_in_process(capfd, "compile", tmp_path / "hf", "-o", tmp_path / "out.llmc", "--quiet")
    assert code == 2 and field in error_line(err) and "config.json" in error_line(err)
    assert not (tmp_path / "out.llmc").exists()


class Model(nn.Module):
    """Called as an HF causal LM; `mix` is what its one block does to the embeddings."""

    def __init__(self, mix):
        super().__init__()
        self.embed = nn.Embedding(tiny.VOCAB, 32)
        self.head = nn.Linear(32, tiny.VOCAB, bias=False)
        self.mix = mix

    def forward(self, input_ids, position_ids, **unused):
        x = self.embed(input_ids)
        return SimpleNamespace(logits=self.head(x + self.mix(x)))


def bidirectional(x):
    heads = x.unflatten(-1, (4, 8)).transpose(1, 2)
    return F.scaled_dot_product_attention(heads, heads, heads).transpose(1, 2).flatten(-2)


@torch.library.custom_op("llmc_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@twice.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("mix,why", [
    (bidirectional, r"node scaled_dot_product_attention\S* \(aten\.scaled_dot_product_attention\.default\) is "
                    r"attention that lowering did not raise"),
    (lambda x: torch.cumsum(x, dim=1), r"node cumsum\S* \(aten\.cumsum\.default\) reduces or scans along the token"),
    (twice, r"node twice\S* \(llmc_test\.twice\.default\) is an op of namespace 'llmc_test', not aten"),
])
def test_what_lowering_cannot_serve_is_refused_naming_the_node(mix, why):
    with pytest.raises(IRError, match=why):
        trace_and_lower(Model(mix).eval(), 64, lambda *a: None)
