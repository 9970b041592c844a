"""Load a GGUF file: config and tokenizer through transformers' GGUF support, weights dequantised
to float32 here (vectorised, bit-identical to transformers' own GGUF loader) into the model built
from that config, after checking the file parses, holds a supported architecture, and declares
exactly the tensors its metadata's model needs, in types gguf can dequantize: checked before any
allocation. Weights stored in a block format llmc imports also come as their codes, scales and
minimums (LoadedModel.stored_quant), which the compile keeps by default (--quant gguf). The file
is parsed once; transformers' metadata readers reuse that parse."""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor, get_tensor_name_map
from gguf.quants import _type_traits as DEQUANTIZERS  # the types gguf.dequantize handles besides F32/F16
from transformers import AutoConfig, AutoTokenizer
from transformers import modeling_gguf_pytorch_utils as gguf_checkpoint

from llmc.compiler.frontends.config_check import check_config_values
from llmc.compiler.frontends.gguf_dequant import LazyBlocks, RecentParts, lazy_decode, torch_shape
from llmc.compiler.frontends.model import (
    SUPPORTED_GGUF_ARCHITECTURES,
    LoadedModel,
    call_transformers,
    first_line,
    sha256_file,
)
from llmc.compiler.frontends.tensor_table import (
    StoredTensor,
    check_tensor_table,
    empty_model,
    load_weights,
    meta_model,
    placeholder,
    with_tied_names,
)
from llmc.compiler.weight_store import LazyTensor
from llmc.errors import ModelLoadError, UnsupportedModelError

try:
    from transformers.utils.quantization_config import GgufConfig  # not in every transformers version
except ImportError:
    GgufConfig = None

GGUF_MAGIC = b"GGUF"
PLAIN_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
VOCABULARY = "tokenizer.ggml.tokens"


def load_gguf_file(path: Path, source: str | None = None, lazy: bool = False) -> LoadedModel:
    """Check and load the model in GGUF file `path`; with `lazy`, its weights stay in the file
    until read (LoadedModel.lazy_weights), else they are decoded into the module."""
    reader, architecture = check_gguf(path)
    where = f"GGUF file '{path}'"
    kwargs = dict(gguf_file=path.name, local_files_only=True)
    with parsed_once(path, reader):
        config = call_transformers(path, AutoConfig.from_pretrained, path.parent, **kwargs)
        check_config_values(config, where)
        meta = meta_model(config, where)
        names = hf_names(architecture, meta, where)
        check_tensor_table(meta, tensor_table(reader, names), where)
        tokenizer = call_transformers(path, AutoTokenizer.from_pretrained, path.parent, **kwargs)
    module = empty_model(config, where)
    values, stored = lazy_state_dict(reader, names, q_k_heads(reader, architecture, config))
    load_weights(module, {name: placeholder(t) for name, t in values.items()}, where)
    record_gguf_source(module.config, path)
    loaded = LoadedModel(module=module.eval(), config=module.config, tokenizer=tokenizer,
                         name=path.stem, source_hash=sha256_file(path), source=source or str(path),
                         kind="gguf", stored_quant=with_tied_names(module, stored),
                         lazy_weights=with_tied_names(module, values))
    if not lazy:
        with one_thread():
            loaded.materialise()
    return loaded


@contextlib.contextmanager
def parsed_once(path: Path, reader: GGUFReader):
    """transformers' GGUF metadata readers (config, tokenizer) get `reader` for `path` instead of
    parsing the file again, and its metadata conversion (every vocabulary entry into Python, asked
    for by the config and again by the tokenizer) runs once, each caller getting its own copy:
    either takes seconds on a 49k-token vocabulary. Should transformers stop calling these, it
    does the work itself: slower, same result."""
    parse, convert, target = gguf.GGUFReader, gguf_checkpoint.load_gguf_checkpoint, path.resolve()
    converted = {}

    def reader_for(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == target:
            return reader
        return parse(file, *args, **kwargs)

    def metadata_for(file, return_tensors=False, **kwargs):
        if return_tensors or kwargs or Path(file).resolve() != target:
            return convert(file, return_tensors=return_tensors, **kwargs)
        if not converted:
            converted["metadata"] = convert(file)
        return copy.deepcopy(converted["metadata"])

    with (mock.patch.object(gguf, "GGUFReader", reader_for),
          mock.patch.object(gguf_checkpoint, "load_gguf_checkpoint", metadata_for)):
        yield


def check_gguf(path: Path) -> tuple[GGUFReader, str]:
    """The parsed file and its general.architecture, once the magic, header, vocabulary, tensor
    table and tensor types check out."""
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"'{path}' is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); "
                             f"re-download it")
    reader = read_gguf(path)
    architecture = read_architecture(reader, path)
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"'{path}': GGUF architecture {architecture!r} is not supported; "
                                    f"llmc compiles {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    check_contents(reader, path)
    return reader, architecture


def read_gguf(path: Path) -> GGUFReader:
    """The parsed file; the reader maps every tensor's extent, so one past the end fails here."""
    try:
        return PlainArrayReader(path)
    except Exception as e:  # the reader fails on truncation with ValueError, IndexError, struct errors
        raise ModelLoadError(f"GGUF file '{path}' is truncated or corrupt ({first_line(e)}); "
                             f"re-download it") from e


class PlainArrayReader(GGUFReader):
    """gguf's reader, slicing a plain ndarray view of its memory map rather than the np.memmap
    itself: the same values (tensor data still maps the file, uncopied), parsed about 3x faster,
    since every memmap slice costs a Python-level __array_finalize__ and the vocabulary alone is
    ~100k slices."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        array = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return array if order == "I" else array.view(array.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """gguf's parse of one field, its parts alike, with arrays of scalars or strings (a vocabulary:
        ~100k entries) cut in one pass over the bytes rather than one recursive call per entry."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            entries = list(self._get(offs, nptype, count).reshape(count, 1))
            end = offs + np.dtype(nptype).itemsize * count
        elif itype == GGUFValueType.STRING:
            entries, end = self._string_parts(offs, count)
        else:   # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        step = 2 if itype == GGUFValueType.STRING else 1
        data = list(range(2 + step - 1, 2 + len(entries), step))
        return end - orig_offs, [raw_itype, alen, *entries], data, [GGUFValueType.ARRAY, itype]

    def _string_parts(self, offs: int, count: int) -> tuple[list[np.ndarray], int]:
        """(length, bytes) parts of `count` consecutive GGUF strings from `offs`, and where they end."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        raw, parts = plain.data, []
        for _ in range(count):
            length = int.from_bytes(raw[offs:offs + 8], "little")
            parts += (plain[offs:offs + 8].view(np.uint64), plain[offs + 8:offs + 8 + length])
            offs += 8 + length
        if offs > len(plain):
            raise ValueError(f"a string array runs past the end of the file (to byte {offs} of {len(plain)})")
        return parts, offs


def read_architecture(reader: GGUFReader, path: Path) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"GGUF file '{path}' has no general.architecture; it is not a model file")
    return str(field.contents())


def check_contents(reader: GGUFReader, path: Path) -> None:
    """A vocabulary and at least one tensor, each in a type gguf can dequantize."""
    if VOCABULARY not in reader.fields:
        raise ModelLoadError(f"GGUF file '{path}' has no vocabulary ({VOCABULARY}); llmc needs the tokenizer "
                             f"in the file: re-convert the model with its tokenizer")
    if not reader.tensors:
        raise ModelLoadError(f"GGUF file '{path}' holds no tensors (only metadata, such as a vocabulary); "
                             f"pass a GGUF file with the model's weights")
    for tensor in reader.tensors:
        if tensor.tensor_type not in PLAIN_TYPES and tensor.tensor_type not in DEQUANTIZERS:
            raise ModelLoadError(f"GGUF file '{path}': tensor '{tensor.name}' has type {tensor.tensor_type.name}, "
                                 f"which is not a float type gguf can dequantize; re-convert the model with "
                                 f"float or Q*/IQ* weights")


def hf_names(architecture: str, module: torch.nn.Module, where: str) -> dict[str, str]:
    """GGUF tensor name -> the name transformers loads it as (via gguf's name map, as transformers'
    get_gguf_hf_weights_map does), for every tensor of `module` (a meta model) the map knows."""
    arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:  # transformers maps names through the same table, so it could not load it either
        raise UnsupportedModelError(f"{where}: the gguf package has no tensor names for architecture "
                                    f"{architecture!r}; convert the model with general.architecture 'llama'")
    name_map = get_tensor_name_map(arch, module.config.num_hidden_layers)
    names = {}
    for hf_name in module.state_dict():
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(stem)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def tensor_table(reader: GGUFReader, names: dict[str, str]) -> dict[str, StoredTensor]:
    """The file's tensors under the names transformers loads them as; a tensor the name map does
    not know keeps its GGUF name, so it is reported as extra."""
    return {names.get(t.name, t.name): stored_tensor(t) for t in reader.tensors}


def stored_tensor(tensor: ReaderTensor) -> StoredTensor:
    # GGUF lists dimensions innermost first; torch outermost first.
    return StoredTensor(shape=tuple(int(d) for d in reversed(tensor.shape.tolist())),
                        dtype=tensor.tensor_type.name, is_float=True)


def q_k_heads(reader: GGUFReader, architecture: str, config) -> tuple[int, int] | None:
    """(query heads, key/value heads) when q_proj/k_proj rows need llama.cpp's rope permutation
    undone: as transformers' LlamaTensorProcessor, for general.architecture 'llama' files whose
    metadata gives both head counts; None otherwise."""
    declared = all(f"{architecture}.attention.{key}" in reader.fields for key in ("head_count", "head_count_kv"))
    if architecture != "llama" or not declared:
        return None
    return config.num_attention_heads, config.num_key_value_heads


def unpermute_rows(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permute of q/k rows (transformers' _reverse_permute_weights)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape).contiguous()


def lazy_state_dict(reader: GGUFReader, names: dict[str, str], heads: tuple[int, int] | None
                    ) -> tuple[dict[str, LazyTensor], dict[str, LazyBlocks]]:
    """The file's tensors under their transformers names as lazy float32 values, and those in a
    block format llmc imports as lazy affine params: nothing is decoded until asked. Tensors with
    no such name (ones the table check lets pass, named after computed buffers) are skipped, as
    transformers skips them."""
    lazy, stored, recent = {}, {}, RecentParts()
    for tensor in (t for t in reader.tensors if t.name in names):
        rope_heads = permuted_heads(tensor.name, heads)
        rows = None if rope_heads is None else unpermute_rows(torch.arange(torch_shape(tensor)[0]), rope_heads)
        values, blocks = lazy_decode(tensor, rows, recent)
        lazy[names[tensor.name]] = values
        if blocks is not None:
            stored[names[tensor.name]] = blocks
    return lazy, stored


def permuted_heads(gguf_name: str, heads: tuple[int, int] | None) -> int | None:
    """The head count whose rope permutation the rows of tensor `gguf_name` carry, if any."""
    if heads is not None and ".attn_q." in gguf_name:
        return heads[0]
    if heads is not None and ".attn_k." in gguf_name:
        return heads[1]
    return None


@contextlib.contextmanager
def one_thread():
    """Dequantising runs many small memory-bound ops, where torch's intra-op threads cost more than
    they give (up to 10x more when the cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def record_gguf_source(config, path: Path) -> None:
    """Note the source file in the config as from_pretrained(gguf_file=...) does, on transformers
    versions that note it (a GgufConfig), so the artifact's hf_config is what it always was."""
    if GgufConfig is None:
        return
    config.quantization_config = GgufConfig(gguf_file=path.name)
