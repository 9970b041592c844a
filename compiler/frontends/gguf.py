"""Load a GGUF file through transformers' GGUF support (quantised tensors are dequantised to
float32), after checking the file parses and holds a supported architecture."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmc.compiler.frontends.model import (
    SUPPORTED_GGUF_ARCHITECTURES,
    LoadedModel,
    call_transformers,
    first_line,
    sha256_file,
)
from llmc.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"


def load_gguf_file(path: Path, source: str | None = None) -> LoadedModel:
    """Check and load the model in GGUF file `path`."""
    check_gguf(path)
    kwargs = dict(gguf_file=path.name, local_files_only=True)
    module = call_transformers(path, AutoModelForCausalLM.from_pretrained, path.parent,
                               dtype=torch.float32, attn_implementation="sdpa", **kwargs)
    tokenizer = call_transformers(path, AutoTokenizer.from_pretrained, path.parent, **kwargs)
    return LoadedModel(module=module.eval(), config=module.config, tokenizer=tokenizer,
                       name=path.stem, source_hash=sha256_file(path), source=source or str(path),
                       kind="gguf")


def check_gguf(path: Path) -> str:
    """The file's general.architecture, once the magic, header and tensor table check out."""
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"'{path}' is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); "
                             f"re-download it")
    architecture = read_architecture(path)
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"'{path}': GGUF architecture {architecture!r} is not supported; "
                                    f"llmc compiles {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return architecture


def read_architecture(path: Path) -> str:
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader fails on truncation with ValueError, IndexError, struct errors
        raise ModelLoadError(f"GGUF file '{path}' is truncated or corrupt ({first_line(e)}); "
                             f"re-download it") from e
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"GGUF file '{path}' has no general.architecture; it is not a model file")
    return str(field.contents())

