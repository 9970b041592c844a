"""`llmc bench --plot`: latency CDFs and throughput over time, ours beside the baseline."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backend_bases import FigureCanvasBase

from llmc.errors import RuntimeLlmcError


def check_plot_path(path: str) -> None:
    """Refuse, before the benchmark runs, a --plot path that could not be written after it."""
    file = Path(path)
    parent = file.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise RuntimeLlmcError(f"--plot '{path}': '{parent}' is not a writable directory; "
                               "pick a path in an existing directory you can write")
    if file.is_dir():
        raise RuntimeLlmcError(f"--plot '{path}' is a directory; give a file name such as bench.png")
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = file.suffix.lstrip(".").lower()
    if suffix and suffix not in formats:
        raise RuntimeLlmcError(f"--plot '{path}': cannot write a .{suffix} image; use one of "
                               f"{', '.join('.' + f for f in sorted(formats))}")


def plot_bench(result, path: str, baseline=None, title: str = "llmc bench", baseline_name: str = "HF") -> None:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes its backend when it loads

    fig, (cdf, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in (("TTFT", result.ttft_s), ("TPOT", result.tpot_s), ("ITL", result.itl_s)):
        if values:
            v = np.sort(np.asarray(values) * 1e3)
            cdf.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of samples")
    cdf.set_title("latency CDFs")
    cdf.grid(alpha=0.3)
    cdf.legend()
    t = np.array([p[0] for p in result.timeline])
    n = np.array([p[1] for p in result.timeline])
    if len(t):
        width = max(t[-1] / 40, 1e-3)
        bins = np.arange(0, t[-1] + width, width)
        counts, edges = np.histogram(t, bins=bins, weights=n)
        thr.plot(edges[:-1], counts / width, label=f"llmc ({result.output_tokens_per_s:.0f} tok/s overall)")
    if baseline is not None:
        thr.axhline(baseline.output_tokens_per_s, color="gray", linestyle="--",
                    label=f"{baseline_name} baseline ({baseline.output_tokens_per_s:.0f} tok/s overall)")
    thr.set_xlabel("time (s)")
    thr.set_ylabel("output tokens/s")
    thr.set_title("throughput over time")
    thr.grid(alpha=0.3)
    thr.legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise RuntimeLlmcError(f"--plot '{path}' could not be written ({e.strerror or e}); the results "
                               "above are complete, only the plot is missing") from None
    finally:
        plt.close(fig)
