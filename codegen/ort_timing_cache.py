"""What `--kernels auto` measured, kept per machine: $LLMC_CACHE/kernel_timings/<sha256>.json, one
file per measurement, keyed by everything the figures depend on (what was timed, at which shapes
and thread count, on which CPU model, with which torch and onnxruntime). Compiling segments that
were measured before (a model's layers, the same model again, a test suite's tiny models) times
nothing, and two compiles on one machine record the same figures, so their artifacts are
byte-identical. Delete the folder to measure again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from llmc.cache import cache_root

# bump when what is measured, or how, changes: older entries then stop matching
TIMING_FORMAT = 3

_memo: dict[Path, dict | None] = {}   # this process's entries (also when the cache folder is not writable)


def cache_dir() -> Path:
    return cache_root() / "kernel_timings"


def machine() -> dict:
    import onnxruntime

    from llmc.runtime.roofline import cpu_model

    return {"cpu": cpu_model(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "format": TIMING_FORMAT}


def recall(key: dict, measure: Callable[[], dict]) -> dict:
    """The cached value for `key` on this machine, else `measure()`, cached. A file that does not
    parse or holds another key is measured again and replaced."""
    full = {**key, "machine": machine()}
    text = json.dumps(full, sort_keys=True, default=str)
    path = cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
    if path not in _memo:
        _memo[path] = _read(path, text)
    if _memo[path] is None:
        _memo[path] = json.loads(json.dumps(measure()))   # as a later read will give it
        _write(path, text, _memo[path])
    return _memo[path]


def _read(path: Path, text: str) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(entry, dict) and entry.get("key") == json.loads(text) and isinstance(entry.get("value"), dict)
    return entry["value"] if ok else None


def _write(path: Path, text: str, value: dict) -> None:
    """Atomically (a rename), so concurrent compiles never read half a file; a cache that cannot
    be written only costs measuring again."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": json.loads(text), "value": value}, sort_keys=True))
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


__all__ = ["recall", "cache_dir", "machine", "TIMING_FORMAT"]
