"""Where llmc keeps what it measures, builds or fetches on this machine: $LLMC_CACHE, else
~/.cache/llmc (kernel timings, bandwidth, Triton kernels, native kernels, the sample model); and
whether a measurement may be kept there or steer a choice: the load other processes put on the
machine while it ran, and how far its samples spread. A figure measured while the machine was busy
is used once and not cached; timings whose ranges overlap decide nothing (the default stays)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Sequence

import psutil

from llmc.errors import LlmcError

# "1": choose and cache from every measurement whatever the load and spread (a machine known to
# be dedicated; the test suite, whose timings of tiny models prove nothing either way)
TRUST_ENV = "LLMC_TRUST_TIMINGS"
# "1": measure again what is cached, and replace it (`llmc bench --remeasure` sets it)
REMEASURE_ENV = "LLMC_REMEASURE"
# cores other processes may take beyond those this process leaves spare, on average over a
# measurement: a background daemon's blips pass, a compile or a test suite beside it does not
BUSY_MARGIN = 0.5
# the shortest measurement whose CPU times (counted in 10 ms ticks) say what other processes took
MIN_WINDOW_S = 0.5

# what the cache holds: name in cache_root() -> what it is, and whether it is a measurement
ENTRIES = {
    "kernel_timings": ("kernel timings (--kernels auto)", True),
    "bandwidth.json": ("memory bandwidth and fp32 GEMM peak (llmc bench's roofline)", True),
    "triton": ("rendered Triton kernels", False),
    "native": ("native CPU kernels built for this machine", False),
    "smollm2-135m": ("the SmolLM2-135M sample model", False),
    "calibration": ("calibration text each model sampled (calibrated compiles)", False),
    "wheels": ("fetched wheels", False),
}


def cache_root() -> Path:
    return Path(os.environ.get("LLMC_CACHE") or "~/.cache/llmc").expanduser()


def trusting() -> bool:
    return os.environ.get(TRUST_ENV) == "1"


def remeasuring() -> bool:
    return os.environ.get(REMEASURE_ENV) == "1"


class LoadWatch:
    """What other processes took of the machine while the `with` block ran: the system's busy CPU
    time less this process's own (psutil), per second of wall time, and the 1-minute load average.
    `record` (after the block): {"at", "seconds", "other_cores", "loadavg", "cores", "threads"}."""

    def __init__(self, threads: int):
        self.threads, self.record = threads, None

    def __enter__(self) -> LoadWatch:
        self._start = (time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds())
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, own = time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds()
        seconds = max(wall - self._start[0], 1e-9)
        other = None   # a short window's CPU times are a few clock ticks: the load average decides then
        if busy is not None and self._start[1] is not None and seconds >= MIN_WINDOW_S:
            other = min(os.cpu_count() or 1, max(0.0, (busy - self._start[1]) - (own - self._start[2])) / seconds)
        self.record = {"at": now(), "seconds": round(seconds, 3),
                       "other_cores": None if other is None else round(other, 2),
                       "loadavg": round(load_average(), 2), "cores": os.cpu_count() or 1, "threads": self.threads}


def watch_load(threads: int) -> LoadWatch:
    return LoadWatch(threads)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have run on the machine since boot (None where it cannot be read)."""
    try:
        t = psutil.cpu_times()
    except OSError:
        return None
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def own_cpu_seconds() -> float:
    """CPU seconds of this process, every thread (ONNX Runtime's pools too) and the children it waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def busy_reason(record: dict) -> str | None:
    """Why the measurement `record` (LoadWatch.record) was taken on a busy machine, or None: other
    processes took more than the cores it left spare (plus BUSY_MARGIN); where their CPU time could
    not be read, the load average over the cores."""
    if trusting():
        return None
    cores, threads = record.get("cores") or 1, record.get("threads") or 1
    limit = max(0, cores - threads) + BUSY_MARGIN
    other = record.get("other_cores")
    if other is not None:
        return None if other <= limit else (f"other processes took {other:.1f} of {cores} cores while it ran "
                                            f"(it used {threads}; {limit:.1f} may be taken)")
    loadavg = record.get("loadavg") or 0.0
    return None if loadavg <= cores + BUSY_MARGIN else f"the load average was {loadavg:.1f} on {cores} cores"


def write_json(path: Path, entry: dict | list) -> None:
    """`entry` as JSON at `path`, atomically (a rename), so concurrent processes never read half a file;
    a cache that cannot be written only costs measuring again."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry, sort_keys=True))
        tmp.replace(path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def spread(samples: Sequence[float]) -> float:
    """How far a measurement's samples spread: (median - best) / best (0 for one sample)."""
    best = min(samples)
    return round((statistics.median(samples) - best) / best, 4) if best > 0 else 0.0


def pick(ranges: dict[str, tuple[float, float]], order: Sequence[str]) -> tuple[str, str | None]:
    """The cheapest candidate by `ranges` ({name: (best, typical) cost}), unless its range overlaps
    that of a candidate earlier in `order` (the default first): then the earliest such, and why."""
    fastest = min(ranges, key=lambda name: ranges[name][0])
    if trusting():
        return fastest, None
    low, high = ranges[fastest]
    for name in order:
        if name == fastest:
            return fastest, None
        if name in ranges and ranges[name][0] <= high and low <= ranges[name][1]:
            return name, (f"too close to call: {fastest} {_span(ranges[fastest])} overlaps {name} "
                          f"{_span(ranges[name])}; {name} kept as the default")
    return fastest, None


def _span(r: tuple[float, float]) -> str:
    return f"{r[0]:.0f}-{r[1]:.0f} us"


def describe_load(record: dict) -> str:
    """One phrase: when and under what load a measurement was taken."""
    other = record.get("other_cores")
    others = "other processes' share unknown" if other is None else f"other processes {other:.1f} cores"
    return (f"{record.get('at', '?')}, {others} of {record.get('cores', '?')} beside its {record.get('threads', '?')} "
            f"threads, load average {record.get('loadavg', 0):.1f}")


def summary_line(record: dict) -> str:
    """A compile's record of its kernel timings (compiler/driver/tuning/ort_timing_cache.summary) in one
    line (llmc inspect)."""
    if not record.get("measurements"):
        return "nothing measured"
    other = record.get("other_cores_max")
    load = "other processes' share unknown" if other is None else f"other processes at most {other:.1f}"
    doubts = [f"{record[k]} {what}" for k, what in (("busy", "measured busy (not cached, defaults kept)"),
                                                   ("close_calls", "too close to call (defaults kept)")) if record[k]]
    return (f"{record['measurements']} timings measured {record['first']} to {record['last']}, {load} of "
            f"{record['cores']} cores beside {record['threads']} threads, load average at most "
            f"{record['loadavg_max']:.1f}" + ("; " + ", ".join(doubts) if doubts else ""))


def cache_info() -> list[dict]:
    """What the cache holds: one dict per entry (name, what, path, files, bytes, and for measurements
    their measured records: when and under what load)."""
    root = cache_root()
    out = []
    for name, (what, measurement) in ENTRIES.items():
        path = root / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        info = {"name": name, "what": what, "path": str(path), "files": len(files),
                "bytes": sum(p.stat().st_size for p in files), "measurement": measurement}
        if measurement:
            info["measured"] = [m for p in files for m in _measured_records(p)]
        out.append(info)
    return out


def _measured_records(path: Path) -> list[dict]:
    """The measured records in a cache file: a kernel timing's one, bandwidth.json's per figure."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict):
        return []
    if isinstance(data.get("measured"), dict):
        return [data["measured"]]
    return [m for entry in data.values() if isinstance(entry, dict)
            for m in (entry.get("measured") or {}).values() if isinstance(m, dict)]


def clear_cache(names: Sequence[str] | None = None) -> list[Path]:
    """Remove `names` (ENTRIES' keys; None: the measurements) from the cache; the paths removed."""
    names = [n for n, (_, m) in ENTRIES.items() if m] if names is None else list(names)
    removed = []
    for name in names:
        if name not in ENTRIES:
            raise LlmcError(f"the cache holds no {name!r}; name one of {', '.join(ENTRIES)}")
        path = cache_root() / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(path)
    return removed


__all__ = ["cache_root", "watch_load", "busy_reason", "spread", "pick", "describe_load", "summary_line", "cache_info",
           "clear_cache", "trusting", "remeasuring", "ENTRIES", "TRUST_ENV", "REMEASURE_ENV"]
