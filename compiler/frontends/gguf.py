"""Load a GGUF file through transformers' GGUF support (quantised tensors are dequantised to
float32), after checking the file parses, holds a supported architecture, and declares exactly the
tensors its metadata's model needs, in types gguf can dequantize: checked before any allocation."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, ReaderTensor, get_tensor_name_map
from gguf.quants import _type_traits as DEQUANTIZERS  # the types gguf.dequantize handles besides F32/F16
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llmc.compiler.frontends.config_check import check_config_values
from llmc.compiler.frontends.model import (
    SUPPORTED_GGUF_ARCHITECTURES,
    LoadedModel,
    call_transformers,
    first_line,
    sha256_file,
)
from llmc.compiler.frontends.tensor_table import (
    StoredTensor,
    check_loading_info,
    check_tensor_table,
    meta_model,
)
from llmc.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
PLAIN_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
VOCABULARY = "tokenizer.ggml.tokens"


def load_gguf_file(path: Path, source: str | None = None) -> LoadedModel:
    """Check and load the model in GGUF file `path`."""
    reader, architecture = check_gguf(path)
    where = f"GGUF file '{path}'"
    kwargs = dict(gguf_file=path.name, local_files_only=True)
    config = call_transformers(path, AutoConfig.from_pretrained, path.parent, **kwargs)
    check_config_values(config, where)
    module = meta_model(config, where)
    check_tensor_table(module, tensor_table(reader, architecture, module, where), where)
    del reader  # its memory map of the file; transformers opens its own
    tokenizer = call_transformers(path, AutoTokenizer.from_pretrained, path.parent, **kwargs)
    module, info = call_transformers(path, AutoModelForCausalLM.from_pretrained, path.parent,
                                     dtype=torch.float32, attn_implementation="sdpa",
                                     output_loading_info=True, **kwargs)
    check_loading_info(info, where)
    return LoadedModel(module=module.eval(), config=module.config, tokenizer=tokenizer,
                       name=path.stem, source_hash=sha256_file(path), source=source or str(path),
                       kind="gguf")


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
        return GGUFReader(path)
    except Exception as e:  # the reader fails on truncation with ValueError, IndexError, struct errors
        raise ModelLoadError(f"GGUF file '{path}' is truncated or corrupt ({first_line(e)}); "
                             f"re-download it") from e


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


def tensor_table(reader: GGUFReader, architecture: str, module: torch.nn.Module,
                 where: str) -> dict[str, StoredTensor]:
    """The file's tensors under the names transformers loads them as (via gguf's name map); a tensor
    the map does not know keeps its GGUF name, so it is reported as extra."""
    arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:  # transformers maps names through the same table, so it could not load it either
        raise UnsupportedModelError(f"{where}: the gguf package has no tensor names for architecture "
                                    f"{architecture!r}; convert the model with general.architecture 'llama'")
    name_map = get_tensor_name_map(arch, module.config.num_hidden_layers)
    hf_names = {}
    for hf_name in module.state_dict():
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(stem)
        if gguf_name is not None:
            hf_names[f"{gguf_name}.{suffix}"] = hf_name
    return {hf_names.get(t.name, t.name): stored_tensor(t) for t in reader.tensors}


def stored_tensor(tensor: ReaderTensor) -> StoredTensor:
    # GGUF lists dimensions innermost first; torch outermost first.
    return StoredTensor(shape=tuple(int(d) for d in reversed(tensor.shape.tolist())),
                        dtype=tensor.tensor_type.name, is_float=True)
