"""What every frontend hands on (a float32 HF causal-LM module in eval mode, its config and
tokenizer, and where it came from), plus the checks and hashing the frontends share."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

import torch

from llmc.errors import ModelLoadError

# Causal-LM classes llmc compiles (SmolLM is a LlamaForCausalLM), and their GGUF names.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
ARCHITECTURE_BY_MODEL_TYPE = dict(zip(SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES))

SourceKind = Literal["hf", "gguf", "sample"]


@dataclass
class LoadedModel:
    module: torch.nn.Module        # a transformers *ForCausalLM, eval mode, float32
    config: object                 # its transformers PretrainedConfig
    tokenizer: object              # a transformers PreTrainedTokenizerFast
    name: str
    source_hash: str               # sha256 hex over the source's bytes
    source: str                    # what the user passed: a sample name or a path
    kind: SourceKind


def sha256_file(path: Path) -> str:
    """sha256 hex of one file's bytes, streamed (matches `sha256sum`)."""
    digest = hashlib.sha256()
    _update_from_file(digest, path)
    return digest.hexdigest()


def hash_files(paths: Iterable[Path], root: Path) -> str:
    """sha256 over each file's path relative to root and its bytes, streamed, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        # name and size delimit each file, so moving bytes between files changes the hash
        digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\0".encode())
        _update_from_file(digest, path)
    return digest.hexdigest()


def _update_from_file(digest, path: Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)


def call_transformers(path: Path, load, *args, **kwargs):
    """Call a transformers loader, turning its reports of bad files into a ModelLoadError."""
    # transformers reports missing shards, bad configs and tokenizer trouble as OSError/ValueError.
    try:
        return load(*args, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"transformers cannot load '{path}': {first_line(e)}; "
                             f"check the files are a complete, supported checkpoint") from e


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
