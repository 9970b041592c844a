"""Small seeded Llama models for the pruning tests, lowered to llmc IR, with what the tests
check against: the HF module itself (activations captured by torch hooks, independent of llmc's
interpreter), fresh calibration tokens, and running a graph through the interpreter and the
cpu plan executor."""

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmc.codegen.plan import build_plan
from llmc.compiler.frontends.samples import fill_seeded_weights
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.compiler.pipeline import trace_and_lower
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass
from llmc.runtime.executor import PlanExecutor

VOCAB = 96

# name -> (heads, kv_heads, head_dim, hidden, intermediate, layers): GQA like tiny-llama, a ragged
# one (hidden 42 is not heads * head_dim, intermediate 76 not a multiple of 8, 3 layers), and MHA.
SHAPES = {"gqa": (4, 2, 16, 64, 128, 2), "ragged": (6, 3, 8, 42, 76, 3), "mha": (3, 3, 8, 24, 48, 3)}


@dataclass
class Model:
    module: LlamaForCausalLM
    graph: Graph


def build(shape: str, seed: int = 0) -> Model:
    heads, kv_heads, head_dim, hidden, inter, layers = SHAPES[shape]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         attn_implementation="sdpa", dtype="float32")
    module = LlamaForCausalLM(config).eval()
    fill_seeded_weights(module, torch.Generator().manual_seed(seed))
    return Model(module, trace_and_lower(module, 64, lambda *a: None))


def tokens(seed: int, count: int = 3, length: int = 20) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length + 3 * i,), generator=g) for i in range(count)]


def run_pass(graph: Graph, name: str, calibration, **options):
    """Run one pass through the PassManager (which verifies the graph after it); its record."""
    return PassManager([get_pass(name, **options)], PassContext(calibration=calibration, quiet=True)).run(graph)[0]


def all_logits(graph: Graph, ids: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(len(ids))
    return interpret(graph, {"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"]


def plan_logits(graph: Graph, ids: torch.Tensor) -> torch.Tensor:
    """The graph's cpu plan run by the runtime's executor."""
    rows = torch.arange(len(ids))
    executor = PlanExecutor(build_plan(graph, "cpu", 64), graph.weights)
    return executor.run_values({"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"]


def capture(module: torch.nn.Module, names: list[str], seqs: list[torch.Tensor], output: bool = False):
    """{module name: float64 [all tokens, features]} of the inputs (or outputs) of the named
    submodules over every sequence, from torch forward hooks on the HF model."""
    seen = {n: [] for n in names}
    modules = dict(module.named_modules())

    def hook(name):
        def fn(mod, args, kwargs, out):
            x = (out[0] if isinstance(out, tuple) else out) if output else (args[0] if args else
                                                                             kwargs["hidden_states"])
            seen[name].append(x.detach().reshape(-1, x.shape[-1]).double())
        return fn
    handles = [modules[n].register_forward_hook(hook(n), with_kwargs=True) for n in names]
    with torch.no_grad():
        for ids in seqs:
            module(input_ids=ids[None], use_cache=False)
    for h in handles:
        h.remove()
    return {n: torch.cat(v).numpy() for n, v in seen.items()}
