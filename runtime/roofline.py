"""The memory roofline of a benchmark run: the machine's read bandwidth and fp32 GEMM peak
(measured once per CPU model, thread count and page size, cached in $LLMC_CACHE/bandwidth.json with
when and under what load they were measured; a figure measured on a busy machine, or whose samples
spread too far, is used for that run only) against the weight bytes a decode step reads and the GEMM
FLOPs a run does."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import NamedTuple

import torch

from llmc.cache import busy_reason, cache_root, remeasuring, spread, trusting, watch_load

BANDWIDTH_BYTES = 512 << 20      # the bandwidth probe's least size; 4x the last-level cache where that is more
GEMM_SIZE = 1024
# a figure whose median sample is this much slower than its best is not cached: the machine was
# not steady while it ran
SPREAD_LIMIT = 0.15


class Figure(NamedTuple):
    """A measured machine figure and how far its samples spread (llmc.cache.spread)."""
    value: float
    spread: float


def cache_file() -> Path:
    return cache_root() / "bandwidth.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sample_seconds(fn, repeats: int) -> list[float]:
    fn()   # warm-up: page faults and thread-pool start-up are not bandwidth
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return samples


def _rate(amount: float, samples: list[float]) -> Figure:
    """amount per second at the best sample, and the samples' spread."""
    return Figure(amount / min(samples), spread(samples))


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), 0 where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


def probe_bytes() -> int:
    """A buffer that DRAM, not the cache, must serve, however large the cache: a fixed 512 MiB one fits
    nearly whole in a 480 MiB L3 (on the host that has one, 512 MiB and 2 GiB read alike: 21.2 and
    21.5 GB/s; the guard is for caches that would hold it)."""
    return max(BANDWIDTH_BYTES, 4 * last_level_cache_bytes())


def measure_bandwidth(nbytes: int | None = None, repeats: int = 5) -> Figure:
    """GB/s of an fp32 GEMV over `nbytes` of matrix (what a batch-1 decode step does; default
    probe_bytes()), best of `repeats`, in torch's current thread count."""
    nbytes = probe_bytes() if nbytes is None else nbytes
    cols = 4096
    w = torch.empty(max(1, nbytes // (4 * cols)), cols).fill_(1.0)
    x = torch.ones(cols)
    return _rate(w.numel() * 4 / 1e9, _sample_seconds(lambda: torch.mv(w, x), repeats))


def measure_gemm_peak(size: int = GEMM_SIZE, repeats: int = 5) -> Figure:
    """GFLOP/s of an fp32 square torch.mm, best of `repeats`, in torch's current thread count."""
    a, b = torch.rand(size, size), torch.rand(size, size)
    return _rate(2 * size ** 3 / 1e9, _sample_seconds(lambda: torch.mm(a, b), repeats))


def cache_key(threads: int) -> str:
    """The figures' entry in the cache: torch's tensors on huge pages (llmc/__init__.py) stream faster, so a
    figure measured without them is not the roofline of a run with them."""
    pages = " / huge pages" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else ""
    return f"{cpu_model()} / {threads} threads{pages} / probe {probe_bytes() >> 20} MiB"


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def figure_record(name: str, threads: int, measure, remeasure: bool = False) -> dict:
    """`name` ("bandwidth_gbps" or "gemm_peak_gflops") for this CPU at `threads` threads, as
    {"value", "source": "cache" or "measured", "measured": when and under what load, "not_cached":
    why, where it was not}: from the cache (unless `remeasure` or $LLMC_REMEASURE), else measured by
    `measure()` (a Figure, or a bare number) and cached if the machine was quiet and the samples steady.
    A cached figure without its measured record (an older llmc's) is measured again."""
    path, key = cache_file(), cache_key(threads)
    cache = _read_cache(path)
    entry = cache.get(key) if isinstance(cache.get(key), dict) else {}
    measured = entry.get("measured") if isinstance(entry.get("measured"), dict) else {}
    value = entry.get(name)
    if not (remeasure or remeasuring()) and isinstance(value, (int, float)) and value > 0 and name in measured:
        return {"value": float(value), "source": "cache", "measured": measured[name]}
    with watch_load(threads) as load:
        figure = measure()
    figure = figure if isinstance(figure, Figure) else Figure(float(figure), 0.0)
    record = {**load.record, "spread": figure.spread}
    why = busy_reason(load.record) or _spread_reason(figure)
    if why is None:
        cache[key] = {**entry, name: figure.value, "measured": {**measured, name: record}}
        _write_cache(path, cache)
    return {"value": figure.value, "source": "measured", "measured": record,
            **({"not_cached": why} if why else {})}


def _spread_reason(figure: Figure) -> str | None:
    if trusting() or figure.spread <= SPREAD_LIMIT:
        return None
    return f"its samples spread {figure.spread:.0%} (over {SPREAD_LIMIT:.0%})"


def _write_cache(path: Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=2, sort_keys=True))
    tmp.replace(path)


def machine_figure(name: str, threads: int, measure, remeasure: bool = False) -> float:
    """figure_record's value."""
    return figure_record(name, threads, measure, remeasure)["value"]


def weight_bytes(manifest: dict) -> int:
    """Bytes of weights a decode step reads: all of them, as the manifest's report counts them."""
    return int(sum(manifest["report"]["weight_bytes"].values()))


def gemm_weights(plan) -> tuple[int, int]:
    """Weights multiplied per token run and per sampled row (the LM head after select_rows), from
    the plan's linear steps (those inside ONNX Runtime segments too): in_features x out_features each."""
    per_token = per_row = 0
    for step in (s for top in plan.steps for s in (top.inner_steps() or [top])):
        if not step.kernel.endswith("linear"):
            continue
        out = plan.type_of(step.outputs[0]).shape
        n = (step.attrs.get("in_features") or plan.type_of(step.inputs[0]).shape[-1]) * out[-1]
        if out[0] == "rows":
            per_row += n
        else:
            per_token += n
    return per_token, per_row


def bench_roofline(engine, result, threads: int, bandwidth_gbps: float | None = None,
                   gemm_peak_gflops: float | None = None, remeasure: bool = False) -> dict:
    """The roofline block of `llmc bench --json` for `result` (a run_engine BenchResult): decode
    weight-read GB/s against the memory bandwidth, and the run's GEMM GFLOP/s (2 per weight per
    token) against the fp32 GEMM peak; peaks not given are measured once and cached (`remeasure`:
    measured again and the cache refreshed), and "peaks" says where each came from."""
    peaks = {}
    for name, given, measure in (("bandwidth_gbps", bandwidth_gbps, measure_bandwidth),
                                 ("gemm_peak_gflops", gemm_peak_gflops, measure_gemm_peak)):
        peaks[name] = ({"value": given, "source": "given"} if given else
                       figure_record(name, threads, measure, remeasure))
    bandwidth_gbps, gemm_peak_gflops = peaks["bandwidth_gbps"]["value"], peaks["gemm_peak_gflops"]["value"]
    wbytes, st, m = weight_bytes(engine.manifest), result.steps, result.metrics or engine.metrics
    steps_per_s = st.decode_steps / st.decode_seconds if st.decode_steps and st.decode_seconds > 0 else None
    achieved = wbytes * steps_per_s / 1e9 if steps_per_s else None
    per_token, per_row = gemm_weights(engine.executor.plan)
    flops = 2 * (per_token * m.computed_tokens + per_row * m.generation_tokens) / st.seconds / 1e9
    return {"weight_bytes": wbytes, "bandwidth_gbps": bandwidth_gbps, "achieved_gbps": achieved,
            "fraction": achieved / bandwidth_gbps if achieved is not None else None,
            "decode_steps_per_s": steps_per_s, "decode_tokens_per_step":
                st.decode_tokens / st.decode_steps if st.decode_steps else None,
            "gemm_peak_gflops": gemm_peak_gflops, "achieved_gflops": flops,
            "gemm_fraction": flops / gemm_peak_gflops, "threads": threads, "peaks": peaks}


def format_roofline(r: dict) -> list[str]:
    """One or two text lines: the decode bandwidth figure; the GEMM one for batched (or
    prefill-only) runs."""
    lines = []
    batched = (r["decode_tokens_per_step"] or 2) > 1
    if r["achieved_gbps"] is not None:
        lines.append(f"roofline          weights {r['weight_bytes'] / 2**20:.1f} MiB/token · decode "
                     f"{r['achieved_gbps']:.2f} GB/s = {r['fraction']:.0%} of {r['bandwidth_gbps']:.1f} GB/s")
    if batched or not lines:
        lines.append(f"GEMM              {r['achieved_gflops']:.2f} GFLOP/s = {r['gemm_fraction']:.0%} of "
                     f"{r['gemm_peak_gflops']:.1f} GFLOP/s fp32 peak")
    for name, peak in (r.get("peaks") or {}).items():
        if peak.get("not_cached"):
            lines.append(f"  {name.split('_')[0]} peak measured now, not cached: {peak['not_cached']}")
    return lines
