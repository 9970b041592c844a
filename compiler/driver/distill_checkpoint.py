"""Checkpoints of a distillation run, so that an interrupted run resumes where it stopped. A
checkpoint is a directory (default: OUTPUT.ckpt beside the output artifact) of safetensors files
(the fp32 master weights; AdamW's moments and step counts) and state.json: the step reached, the
run it belongs to, and the sha256 of each file. state.json is replaced atomically after the files
it names are written, so a run killed at any moment leaves the last whole checkpoint; no pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.artifact import sha256_file
from llmc.compiler.driver.distill_options import DistillError

STATE = "state.json"
FORMAT = 1


def default_checkpoint(output: Path) -> Path:
    return output.with_name(output.name + ".ckpt")


def save_checkpoint(path: Path, run: dict, step: int, masters: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, history: list[float]) -> None:
    """Write the run's state after `step` optimiser steps (the files first, state.json last)."""
    path.mkdir(parents=True, exist_ok=True)
    names = {"weights": f"weights-{step}.safetensors", "optimizer": f"optimizer-{step}.safetensors"}
    save_file({name: t.detach().contiguous() for name, t in masters.items()}, path / names["weights"])
    save_file(optimizer_tensors(masters, optimizer), path / names["optimizer"])
    state = {"format": FORMAT, "run": run, "step": step, "history": history, **names,
             "files": {name: sha256_file(path / name) for name in names.values()}}
    temporary = path / f".{STATE}.tmp"
    temporary.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, path / STATE)
    for stale in path.iterdir():   # earlier steps' files
        if stale.name not in names.values() and stale.name != STATE:
            stale.unlink()


def optimizer_tensors(masters: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict:
    out = {}
    for name, param in masters.items():
        for key, value in optimizer.state.get(param, {}).items():
            out[f"{name}/{key}"] = torch.as_tensor(value).detach().clone().contiguous()
    return out


def load_checkpoint(path: Path, run: dict, masters: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer) -> tuple[int, list[float]] | None:
    """Restore the masters and the optimiser from the checkpoint at `path` and return (step reached,
    loss history); None when there is none. A checkpoint of another run, or a damaged one, is
    refused in one line."""
    state = read_state(path)
    if state is None:
        return None
    mismatch = next((k for k in sorted(set(run) | set(state["run"])) if state["run"].get(k) != run.get(k)), None)
    if mismatch is not None:
        raise DistillError(f"checkpoint '{path}' belongs to another run (its {mismatch} is "
                           f"{state['run'].get(mismatch)!r}, this run's {run.get(mismatch)!r}); repeat that run's "
                           f"options to resume it, or remove the checkpoint to start over")
    for name, digest in state["files"].items():
        if not (path / name).is_file() or sha256_file(path / name) != digest:
            raise DistillError(f"checkpoint '{path}': {name} is missing or fails its sha256 check; "
                               f"remove the checkpoint to start over")
    restore_masters(path, load_file(path / state["weights"]), masters)
    moments = load_file(path / state["optimizer"])
    for name, param in masters.items():
        keys = {k.rpartition("/")[2] for k in moments if k.rpartition("/")[0] == name}
        if keys:
            optimizer.state[param] = {k: moments[f"{name}/{k}"] for k in sorted(keys)}
    return state["step"], list(state["history"])


def read_state(path: Path) -> dict | None:
    if not (path / STATE).is_file():
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise DistillError(f"checkpoint '{path}' exists but holds no {STATE}; it is no distillation "
                               f"checkpoint: move it away or pass another --checkpoint")
        return None
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as e:
        raise DistillError(f"checkpoint '{path}': {STATE} cannot be read ({e}); remove the checkpoint to "
                           f"start over") from None
    if not (isinstance(state, dict) and state.get("format") == FORMAT and isinstance(state.get("run"), dict)
            and isinstance(state.get("step"), int) and isinstance(state.get("files"), dict)
            and {state.get("weights"), state.get("optimizer")} == set(state["files"])
            and isinstance(state.get("history"), list)):
        raise DistillError(f"checkpoint '{path}': {STATE} is not one this llmc writes; remove the "
                           f"checkpoint to start over")
    return state


def restore_masters(path: Path, saved: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]) -> None:
    if set(saved) != set(masters) or any(saved[n].shape != masters[n].shape for n in masters):
        raise DistillError(f"checkpoint '{path}' holds other weights than the student's; remove the "
                           f"checkpoint to start over")
    with torch.no_grad():
        for name, master in masters.items():
            master.copy_(saved[name])


def remove_checkpoint(path: Path) -> None:
    """Remove a finished run's checkpoint (its files, then the directory if nothing else is left)."""
    if read_state(path) is None:
        return
    for name in [*read_state(path)["files"], STATE]:
        (path / name).unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        pass


__all__ = ["default_checkpoint", "save_checkpoint", "load_checkpoint", "remove_checkpoint"]
