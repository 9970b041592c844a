"""Read the tensor table of an HF checkpoint's weights from their safetensors headers: the one
`model.safetensors`, or the shards `model.safetensors.index.json` names, which must agree with it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from llmc.compiler.frontends.model import read_json_object
from llmc.compiler.frontends.tensor_table import StoredTensor, count, listing
from llmc.errors import ModelLoadError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_safetensors_table(path: Path) -> tuple[str, dict[str, StoredTensor]]:
    """Where the weights are, quoted for messages, and every tensor they declare: what transformers loads."""
    index = path / INDEX
    if index.is_file():
        return f"'{index}'", read_shards(path, index)
    single = path / SINGLE
    if single.is_file():
        return f"'{single}'", read_header(single)
    found = ", ".join(sorted(p.name for p in path.glob("*.safetensors")))
    raise ModelLoadError(f"directory '{path}' has neither {SINGLE} nor {INDEX} (found {found}); "
                         f"name a single weights file {SINGLE}, or add the index of its shards")


def tensor_files(path: Path) -> dict[str, Path]:
    """Each tensor's file: the shard the index places it in, or the single weights file (both
    already checked by read_safetensors_table)."""
    index = path / INDEX
    if index.is_file():
        return {name: path / shard for name, shard in read_weight_map(index).items()}
    with safe_open(path / SINGLE, framework="pt") as f:
        return dict.fromkeys(f.keys(), path / SINGLE)


def read_tensor(file: Path, name: str) -> torch.Tensor:
    """One tensor's values from a safetensors file, the rest of the file left unread."""
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The file's tensors as its header declares them (the header was checked against the file size)."""
    with safe_open(file, framework="pt") as f:
        return {name: stored_tensor(f.get_slice(name)) for name in f.keys()}


def stored_tensor(view) -> StoredTensor:
    dtype = view.get_dtype()
    return StoredTensor(shape=tuple(view.get_shape()), dtype=dtype, is_float=dtype.startswith(("F", "BF")))


def read_shards(path: Path, index: Path) -> dict[str, StoredTensor]:
    """The union of the shards' tensors, once each shard is a safetensors file beside the index and
    the index places every tensor in the shard that holds it."""
    weight_map = read_weight_map(index)
    table: dict[str, StoredTensor] = {}
    for shard in sorted(set(weight_map.values())):
        file = path / shard
        if Path(shard).name != shard or not shard.endswith(".safetensors") or not file.is_file():
            raise ModelLoadError(f"'{index}' names shard {shard!r}, which is not a .safetensors file in "
                                 f"'{path}'; re-download the checkpoint")
        for name, tensor in read_header(file).items():
            if weight_map.get(name) != shard:
                raise ModelLoadError(f"'{file}' holds tensor '{name}' but '{index}' places it "
                                     f"{repr(weight_map[name]) if name in weight_map else 'nowhere'}; "
                                     f"the index and its shards disagree: re-download the checkpoint")
            table[name] = tensor
    absent = sorted(set(weight_map) - set(table))
    if absent:
        raise ModelLoadError(f"'{index}' places {count(absent, 'tensor')} in shards that do not hold "
                             f"them ({listing(absent)}); the index and its shards disagree: re-download "
                             f"the checkpoint")
    return table


def read_weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(f"'{index}' has no weight_map object of tensor names to shard file names; "
                             f"re-download the checkpoint")
    return weight_map
