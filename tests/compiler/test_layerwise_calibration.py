"""Layer-sequential calibration: with a --calib file the lossy passes run on a model whose weights
stay in the source file (read node by node as calibration activations flow through the graph, one
layer's weights, Hessians and samples in memory), and write the bytes the whole-model compile
wrote. Without one, the model samples its own text and must fit in memory, or is refused."""

import pytest
import torch
from test_streaming_compile import compiled_files

import llmc
from llmc.compiler import pipeline
from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret, interpret_many
from llmc.errors import PassError

CALIB_WORDS = ("the river keeps a quiet count of stones and every lantern on the bridge hums "
               "an old tune while the baker folds bread for seven neighbours before dawn ")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import tiny_hf_models as tiny

    path = tmp_path_factory.mktemp("hf") / "llama"
    tiny.save_checkpoint(tiny.ARCHS["llama"](), path, seed=5)
    calib = path.parent / "calib.txt"
    calib.write_text(CALIB_WORDS * 40)
    return path, calib


def whole_model(monkeypatch):
    """Make the compile read every weight into the module first, as before streaming."""
    seen = []

    def load(source, lazy=False):
        loaded = load_model(source)
        seen.append(loaded.lazy_weights)
        return loaded
    monkeypatch.setattr(pipeline, "load_model", load)
    return seen


@pytest.mark.parametrize("flags", [{"quant": "int4-awq", "group_size": 32}, {"quant": "int4-gptq", "group_size": 32},
                                   {"quant": "w8a8"},
                                   {"quant": "int8"}, {"kv_cache": "int8", "quant": "none"}],
                         ids=["awq", "gptq", "w8a8", "int8", "kv-int8"])
def test_layerwise_calibration_writes_the_bytes_of_the_whole_model_compile(checkpoint, tmp_path, monkeypatch, flags):
    path, calib = checkpoint
    common = dict(target="cpu", kernels="cpu", calib=str(calib), calib_samples=3, calib_seq_len=32, quiet=True,
                  **flags)
    monkeypatch.setattr(pipeline, "whole_model_limit", lambda: 1)   # nothing may be read whole
    streamed = llmc.compile(str(path), output=tmp_path / "streamed", **common)
    monkeypatch.undo()
    seen = whole_model(monkeypatch)
    whole = llmc.compile(str(path), output=tmp_path / "whole", **common)
    assert seen == [{}]
    assert compiled_files(streamed) == compiled_files(whole)


def test_self_generated_calibration_over_the_memory_limit_is_refused_naming_calib(checkpoint, tmp_path, monkeypatch):
    path, _ = checkpoint
    monkeypatch.setattr(pipeline, "whole_model_limit", lambda: 1)
    with pytest.raises(PassError, match=r"samples itself.*--calib FILE"):
        llmc.compile(str(path), target="cpu", quant="int4-awq", output=tmp_path / "a", quiet=True)
    assert not (tmp_path / "a").exists()


def test_interpret_many_is_interpret_per_sequence_reading_each_weight_once(checkpoint):
    path, _ = checkpoint
    loaded = load_model(str(path), lazy=True)
    graph = pipeline.trace(loaded.module, 64, lambda *a: None)
    pipeline.attach_lazy_weights(graph, loaded)
    reads = {}
    for name in list(graph.weights):
        entry = graph.weights.entry(name)
        if graph.weights.is_lazy(name):
            graph.weights[name] = entry._replace(load=lambda e=entry, n=name: reads.__setitem__(n, reads.get(n, 0) + 1)
                                                 or e.load())
    g = torch.Generator().manual_seed(0)
    inputs = []
    for t in (5, 9, 3):
        ids = torch.randint(10, 200, (t,), generator=g)
        inputs.append({"input_ids": ids, "positions": torch.arange(t), "logits_indices": torch.arange(t)})
    many = interpret_many(graph, inputs)
    assert reads and set(reads.values()) == {1}          # each lazy weight made once for all three
    for one, got in zip(inputs, many):
        assert torch.equal(interpret(graph, one)[graph.outputs[0]], got[graph.outputs[0]])
