"""What `--kernels auto` measured, kept per machine: $LLMC_CACHE/kernel_timings/<sha256>.json, one
file per measurement, keyed by everything the figures depend on (what was timed, at which shapes
and thread count, on which CPU model, with which torch and onnxruntime). Compiling segments that
were measured before (a model's layers, the same model again, a test suite's tiny models) times
nothing, and two compiles on one machine record the same figures, so their artifacts are
byte-identical. Each entry records when and under what load it was measured (llmc/cache.py); one
measured while the machine was busy, or whose candidates' timings overlap (too close to call), is
used by this process only and measured again by the next. `llmc cache clear` (or $LLMC_REMEASURE=1)
measures everything again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

from llmc.cache import busy_reason, cache_root, remeasuring, trusting, watch_load, write_json
from llmc.runtime.roofline import cpu_model

# bump when what is measured, or how, changes: older entries then stop matching
TIMING_FORMAT = 4

_memo: dict[Path, dict] = {}   # this process's entries ({"value", "measured"}; also when the folder is not writable)
_log: list[dict] = []          # the measured records of every outermost recall in this process, in order
_depth: list[Path] = []        # the recalls measuring now


class Timings(dict):
    """{candidate: us} as measured, with each candidate's `spread` ((median - best) / best) and the
    `measured` record (when, under what load; "busy" or "close" where it decides nothing)."""

    def __init__(self, us: dict, spread: dict | None = None, measured: dict | None = None):
        super().__init__(us)
        self.spread, self.measured = spread or {}, measured or {}


def cache_dir() -> Path:
    return cache_root() / "kernel_timings"


def machine() -> dict:
    import onnxruntime  # onnxruntime: every compile imports this module, few time ORT kernels

    return {"cpu": cpu_model(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "format": TIMING_FORMAT}


def recall(key: dict, measure: Callable[[], dict], close_call: Callable[[dict], str | None] | None = None) -> dict:
    """recall_measured's value."""
    return recall_measured(key, measure, close_call)[0]


def recall_measured(key: dict, measure: Callable[[], dict],
                    close_call: Callable[[dict], str | None] | None = None) -> tuple[dict, dict]:
    """(value, measured record) for `key` on this machine: cached, else `measure()` under a load watch
    (at key["threads"]), cached unless the machine was busy ("busy": why) or `close_call(value)` says
    why its candidates are too close to call ("close"). A file that does not parse or holds another
    key is measured again and replaced."""
    full = {**key, "machine": machine()}
    text = json.dumps(full, sort_keys=True, default=str)
    path = cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
    if path not in _memo:
        _memo[path] = None if remeasuring() else _read(path, text)
    if _memo[path] is None:
        _depth.append(path)
        try:
            with watch_load(key.get("threads") or torch.get_num_threads()) as load:
                value = json.loads(json.dumps(measure()))   # as a later read will give it
        finally:
            _depth.pop()
        measured = {**load.record, "busy": busy_reason(load.record),
                    "close": None if close_call is None or trusting() else close_call(value)}
        measured = {k: v for k, v in measured.items() if v is not None or k == "other_cores"}
        _memo[path] = {"value": value, "measured": measured}
        if "busy" not in measured and "close" not in measured:
            write_json(path, {"key": json.loads(text), **_memo[path]})
    if not _depth:   # a recall inside another's measurement happens only when that one is measured
        _log.append(_memo[path]["measured"])
    return _memo[path]["value"], _memo[path]["measured"]


def mark() -> int:
    """A place in this process's log of measurements, for summary()."""
    return len(_log)


def summary(since: int = 0) -> dict | None:
    """When and under what load the timings recalled since `since` were measured (plan.meta's
    kernel_choice["timings"]; the same whether they came from the cache or were measured now)."""
    records = _log[since:]
    if not records:
        return None
    others = [r["other_cores"] for r in records if r.get("other_cores") is not None]
    return {"measurements": len(records), "first": min(r["at"] for r in records),
            "last": max(r["at"] for r in records), "other_cores_max": max(others) if others else None,
            "loadavg_max": max(r.get("loadavg", 0.0) for r in records), "cores": records[0].get("cores"),
            "threads": records[0].get("threads"), "busy": sum("busy" in r for r in records),
            "close_calls": sum("close" in r for r in records)}


def _read(path: Path, text: str) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(entry, dict) and entry.get("key") == json.loads(text) and isinstance(entry.get("value"), dict)
          and isinstance(entry.get("measured"), dict))
    return {"value": entry["value"], "measured": entry["measured"]} if ok else None


__all__ = ["recall", "recall_measured", "Timings", "mark", "summary", "cache_dir",
           "machine", "TIMING_FORMAT"]
