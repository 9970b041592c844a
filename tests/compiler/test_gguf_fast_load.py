"""The GGUF frontend's own loading path: each quant type's torch dequantisation equals
gguf.quants.dequantize bit for bit, the faster reader parses what gguf's reader parses, and the
loaded model equals transformers' from_pretrained(gguf_file=...) tensor for tensor."""


import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf_files import finish, llama_writer, write_tensors
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from llmc.compiler.frontends.gguf import PlainArrayReader, load_gguf_file, read_gguf, unpermute_rows
from llmc.compiler.frontends.gguf_dequant import dequantize
from llmc.errors import ModelLoadError

QUANTISABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16]  # gguf-py can quantise these itself
# byte offsets of each block's fp16 scale fields, made finite in random blocks
SCALE_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(rng, kind: Q, rows: int, columns: int) -> np.ndarray:
    """Quantised bytes of a (rows, columns) tensor: quantised normals, or random bits with finite scales."""
    if kind in QUANTISABLE:
        return gguf.quants.quantize(rng.standard_normal((rows, columns)).astype(np.float32), kind)
    block, type_size = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, columns // block * type_size), dtype=np.uint8)
    blocks = data.reshape(-1, type_size)
    for start in SCALE_FIELDS[kind]:
        blocks[:, start:start + 2] = rng.standard_normal((len(blocks), 1)).astype(np.float16).view(np.uint8)
    return data


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, *QUANTISABLE, *SCALE_FIELDS], ids=lambda k: k.name)
def test_dequantize_equals_gguf_reference_bit_for_bit(kind, tmp_path):
    rng = np.random.default_rng()
    rows, columns = 3, 512
    if kind in (Q.F32, Q.F16):
        values = rng.standard_normal((rows, columns)).astype(np.float32 if kind == Q.F32 else np.float16)
    else:
        values = random_blocks(rng, kind, rows, columns)
    (tensor,) = write_tensors(tmp_path / "t.gguf", {"w": (values, kind)}).tensors
    assert tensor.tensor_type == kind
    ours = dequantize(tensor)
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, kind)))
    assert ours.dtype == torch.float32 and ours.shape == (rows, columns)
    assert torch.equal(ours.view(torch.int32), reference.reshape(rows, columns).view(torch.int32))


def test_types_without_a_torch_version_go_through_the_reference(tmp_path):
    values = np.random.default_rng().integers(0, 256, (2, GGML_QUANT_SIZES[Q.Q2_K][1]), dtype=np.uint8)
    values[:, -4:] = np.array([0.5, 0.25], dtype=np.float16).view(np.uint8)  # the block's d and dmin
    (tensor,) = write_tensors(tmp_path / "t.gguf", {"w": (values, Q.Q2_K)}).tensors
    reference = np.array(gguf.quants.dequantize(tensor.data, Q.Q2_K))
    assert torch.equal(dequantize(tensor), torch.from_numpy(reference).reshape(2, 256))


def test_plain_array_reader_parses_what_gguf_reader_parses(tmp_path):
    rng = np.random.default_rng()
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    # string and scalar arrays (PlainArrayReader cuts those itself): multi-byte and empty entries too
    writer.add_token_list([f"tok{i}" for i in range(50)] + ["", "é漢🙂"])
    writer.add_token_scores(rng.standard_normal(52).astype(np.float32).tolist())
    writer.add_token_types(rng.integers(1, 6, 52).tolist())
    writer.add_array("test.flags", [True, False, True])
    writer.add_head_count(4)
    writer.add_rope_freq_base(10000.0)
    writer.add_tensor("a", rng.standard_normal((4, 32)).astype(np.float32))
    writer.add_tensor("b", random_blocks(rng, Q.Q8_0, 2, 64), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = PlainArrayReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for mine, ref in zip(ours.fields.values(), theirs.fields.values()):
        assert (mine.types, mine.data, mine.offset) == (ref.types, ref.data, ref.offset)
        assert all(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
                   for a, b in zip(mine.parts, ref.parts, strict=True))
        assert mine.contents() == ref.contents()
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data_offset) == (ref.name, ref.tensor_type, ref.data_offset)
        assert mine.data.dtype == ref.data.dtype and np.array_equal(mine.data, ref.data)


def test_a_file_cut_inside_its_vocabulary_is_refused(tmp_path):
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"token-{i:03d}" for i in range(100)])
    writer.add_tensor("a", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data[:data.index(b"token-050")])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        read_gguf(path)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3)])
def test_unpermute_rows_matches_transformers(heads, kv_heads):
    processor = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    for name, count, shape in [("blk.0.attn_q.weight", heads, (heads * 8, 24)),
                               ("blk.0.attn_k.weight", kv_heads, (kv_heads * 8, 24)),
                               ("blk.0.attn_q.bias", heads, (heads * 8,))]:
        values = np.random.default_rng().standard_normal(shape).astype(np.float32)
        expected = processor.process(values, name).weights
        expected = torch.from_numpy(np.ascontiguousarray(expected))
        assert torch.equal(unpermute_rows(torch.from_numpy(values), count), expected)


def tiny_gguf(path, tiny) -> None:
    """tiny-llama as a llama.cpp-style GGUF: q/k rows permuted, weights in a mix of quant types."""
    config, writer = tiny.config, llama_writer(path, tiny.config, tiny.tokenizer)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    kinds = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16, Q.F16]
    for i, (name, tensor) in enumerate(tiny.module.state_dict().items()):
        stem, _, suffix = name.rpartition(".")
        values = tensor.numpy().copy()
        count = next((n for proj, n in heads.items() if f".{proj}." in name), None)
        if count:
            values = values.reshape(count, 2, -1, values.shape[1]).swapaxes(1, 2).reshape(values.shape)
        kind = kinds[i % len(kinds)] if values.ndim == 2 else Q.F32
        stored = values.astype(np.float16) if kind == Q.F16 else (
            values if kind == Q.F32 else gguf.quants.quantize(values, kind))
        writer.add_tensor(f"{name_map.get_name(stem)}.{suffix}", stored,
                          raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    finish(writer)


def assert_same_model(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    mine = {**ours.state_dict(), **dict(ours.named_buffers())}
    reference = {**theirs.state_dict(), **dict(theirs.named_buffers())}
    assert mine.keys() == reference.keys()
    for name, tensor in reference.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    assert ours.config.to_dict() == theirs.config.to_dict()


def test_tiny_gguf_loads_exactly_as_transformers_loads_it(tiny_model, tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_gguf(path, tiny_model)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation="sdpa")
    assert_same_model(load_gguf_file(path).module, reference)


@pytest.mark.smollm2
def test_smollm2_loads_exactly_as_transformers_loads_it(smollm2_gguf):
    reference = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                     dtype=torch.float32, attn_implementation="sdpa")
    assert_same_model(load_gguf_file(smollm2_gguf).module, reference)
