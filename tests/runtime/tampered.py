"""Tampering with a compiled artifact as an attacker would: edit its JSON files, then re-hash the
manifest so that every sha256 check passes and only the runtime's own checks stand in the way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from llmc.compiler.artifact import MANIFEST, dump_json, sha256_file


def rehash(artifact: Path) -> None:
    """Give every file the manifest lists the sha256 it has now."""
    manifest = json.loads((artifact / MANIFEST).read_text())
    manifest["files"] = {name: sha256_file(artifact / name) for name in manifest["files"]
                         if (artifact / name).is_file()}
    (artifact / MANIFEST).write_text(dump_json(manifest))


def tampered_copy(artifact: Path, dest: Path, edits: dict[str, Callable[[dict], None]]) -> Path:
    """A copy of `artifact` at `dest` with each named JSON file changed in place by its edit
    function, and the manifest re-hashed."""
    shutil.copytree(artifact, dest)
    for name, edit in edits.items():
        data = json.loads((dest / name).read_text())
        edit(data)
        (dest / name).write_text(json.dumps(data))
    rehash(dest)
    return dest


def add_steps(plan: dict, *steps: dict) -> None:
    """Append steps after the plan's last one, each output planned in a fresh slot and typed as
    the step's "type" entry says (default: uint8[4])."""
    for step in steps:
        for out in step["outputs"]:
            plan["memory"]["slot_of"][out] = len(plan["memory"]["slot_bytes"])
            plan["memory"]["slot_bytes"].append(4)
            plan["types"][out] = step.pop("type", {"shape": [4], "dtype": "uint8"})
        plan["steps"].append(step)


def aten_step(name: str, target: str, inputs: list[str], args: list, kwargs: dict | None = None,
              outputs: int = 1, **extra) -> dict:
    return {"kernel": "cpu.aten", "node": name, "inputs": inputs,
            "outputs": [f"{name}.{i}" for i in range(outputs)],
            "attrs": {"target": target, "args": args, "kwargs": kwargs or {}}, **extra}


__all__ = ["rehash", "tampered_copy", "add_steps", "aten_step"]
