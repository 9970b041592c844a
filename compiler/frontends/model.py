"""What every frontend hands on (a float32 HF causal-LM module in eval mode, its config and
tokenizer, and where it came from), plus the checks and hashing the frontends share."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

import torch

from llmc.compiler.bounded_input import MAX_JSON_DEPTH, json_depth, read_json_bytes
from llmc.compiler.weight_store import LazyTensor, values_of
from llmc.errors import ModelLoadError

try:
    from huggingface_hub.errors import StrictDataclassError  # strict config validation in transformers 5
except ImportError:
    StrictDataclassError = ValueError

# GGUF architectures the GGUF frontend reads (transformers builds them as Llama, Mistral and Qwen2).
# Hugging Face checkpoints have no such list: what compiles is what lowering understands.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")

SourceKind = Literal["hf", "gguf", "sample", "onnx"]


@dataclass
class LoadedModel:
    module: torch.nn.Module        # a transformers *ForCausalLM, eval mode, float32
    config: object                 # its transformers PretrainedConfig
    tokenizer: object              # a transformers PreTrainedTokenizerFast
    name: str
    source_hash: str               # sha256 hex over the source's bytes
    source: str                    # what the user passed: a sample name or a path
    kind: SourceKind
    # param name -> the quantised form the source stores it in (a GGUF block format's codes,
    # scales and minimums), for `--quant gguf` to keep; float-stored weights are absent
    stored_quant: dict[str, Any] = field(default_factory=dict)
    # param name -> its values as a lazy tensor read from the source when asked; the module's
    # own tensors for these names are uninitialised placeholders until materialise()
    lazy_weights: dict[str, LazyTensor] = field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the module's float32 parameters (each shared tensor once)."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def materialise(self) -> None:
        """Read every lazy weight into the module (whole-model memory: for passes that run it)."""
        params = dict(self.module.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, lazy in self.lazy_weights.items():
                params[name].copy_(values_of(lazy))
        self.lazy_weights = {}


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


JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; NaN and Infinity, which JSON itself lacks, are refused."""
    data = read_json_bytes(path, f"'{path}'", ModelLoadError)
    try:
        value = json.loads(data, parse_constant=refuse_constant)
        deep = json_depth(value) > MAX_JSON_DEPTH
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and refuse_constant's are ValueErrors
        raise ModelLoadError(f"'{path}' is not valid JSON ({first_line(e)}); re-download the model") from e
    except RecursionError:   # json's parser recurses once a level
        deep = True
    if deep:
        raise ModelLoadError(f"'{path}' is nested more than {MAX_JSON_DEPTH} levels deep, which no model's "
                             f"file is; re-download the model")
    if not isinstance(value, dict):
        kind = JSON_KINDS.get(type(value), type(value).__name__)
        raise ModelLoadError(f"'{path}' holds a JSON {kind}, not an object; re-download the model")
    return value


def refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def call_transformers(path: Path, load, *args, **kwargs):
    """Call a transformers loader, turning its reports of bad files into a ModelLoadError."""
    # transformers reports missing shards, bad configs and tokenizer trouble as OSError/ValueError;
    # a field of the wrong type or value in a config or tokenizer file surfaces as TypeError,
    # AttributeError or ArithmeticError (zero heads divide by zero).
    try:
        return load(*args, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError, StrictDataclassError) as e:
        raise ModelLoadError(f"transformers cannot load '{path}': {first_line(e)}; "
                             f"check the files are a complete, supported checkpoint") from e


def first_line(error: Exception) -> str:
    """The error's first line, joined with the next when it only introduces it ("...field 'x':")."""
    lines = [line.strip() for line in str(error).strip().splitlines()]
    if not lines or not lines[0]:
        return type(error).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
