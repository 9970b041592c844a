"""Write and read compiled artifacts: a directory of manifest.json (format version, sha256 of
every file), graph.json, plan.json, weights.safetensors, tokenizer/ and, for Triton plans, kernels/
with its index kernels.json.
Writes are atomic and byte-deterministic; reads check every hash and never unpickle."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llmc.errors import ArtifactError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TIMINGS = "timings.json"  # wall-clock build log: informational, not hashed
GRAPH = "graph.json"
PLAN = "plan.json"
WEIGHTS = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
KERNELS_DIR = "kernels"
KERNEL_INDEX = "kernels.json"  # what each file under kernels/ is and which plan steps launch it


@dataclass
class Artifact:
    path: Path
    manifest: dict
    graph_json: str
    plan_json: str
    weights: dict[str, torch.Tensor]
    tokenizer_dir: Path
    kernels: dict[str, str] = field(default_factory=dict)  # name under kernels/ -> source text


def write_artifact(path, *, graph_json: str, plan_json: str, weights: dict[str, torch.Tensor], tokenizer,
                   manifest: dict, kernels: dict[str, str] | None = None, timings: dict | None = None,
                   force: bool = False, kernel_index: list[dict] | None = None) -> Path:
    """Write an artifact to `path` via a temporary sibling directory renamed into place, so a
    failed write leaves nothing behind. The same inputs give byte-identical files, except
    `timings.json` (the build's wall-clock log), which is therefore not hashed."""
    path = Path(path)
    refuse_existing(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        staging.chmod(0o755)  # mkdtemp makes it owner-only
        write_contents(staging, graph_json, plan_json, weights, tokenizer, manifest, kernels or {}, kernel_index)
        if timings is not None:
            (staging / TIMINGS).write_bytes(dump_json(timings).encode())
        move_into_place(staging, path, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def refuse_existing(path: Path, force: bool) -> None:
    if (path.exists() or path.is_symlink()) and not force:
        raise ArtifactError(f"output '{path}' exists; pass --force to overwrite")


def write_contents(root: Path, graph_json: str, plan_json: str, weights: dict, tokenizer,
                   manifest: dict, kernels: dict[str, str], kernel_index: list[dict] | None = None) -> None:
    (root / GRAPH).write_bytes(graph_json.encode())
    (root / PLAN).write_bytes(plan_json.encode())
    tokenizer.save_pretrained(root / TOKENIZER_DIR)
    for name, source in sorted(kernels.items()):
        kernel_path = root / KERNELS_DIR / checked_relative(name, f"kernel name {name!r}")
        kernel_path.parent.mkdir(parents=True, exist_ok=True)
        kernel_path.write_bytes(source.encode())
    if kernel_index is not None:
        (root / KERNEL_INDEX).write_bytes(dump_json(kernel_index).encode())
    stored, aliases = dedupe_weights(weights)
    save_file(stored, root / WEIGHTS, metadata=None)
    manifest = dict(manifest, format_version=FORMAT_VERSION, weight_aliases=aliases,
                    files={name: sha256_file(root / name) for name in list_files(root)})
    (root / MANIFEST).write_bytes(dump_json(manifest).encode())


def dedupe_weights(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each distinct view once (tied embeddings share one tensor); the other names become
    aliases of the first name in sorted order. Returns (stored, {alias: stored name})."""
    first_name: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name in sorted(weights):
        tensor = weights[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        first = first_name.setdefault(view_key(name, tensor), name)
        if first != name:
            aliases[name] = first
    storage_uses: dict[object, int] = {}
    for key in first_name:
        storage_uses[key[0]] = storage_uses.get(key[0], 0) + 1
    stored = {}
    for key, name in sorted(first_name.items(), key=lambda item: item[1]):
        tensor = weights[name].detach().to("cpu").contiguous()
        # different views of one storage (slices of a fused tensor) must be saved as separate copies
        stored[name] = tensor.clone() if storage_uses[key[0]] > 1 else tensor
    return stored, aliases


def view_key(name: str, tensor: torch.Tensor) -> tuple:
    """Equal for two tensors exactly when they are the same view of the same memory."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return (name,)  # no memory to share
    storage = (tensor.device.type, tensor.device.index, tensor.untyped_storage().data_ptr())
    return (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def move_into_place(staging: Path, path: Path, force: bool) -> None:
    if not (path.exists() or path.is_symlink()):
        os.rename(staging, path)
        return
    refuse_existing(path, force)
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
    os.rename(path, old)
    try:
        os.rename(staging, path)
    except BaseException:
        os.rename(old, path)
        raise
    remove_path(old)


def read_artifact(path, verify: bool = True) -> Artifact:
    """Read the artifact at `path`; with verify, first check every file against the manifest."""
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"artifact '{path}' not found (no such directory); "
                            f"compile one with `llmc compile`")
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest)
    return Artifact(path=path, manifest=manifest, graph_json=read_text(path, GRAPH),
                    plan_json=read_text(path, PLAN), weights=read_weights(path, manifest),
                    tokenizer_dir=path / TOKENIZER_DIR, kernels=read_kernels(path))


def read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(f"artifact '{path}' has no {MANIFEST}: not an llmc artifact, or its write "
                            f"was interrupted; recompile")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"artifact '{path}': {MANIFEST} is not valid JSON ({e}); recompile") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ArtifactError(f"artifact '{path}': {MANIFEST} has no 'files' table; recompile")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"artifact '{path}' has format version {manifest.get('format_version')!r}; "
                            f"this llmc reads version {FORMAT_VERSION}; recompile with this llmc")
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    listed = manifest["files"]
    unlisted = sorted(set(list_files(path)) - set(listed) - {MANIFEST, TIMINGS})
    if unlisted:
        raise ArtifactError(f"artifact '{path}': file {unlisted[0]} is not listed in {MANIFEST} "
                            f"(added after compiling?); remove it or recompile")
    for name, digest in sorted(listed.items()):
        file = path / checked_relative(name, f"artifact '{path}': {MANIFEST} entry {name!r}")
        if not file.is_file():
            raise ArtifactError(f"artifact '{path}': file {name} is missing; recompile")
        if sha256_file(file) != digest:
            raise ArtifactError(f"artifact '{path}': file {name} fails its sha256 check "
                                f"(tampered or truncated); recompile")


def read_weights(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    try:
        weights = load_file(path / WEIGHTS)  # safetensors: plain bytes, no code runs on load
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"artifact '{path}': file {WEIGHTS} cannot be read ({e}); recompile") from e
    for alias, name in sorted(manifest.get("weight_aliases", {}).items()):
        if name not in weights:
            raise ArtifactError(f"artifact '{path}': weight alias {alias!r} names missing weight {name!r}; "
                                f"recompile")
        weights[alias] = weights[name]
    return weights


def read_kernels(path: Path) -> dict[str, str]:
    kernels_dir = path / KERNELS_DIR
    if not kernels_dir.is_dir():
        return {}
    return {name: (kernels_dir / name).read_text() for name in list_files(kernels_dir)}


def read_text(path: Path, name: str) -> str:
    try:
        return (path / name).read_bytes().decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(f"artifact '{path}': file {name} cannot be read ({e}); recompile") from e


def load_tokenizer(artifact: Artifact):
    """The artifact's tokenizer as a transformers PreTrainedTokenizerFast."""
    from transformers import AutoTokenizer  # the runtime pays for transformers only when it asks
    return AutoTokenizer.from_pretrained(artifact.tokenizer_dir, local_files_only=True)


def list_files(root: Path) -> list[str]:
    """Every file under root, as sorted POSIX paths relative to it."""
    found = []
    for directory, _, files in os.walk(root):
        found += [(Path(directory) / f).relative_to(root).as_posix() for f in files]
    return sorted(found)


def checked_relative(name: str, what: str) -> PurePosixPath:
    relative = PurePosixPath(name)
    if not relative.parts or "\\" in name or relative.is_absolute() or ".." in relative.parts:
        raise ArtifactError(f"{what} is not a plain relative path inside the artifact")
    return relative


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def dump_json(value) -> str:
    return json.dumps(value, sort_keys=True, indent=1) + "\n"


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
