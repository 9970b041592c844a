"""Layer stamping (compiler/layer_stamp.py): a model whose layers repeat is exported with three of
them and the rest copied; the lowered graph, its params (names, order, tensors) and weights equal
those of a whole-model export, and every model whose layers differ is exported whole."""

import pytest
import tiny_hf_models as tiny
import torch
import transformers

from llmc.compiler import layer_stamp
from llmc.compiler.layer_stamp import repeated_layers, traced_graph
from llmc.compiler.pipeline import lowering_configs
from llmc.compiler.trace import export_lm, translate
from llmc.passes.base import PassContext, PassManager

LAYERS = 5


def deep(arch: str, seed: int = 0, **fields) -> torch.nn.Module:
    count = {"n_layer": LAYERS} if arch == "gpt2" else {"num_hidden_layers": LAYERS}
    return tiny.tiny_module(tiny.ARCHS[arch](**count, **fields), seed)


def lowered(graph):
    configs = lowering_configs()
    PassManager([c.instantiate() for c in configs], PassContext(quiet=True), [c.stage for c in configs]).run(graph)
    return graph


def assert_same_graph(stamped, whole):
    assert list(stamped.params) == list(whole.params)
    assert all(stamped.weights[name] is not None and torch.equal(stamped.weights[name], whole.weights[name])
               and stamped.weights[name].data_ptr() == whole.weights[name].data_ptr() for name in whole.params)
    assert lowered(stamped).to_json() == lowered(whole).to_json()


# tied embeddings (llama), Conv1D layers under transformer.h (gpt2), the llmc::moe op (mixtral)
@pytest.mark.parametrize("arch,fields", [("llama", {"tie_word_embeddings": True}), ("gpt2", {}), ("mixtral", {})])
def test_copied_layers_lower_to_the_whole_export_s_graph(arch, fields):
    module = deep(arch, **fields)
    stamped, copied = traced_graph(module, 64)
    assert copied == LAYERS - layer_stamp.TRACED
    assert_same_graph(stamped, translate(export_lm(module, 64)))


def test_alternating_windows_are_exported_whole():
    assert repeated_layers(deep("gemma2", sliding_window=16)) is None


def test_a_layer_with_other_settings_is_exported_whole():
    module = deep("llama")
    assert repeated_layers(module) is not None
    module.model.layers[3].self_attn.scaling *= 2
    assert repeated_layers(module) is None


def test_a_hook_on_a_layer_is_exported_whole():
    module = deep("llama")
    module.model.layers[2].mlp.register_forward_hook(lambda m, args, out: out * 2)
    assert repeated_layers(module) is None


def test_three_layers_or_fewer_are_exported_whole():
    module = tiny.tiny_module(tiny.ARCHS["llama"](num_hidden_layers=layer_stamp.TRACED), 0)
    assert repeated_layers(module) is None


class LastLayerDiffers(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """A layer whose code alone (no setting) makes the last layer compute something else."""

    def forward(self, hidden_states, *args, **kwargs):
        out = super().forward(hidden_states, *args, **kwargs)
        return out * 0.5 if self.self_attn.layer_idx == self.self_attn.config.num_hidden_layers - 1 else out


def test_a_last_layer_that_traces_differently_is_exported_whole():
    module = deep("llama")
    for layer in module.model.layers:
        layer.__class__ = LastLayerDiffers
    assert repeated_layers(module) is not None  # the modules look alike: the trace tells them apart
    stamped, copied = traced_graph(module, 64)
    assert copied == 0
    muls = [n for n in stamped.nodes if n.attrs.get("target") == "aten.mul.Tensor" and 0.5 in n.attrs["args"]]
    assert len(muls) == 1
