"""Model frontends: each turns a model source (a sample name, a GGUF file, or a Hugging Face
checkpoint directory) into a LoadedModel: a torch module plus config and tokenizer."""

from __future__ import annotations

from pathlib import Path

from llmc.compiler.bounded_input import file_kind
from llmc.compiler.frontends.gguf import load_gguf_file
from llmc.compiler.frontends.hf import load_hf_dir
from llmc.compiler.frontends.model import SUPPORTED_GGUF_ARCHITECTURES, LoadedModel
from llmc.compiler.frontends.samples import SAMPLES, load_sample
from llmc.errors import ModelLoadError

__all__ = ["load_model", "LoadedModel", "SAMPLES", "SUPPORTED_GGUF_ARCHITECTURES"]

ACCEPTED = "a sample name, a .gguf or .onnx file, or a Hugging Face model directory with config.json"


def load_model(source: str, lazy: bool = False) -> LoadedModel:
    """Load a model source: a sample name, a path to a .gguf or .onnx file (or a directory holding
    one .onnx file and no safetensors), or an HF checkpoint directory. With `lazy`, a source that
    can (a GGUF file) leaves its weights in the file until read (LoadedModel.lazy_weights)."""
    if source in SAMPLES:
        return load_sample(source, lazy)
    path = Path(source).expanduser()
    if is_onnx_source(path):
        # onnx: only .onnx sources (tests/compiler/test_compile_speed_paths.py)
        from llmc.compiler.frontends.onnx_frontend import load_onnx

        return load_onnx(path, source=source)
    if path.is_dir():
        return load_hf_dir(path, source=source, lazy=lazy)
    if path.is_file():
        return load_file(path, source, lazy)
    raise missing_source_error(source)


def is_onnx_source(path: Path) -> bool:
    """A .onnx file, or a directory holding a .onnx file and no safetensors."""
    return path.suffix.lower() == ".onnx" if path.is_file() else (
        path.is_dir() and any(path.glob("*.onnx")) and not any(path.glob("*.safetensors")))


def load_file(path: Path, source: str, lazy: bool = False) -> LoadedModel:
    if path.suffix.lower() != ".gguf":
        hint = "; pass the directory that holds it" if path.suffix in (".safetensors", ".json") else ""
        raise ModelLoadError(f"'{path}' is not a model source: expected {ACCEPTED}{hint}")
    return load_gguf_file(path, source=source, lazy=lazy)


def missing_source_error(source: str) -> ModelLoadError:
    kind = file_kind(Path(source).expanduser()) if source else "no such file or directory"
    if not kind.startswith("no such"):   # /dev/zero, a FIFO: there, but no model
        return ModelLoadError(f"model path '{source}' exists but is {kind}, not a model; pass {ACCEPTED}")
    if any(c in source for c in "/\\~.") or not source:
        return ModelLoadError(f"model path '{source}' does not exist; pass {ACCEPTED}")
    return ModelLoadError(f"unknown model {source!r}: not a sample ({', '.join(SAMPLES)}) "
                          f"and no such file or directory")
